"""What secure aggregation adds to one round: time and bytes, plain and secure side by side.

    python -m benchmarks.core.secure_overhead   # FedIT and FLoRG, MiniLM shape, N = 5..50
    python -m benchmarks.core.secure_overhead --shape 7b --clients 5 --methods fedit

One process: N clients answer in process (the ClientApp's mod, flower_app/secure/client_mod.py,
around a training step that returns a fixed upload), so the times are the protocol's
arithmetic without the network: the server's (the round loop, the sum, unmasking, the rule)
and the clients' (key agreement, shares, quantising and masking, summed over the N clients).
Bytes are ``wire_bytes`` of every message and reply, as the rows count them. The plain round
is the same strategy's ``aggregate_train`` over the same uploads (docs/secure-aggregation.md).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import strategies.registry  # noqa: F401  (every method registers)
from florg_tools.in_process_grid import InProcessGrid
from flower_app.methods.registry import build_strategy, get_method
from flower_app.settings.config import resolve_config
from flower_app.wire.deployment_bytes import wire_bytes
from flower_app.wire.records import to_array_record

# adapted layers (q and v of every block), k (W0 is k x k), rank
SHAPES = {"minilm": (24, 384, 8), "roberta-large": (48, 1024, 8), "7b": (64, 4096, 16)}


def initial_state(method: str, shape: tuple[int, int, int], rng) -> dict[str, np.ndarray]:
    layers, k, rank = shape
    kind = get_method(method).kind
    state = {}
    for layer in range(layers):
        for part in get_method(method).shared:
            dims = kind.parts[part].shape(k, k, rank)
            state[f"l{layer}.{kind.part_key(part)}"] = 0.05 * rng.standard_normal(dims)
    return state


def one_round(method: str, shape: tuple[int, int, int], clients: int) -> dict[str, float]:
    """Plain and secure round 1 of ``method`` over ``clients`` identical-shaped uploads."""
    rng = np.random.default_rng(0)
    state = initial_state(method, shape, rng)
    nodes = list(range(1, clients + 1))
    uploads = {
        n: {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in state.items()}
        for n in nodes
    }  # fmt: skip
    settings = {"method": method, "min-available-nodes": clients, "screen-updates": False}
    plain = build_strategy(resolve_config({}, settings), state)
    replies = []
    for n in nodes:
        sent = Message(RecordDict(), dst_node_id=n, message_type="train")
        metrics = MetricRecord({"partition-id": n, "num-examples": 10, "train-loss": 0.5})
        content = RecordDict({"arrays": to_array_record(uploads[n]), "metrics": metrics})
        replies.append(Message(content, reply_to=sent))
    t0 = time.perf_counter()
    plain.aggregate_train(1, replies)
    plain_seconds = time.perf_counter() - t0
    plain_up = float(np.mean([wire_bytes(r) for r in replies]))
    secure_config = resolve_config({}, {**settings, "secure-aggregation": "secaggplus",
                                        "secure-uplink-limit-mb": 1e6})  # fmt: skip
    secure = build_strategy(secure_config, state)
    # the clients' part timed (client_seconds); the masked replies not kept (7B: 67 MB each)
    grid = InProcessGrid(uploads, method, keep_collected=False)
    t0 = time.perf_counter()
    _, metrics = secure.round_loop.round(grid, 1, to_array_record(state), ConfigRecord(), 600)
    total = time.perf_counter() - t0
    assert metrics["clients"] == clients, metrics
    return {
        "plain-server-s": plain_seconds,
        "secure-server-s": total - grid.client_seconds,
        "secure-client-s": grid.client_seconds / clients,
        "plain-up-bytes": plain_up,
        "secure-up-bytes": float(metrics["uplink-bytes-per-client"]),
        "secure-down-bytes": float(metrics["downlink-bytes-per-client"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="minilm")
    parser.add_argument("--clients", type=int, nargs="+", default=[5, 10, 20, 50])
    parser.add_argument("--methods", nargs="+", default=["fedit", "florg"])
    args = parser.parse_args(argv)
    for name in ("_run_id", "_task_id", "_node_id"):
        setattr(TaskIdentity, name, 1)  # messages are built outside a run
    print(f"shape {args.shape} {SHAPES[args.shape]} (layers, k, rank); one round, one process")
    print("| method | N | plain server s | secure server s | secure client s (each) | "
          "plain up B/client | secure up B/client | secure down B/client |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for method in args.methods:
        for n in args.clients:
            r = one_round(method, SHAPES[args.shape], n)
            cells = [f"{r[k]:.3f}" for k in ("plain-server-s", "secure-server-s",
                                              "secure-client-s")]  # fmt: skip
            cells += [f"{r[k]:,.0f}" for k in ("plain-up-bytes", "secure-up-bytes",
                                              "secure-down-bytes")]  # fmt: skip
            print(f"| {method} | {n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
