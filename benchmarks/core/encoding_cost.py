"""What the message encodings cost the server, against what it spends aggregating the same
round (``uplink-encoding`` / ``downlink-encoding``, flower_app/wire/encoding.py).

    python -m benchmarks.core.encoding_cost       # the 7B shape: 32 layers, q and v, r = 16
    python -m benchmarks.core.encoding_cost --methods florg --clients 4 --repeats 3
    python -m benchmarks.core.encoding_cost --quick           # a tiny shape (the test's)
    python -m benchmarks.core.encoding_cost --encodings all   # int8-g and int4-g too

For each method the round is built as ``benchmarks.core.server_methods`` builds it (the
strategy the ServerApp builds, N clients' seeded round-1 replies at the shape, float32).
Side by side, every encoding once per repeat, the median of ``--repeats`` after a warm-up:

- **aggregation**: ``strategy.aggregate_adapter`` over the N replies (the round's
  ``agg-seconds`` less the head's FedAvg);
- **server codec**: what stands between a reply's bytes and the arrays the rule reads, and
  the state sent down: decoding the N replies (``decode_record``), reading every array
  as the reply checks do (``Array.numpy()``: np.load for a received float32 array, nothing
  for a decoded one, which keeps its values), and encoding the one global state it sends
  (``encode_record``, the same record for every node). fp32's row is that read alone;
- **codec / aggregation**: what the encoding adds to the server's round over fp32's row,
  against the aggregation (negative: less than reading float32; the goal: at most 10% for
  the mean methods, 5% for FLoRG);
- **client codec**: what it adds to one client's round: encoding its reply and decoding
  the state it was sent.

The last columns are the bytes a reply's content takes serialised (its Flower RecordDict as
protobuf) and their ratio to fp32's.

A second table times the byte count of the metrics rows (``wire_bytes_each``,
flower_app/wire/deployment_bytes.py) over the round's 2N messages (N training messages
sharing the encoded global record, N replies with their metrics) against the same
aggregation (the goal: under 1%), with a reply's and a training message's bytes as a
deployment sends them against their contents' protobuf.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.core.server_methods import Case, blas_threads, build_case
from benchmarks.core.settings import ServerShape

# The 7B shape: 32 decoder layers, q and v adapted (64 layers), k = 4096, r = 16.
SHAPE_7B = ServerShape("7b-r16", layers=64, k=4096, clients=10, rank=16, dense_reference=False)
SHAPE_QUICK = ServerShape("quick", layers=4, k=96, clients=3, rank=4, dense_reference=False)
# the encodings a run compares by default; --encodings all: every one the module offers
ENCODINGS = ("fp32", "bf16", "fp16", "int8")


@dataclass
class Row:
    method: str
    encoding: str
    aggregation_s: float
    server_codec_s: float
    client_codec_s: float
    reply_bytes: int
    count_s: float = 0.0  # counting the round's 2N messages' bytes (wire_bytes_each)
    reply_wire: int = 0  # a reply's bytes as a deployment sends it
    reply_proto: int = 0  # the reply's content (arrays and metrics) serialised (protobuf)
    sent_wire: int = 0  # a training message's bytes as a deployment sends it
    sent_proto: int = 0  # its content (arrays and config) serialised

    fp32_codec_s: float = 0.0  # fp32's server codec in the same pass: reading float32

    @property
    def share(self) -> float:
        return (self.server_codec_s - self.fp32_codec_s) / self.aggregation_s

    @property
    def count_share(self) -> float:
        return self.count_s / self.aggregation_s


def _median(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def round_messages(sent: Any, replies: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """A round's messages as the ServerApp sends and receives them: one training message a
    client, all carrying the one encoded global record ``sent`` with their config, and each
    client's reply record with its metrics."""
    from flwr.app import ConfigRecord, Message, Metadata, MetricRecord, RecordDict

    def metadata(node: int, reply_to: str) -> Metadata:
        return Metadata(
            run_id=1, message_id="", src_node_id=1, dst_node_id=node,
            reply_to_message_id=reply_to, group_id="1", created_at=time.time(), ttl=3600.0,
            message_type="train",
        )  # fmt: skip

    down = [
        Message(
            metadata=metadata(node, ""),
            content=RecordDict({"arrays": sent, "config": ConfigRecord({"server-round": 1})}),
        )
        for node in range(2, 2 + len(replies))
    ]
    up = [
        Message(
            metadata=metadata(1, f"{node:064x}"),
            content=RecordDict(
                {"arrays": record, "metrics": MetricRecord({"num-examples": 256, "loss": 1.5})}
            ),
        )
        for node, record in enumerate(replies, start=2)
    ]
    return down, up


def codec_rows(case: Case, repeats: int, encodings: Sequence[str] = ENCODINGS) -> list[Row]:
    """Every encoding of ``case``'s round, with the aggregation timed in the same pass."""
    import numpy as np
    from flwr.app import RecordDict
    from flwr.common.serde import recorddict_to_proto

    from flower_app.wire.deployment_bytes import wire_bytes, wire_bytes_each
    from flower_app.wire.encoding import decode_record, encode_record

    global_state = {k: np.asarray(v, np.float32) for k, v in case.strategy.global_state.items()}
    rows = []
    for encoding in encodings:
        rng = np.random.default_rng(0)
        replies = [encode_record(p, encoding, rng) for p in case.payloads]

        def server(replies=replies, encoding=encoding, rng=rng) -> None:
            for record in replies:
                for array in decode_record(record, encoding).values():
                    array.numpy()  # as the reply checks read it
            encode_record(global_state, encoding, rng)

        def client(encoding=encoding, rng=rng) -> None:
            sent = encode_record(global_state, encoding, rng)
            decode_record(sent, encoding)
            encode_record(case.payloads[0], encoding, rng)

        down, up = round_messages(encode_record(global_state, encoding, rng), replies)

        def count(down=down, up=up) -> None:
            wire_bytes_each(down)
            wire_bytes_each(up)

        aggregation = _median(case.round, repeats)
        content = recorddict_to_proto(RecordDict({"arrays": replies[0]}))
        rows.append(
            Row(
                case.name,
                encoding,
                aggregation,
                _median(server, repeats),
                _median(client, repeats),
                content.ByteSize(),
                count_s=_median(count, repeats),
                reply_wire=wire_bytes(up[0]),
                reply_proto=recorddict_to_proto(up[0].content).ByteSize(),
                sent_wire=wire_bytes(down[0]),
                sent_proto=recorddict_to_proto(down[0].content).ByteSize(),
            )
        )
    fp32 = next((r.server_codec_s for r in rows if r.encoding == "fp32"), 0.0)
    for row in rows:
        row.fp32_codec_s = fp32
    return rows


def table(rows: Sequence[Row], shape: ServerShape) -> str:
    lines = [
        f"shape {shape.name}: {shape.layers} adapted layers, k = {shape.k}, r = {shape.rank}, "
        f"{shape.clients} clients; medians",
        "",
        "| method | encoding | aggregation s | server codec s | codec / aggregation | "
        "client codec s | reply bytes | vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fp32 = {r.method: r.reply_bytes for r in rows if r.encoding == "fp32"}
    for r in rows:
        lines.append(
            f"| {r.method} | {r.encoding} | {r.aggregation_s:.3f} | {r.server_codec_s:.3f} | "
            f"{r.share:+.1%} | {r.client_codec_s:.3f} | {r.reply_bytes:,} | "
            f"{r.reply_bytes / fp32[r.method]:.3f} |"
        )
    lines += [
        "",
        "byte count of the metrics rows (wire_bytes_each) over the round's 2N messages; a "
        "reply's and a training message's bytes as a deployment sends them, against protobuf",
        "",
        "| method | encoding | aggregation s | byte count s | count / aggregation | "
        "reply wire bytes | vs protobuf | sent wire bytes | vs protobuf |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.encoding} | {r.aggregation_s:.3f} | {r.count_s:.4f} | "
            f"{r.count_share:.2%} | {r.reply_wire:,} | {r.reply_wire / r.reply_proto:.3f} | "
            f"{r.sent_wire:,} | {r.sent_wire / r.sent_proto:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.core.encoding_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--methods", default="florg,fedit,rolora")
    parser.add_argument("--clients", type=int, default=None, help="N (default: the shape's)")
    parser.add_argument("--layers", type=int, default=None, help="adapted layers (default 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny shape, for the tests")
    parser.add_argument(
        "--encodings",
        default=",".join(ENCODINGS),
        help="a comma list (fp32, the baseline, always runs first), or 'all': every "
        "encoding of flower_app/wire/encoding.py",
    )
    args = parser.parse_args(argv)
    import strategies.registry  # noqa: F401  (the methods register)
    from flower_app.wire.encoding import ENCODINGS as OFFERED

    chosen = args.encodings.split(",") if args.encodings != "all" else list(OFFERED)
    unknown = [e for e in chosen if e.strip() not in OFFERED]
    if unknown:
        parser.error(f"--encodings: unknown {unknown}; choose from {OFFERED} or 'all'")
    # fp32 first: the rows' "vs fp32" column divides by its bytes
    encodings = ["fp32", *(e.strip() for e in chosen if e.strip() != "fp32")]
    shape = SHAPE_QUICK if args.quick else SHAPE_7B
    if args.clients is not None or args.layers is not None:
        shape = ServerShape(
            shape.name, args.layers or shape.layers, shape.k, args.clients or shape.clients,
            shape.rank, False,
        )  # fmt: skip
    # One BLAS thread, as the server-step benchmark (steady timings on a shared machine), and
    # Flower's logger quiet (the strategies' per-round lines are not news here); both are
    # the process's, so they are put back for a caller that goes on (the tests call main).
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.ERROR)
    rows: list[Row] = []
    try:
        with blas_threads(1):
            for name in args.methods.split(","):
                case = build_case(name.strip(), shape, shape.layers, "cpu")
                rows += codec_rows(case, args.repeats, encodings)
                del case
    finally:
        flwr_log.setLevel(level)
    print(table(rows, shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
