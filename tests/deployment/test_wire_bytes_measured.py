"""The metrics rows' ``uplink-bytes`` / ``downlink-bytes`` (``wire_bytes``, never serialised)
against the bytes measured on the wire: a SuperLink and 2 SuperNodes on loopback, the nodes
dialling a counting proxy (tests/harness/grpc_bytes_proxy.py) in front of the Fleet API; one
FedIT run of 2 rounds, no client evaluation, a wider tiny BERT at rank 64 (about 1 MiB a fp32
message), fp32 and int8-g on both links: each sum within 2% of the measured bytes (what is
measured: ``DOWNLINK``, ``UPLINK``). Flower 1.42's SuperNode speaks protobuf over HTTP/1.1
(``/v1/fleet/...``), not gRPC; the proxy reads both. Two local steps: the SuperLink's store
is content-addressed across messages, so two replies holding one unchanged array (FedIT's A
after one step from B = 0) push it once, which the rows (each message alone) do not model.
"""

from __future__ import annotations

import threading

import pytest

from florg_tools.flwr_cli import run_flower_app
from florg_tools.superlink import find_free_port
from florg_tools.synthetic import make_sentiment_task, make_tiny_bert, tiny_bert_config
from tests.harness.deploy_harness import ROOT, deployment, logs, rows, run_settings
from tests.harness.grpc_bytes_proxy import DOWN, UP, ByteCountingProxy

pytestmark = pytest.mark.integration

NODES, ROUNDS = 2, 2
HIDDEN, RANK = 512, 64  # query and value of 2 layers: 8 arrays of 128 KiB at fp32
TOLERANCE = 0.02


def fleet_paths(method: str) -> tuple[str, str]:
    """A Fleet API method's paths: protobuf over HTTP (Flower 1.42) and gRPC."""
    words = "".join(f"-{c.lower()}" if c.isupper() else c for c in method).lstrip("-")
    return f"/v1/fleet/{words}", f"/flwr.proto.Fleet/{method}"


# What carries a message's bytes. Downlink: what the SuperLink sent in answer to
# PullMessages (the Message's metadata and its object tree: the ids of its objects) and to
# PullObject (each object: header and body); uplink: what the SuperNodes sent in
# PushMessages (metadata and tree) and PushObject (each object). Left out: the opposite
# direction of those calls (the object ids asked for, the acknowledgements),
# ConfirmMessageReceived (an acknowledgement once a message is in), heartbeats, GetRun,
# GetFab, registration and activation. A PullMessages poll that finds no message is an
# empty protobuf (0 body bytes), so the polls add nothing: no subtraction is needed (checked:
# the non-empty PullMessages answers are exactly the training messages).
DOWNLINK = {"PullMessages": DOWN, "PullObject": DOWN}
UPLINK = {"PushMessages": UP, "PushObject": UP}
SHOWN = ["PullMessages", "PullObject", "PushMessages", "PushObject", "ConfirmMessageReceived"]


def measured(totals: dict[tuple[str, str], int], methods: dict[str, str]) -> int:
    return sum(totals.get((p, d), 0) for m, d in methods.items() for p in fleet_paths(m))


def wide_bert(directory):
    """The tiny BERT's vocabulary and tokenizer, its hidden size ``HIDDEN``."""
    import torch
    from transformers import BertForSequenceClassification

    make_tiny_bert(directory)
    torch.manual_seed(0)
    config = tiny_bert_config(hidden_size=HIDDEN, intermediate_size=128)
    BertForSequenceClassification(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("encoding", ["fp32", "int8-g"])
def test_rows_bytes_match_the_bytes_measured_on_the_wire(tmp_path, encoding):
    model, task = wide_bert(tmp_path / "model"), make_sentiment_task(tmp_path / "task")
    out = tmp_path / "outputs"
    port = find_free_port()
    # The proxy outlives the deployment: the nodes are stopped before their connections are.
    with ByteCountingProxy("127.0.0.1", port) as proxy:
        with deployment(tmp_path, None, connection="wire", port=port) as dep:
            dep.start_superlink()
            for i in range(NODES):
                dep.start_supernode(i, NODES, superlink_port=proxy.port, wait=False)
            dep.wait_registered()
            settings = run_settings(
                model, task, out, "wire",
                **{"method": "fedit", "rank": RANK, "num-server-rounds": ROUNDS,
                   "min-train-nodes": NODES, "min-available-nodes": NODES,
                   "client-eval": "off", "uplink-encoding": encoding,
                   "downlink-encoding": encoding,
                   "local-steps": 2},  # two, so that A moves in round 1: see the module
            )  # fmt: skip
            outcome = run_flower_app(
                ROOT, dep.connection, settings, dep.flwr_home, timeout=480, stream=None
            )
            assert outcome.ok, f"{outcome.message}\n{outcome.log_text[-3000:]}\n{logs(dep)}"
            totals, bodies = proxy.bytes_by_path(), proxy.bodies_by_path()
        assert not proxy.errors, proxy.errors
    assert not [t.name for t in threading.enumerate() if t.name.startswith("proxy-")]

    history = rows(out / "wire")
    assert [r["round"] for r in history] == list(range(ROUNDS + 1))
    rows_up = sum(r.get("uplink-bytes", 0) for r in history)
    rows_down = sum(r.get("downlink-bytes", 0) for r in history)
    wire_up, wire_down = measured(totals, UPLINK), measured(totals, DOWNLINK)
    for r in history[1:]:
        print(f"round {r['round']}: uplink-bytes {r['uplink-bytes']:,} "
              f"downlink-bytes {r['downlink-bytes']:,}")  # fmt: skip
    for method in SHOWN:
        for direction in (UP, DOWN):
            sizes = [n for p in fleet_paths(method) for n in bodies.get((p, direction), [])]
            print(f"{method} {direction}: {len(sizes)} bodies, {sum(sizes):,} bytes")
    print(f"{encoding} uplink: rows {rows_up:,} wire {wire_up:,} ratio {rows_up / wire_up:.5f}")
    print(f"{encoding} downlink: rows {rows_down:,} wire {wire_down:,} "
          f"ratio {rows_down / wire_down:.5f}")  # fmt: skip

    # Every training message was pulled once and every reply pushed once; a poll that found
    # nothing answered 0 bytes, so the polls add nothing to the downlink.
    pulled = [n for p in fleet_paths("PullMessages") for n in bodies.get((p, DOWN), []) if n]
    pushed = [n for p in fleet_paths("PushMessages") for n in bodies.get((p, UP), [])]
    assert len(pulled) == len(pushed) == NODES * ROUNDS, (pulled, pushed)
    assert abs(rows_up / wire_up - 1) <= TOLERANCE, (rows_up, wire_up)
    assert abs(rows_down / wire_down - 1) <= TOLERANCE, (rows_down, wire_down)


def test_proxy_counts_grpc_data_and_http1_bodies_exactly():
    """The proxy on its own: h2c gRPC calls (HPACK state carried across calls, bodies split
    over DATA frames) and HTTP/1.1 keep-alive calls (Content-Length requests, chunked and
    fixed-length responses), each counted to the byte."""
    from concurrent import futures
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import grpc
    import httpx

    def echo(request: bytes, context) -> bytes:
        return request[::-1] + b"!"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),)
    )
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sizes = [10, 100_000, 300_000]  # > 16 KiB: several DATA frames, flow control
    try:
        with ByteCountingProxy("127.0.0.1", grpc_port) as proxy:
            with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
                call = channel.unary_unary("/test.Echo/Echo")
                for n in sizes:
                    assert call(bytes(n), timeout=30) == bytes(n) + b"!"
            totals = proxy.bytes_by_path()
        assert not proxy.errors, proxy.errors
    finally:
        server.stop(None)
    # each gRPC message: a 5-byte prefix (compressed flag, length), then the bytes
    assert totals[("/test.Echo/Echo", UP)] == sum(5 + n for n in sizes)
    assert totals[("/test.Echo/Echo", DOWN)] == sum(5 + n + 1 for n in sizes)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: several calls on one connection

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            if self.path == "/chunked":
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for part in (body, b"!"):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.send_header("content-length", str(len(body) + 1))
                self.end_headers()
                self.wfile.write(body + b"!")

        def log_message(self, *args) -> None:  # quiet
            pass

    http_server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = threading.Thread(target=http_server.serve_forever, name="http-test-server")
    serving.start()
    try:
        with ByteCountingProxy("127.0.0.1", http_server.server_address[1]) as proxy:
            with httpx.Client(base_url=f"http://127.0.0.1:{proxy.port}") as client:
                for n in sizes:
                    for path in ("/fixed", "/chunked"):
                        assert client.post(path, content=bytes(n)).content == bytes(n) + b"!"
            totals = proxy.bytes_by_path()
        assert not proxy.errors, proxy.errors
    finally:
        http_server.shutdown()
        http_server.server_close()
        serving.join()
    for path in ("/fixed", "/chunked"):
        assert totals[(path, UP)] == sum(sizes)
        assert totals[(path, DOWN)] == sum(n + 1 for n in sizes)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("proxy-")]
