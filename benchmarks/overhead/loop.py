"""Simulation overhead, (b): the same rounds in a plain loop in this process with the app's
own modules, and the cost of a round's message (de)serialisation."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.overhead.monitor import foreign_cores, machine_busy_s
from benchmarks.overhead.settings import Sizes, run_settings


@dataclass
class LoopRound:
    wall: float
    cpu: float
    train_wall: list[float]
    train_cpu: list[float]
    agg_wall: float
    eval_wall: float
    accuracy: float
    loss: float
    foreign_cores: float


@dataclass
class LoopResult:
    import_s: float
    setup_s: float  # data + model + strategy + validation tokenisation
    initial_eval_s: float
    initial_accuracy: float
    rounds: list[LoopRound]
    client_threads: int  # torch threads while a client trains
    eval_threads: int  # torch threads for the server evaluation (torch's default)
    calib_threads: int = 0  # the other thread count tried on client 0
    calib_other: list[float] = field(default_factory=list)  # client 0, calib_threads
    calib_same: list[float] = field(default_factory=list)  # client 0, client_threads
    serde_round_s: float = 0.0
    message_bytes_down: int = 0
    message_bytes_up: int = 0
    config: dict[str, Any] = field(default_factory=dict)


def run_loop(
    sizes: Sizes, work: Path, client_threads: int = 1, calibrate: bool = True
) -> LoopResult:
    """The simulation's rounds in a plain loop: every client's round is the ClientApp's
    (``flower_app.client.round``), the strategy the ServerApp's (the method builds it from
    the settings), its replies aggregated as the ServerApp's are once checked
    (``AdapterStrategy.aggregate_replies``: screening, weighting, the method's rule)."""
    t_import0 = time.perf_counter()
    import numpy as np
    import torch

    from flower_app.cache.per_process import cached_adapted_model
    from flower_app.client.round import receive, train_round
    from flower_app.modeling import pick_device
    from flower_app.settings.config import resolve_config
    from flower_app.task_data import load_task_data, make_loader, tokenized_split
    from flower_app.training.loop import evaluate
    from strategies.server.replies import Reply

    import_s = time.perf_counter() - t_import0
    n = sizes.clients
    config = resolve_config({}, run_settings(sizes, work / "loop-outputs"))

    t_setup0 = time.perf_counter()
    data = load_task_data(config)
    adapted = cached_adapted_model(config, data.num_labels)
    strategy = adapted.method.build_strategy(
        config, adapted.shared_state(), fingerprint=adapted.fingerprint()
    )
    device = pick_device(config.device)
    eval_loader = make_loader(
        tokenized_split(config, "eval"), config.eval_batch_size, shuffle=False, seed=0
    )
    setup_s = time.perf_counter() - t_setup0

    def as_sent(state: dict[str, Any]) -> dict[str, Any]:
        """What travels: float32 arrays (to_array_record casts to float32)."""
        return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()}

    def server_evaluate(state: dict[str, Any]):
        receive(adapted, state)
        result = evaluate(adapted.model, eval_loader, device)
        adapted.model.to("cpu")
        return result

    default_threads = torch.get_num_threads()
    client_threads = client_threads or default_threads

    def client_train(state: dict[str, Any], pid: int, server_round: int, threads: int = 0):
        torch.set_num_threads(threads or client_threads)
        try:
            receive(adapted, state)
            return train_round(
                config, adapted, server_round=server_round, partition_id=pid, num_partitions=n
            )
        finally:
            torch.set_num_threads(default_threads)

    t = time.perf_counter()
    initial = server_evaluate(as_sent(strategy.global_state))
    initial_eval_s = time.perf_counter() - t

    rounds: list[LoopRound] = []
    for server_round in range(1, sizes.rounds + 1):
        w0, c0, b0 = time.perf_counter(), time.process_time(), machine_busy_s()
        sent = as_sent(strategy.global_state)
        replies, train_wall, train_cpu = [], [], []
        for pid in range(n):
            tw, tc = time.perf_counter(), time.process_time()
            reply = client_train(sent, pid, server_round)
            train_wall.append(time.perf_counter() - tw)
            train_cpu.append(time.process_time() - tc)
            replies.append(
                Reply(
                    node=pid,
                    partition=pid,
                    arrays=as_sent(reply.shared),
                    num_examples=float(reply.metrics["num-examples"]),
                    train_loss=float(reply.metrics["train-loss"]),
                )
            )
        ta = time.perf_counter()
        strategy.aggregate_replies(server_round, replies)
        te = time.perf_counter()
        result = server_evaluate(as_sent(strategy.global_state))
        t_end = time.perf_counter()
        cpu = time.process_time() - c0
        rounds.append(
            LoopRound(
                wall=t_end - w0,
                cpu=cpu,
                train_wall=train_wall,
                train_cpu=train_cpu,
                agg_wall=te - ta,
                eval_wall=t_end - te,
                accuracy=result.accuracy,
                loss=result.loss,
                foreign_cores=foreign_cores(machine_busy_s() - b0, cpu, t_end - w0),
            )
        )
        print(
            f"[loop] round {server_round}/{sizes.rounds}: {rounds[-1].wall:.2f}s "
            f"(train {' + '.join(f'{x:.2f}' for x in train_wall)}, agg "
            f"{rounds[-1].agg_wall * 1e3:.0f} ms, eval {rounds[-1].eval_wall:.2f}s) "
            f"acc {result.accuracy:.4f}",
            flush=True,
        )

    out = LoopResult(
        import_s=import_s,
        setup_s=setup_s,
        initial_eval_s=initial_eval_s,
        initial_accuracy=initial.accuracy,
        rounds=rounds,
        client_threads=client_threads,
        eval_threads=default_threads,
        config=config.as_dict(),
    )
    sent = as_sent(strategy.global_state)
    other = default_threads if client_threads == 1 else 1
    if calibrate and other != client_threads:
        # Client 0 once more with the other thread count, then with the loop's, twice,
        # alternating (other, same, same, other) so that foreign load hits both alike.
        out.calib_threads = other
        for threads in (other, client_threads, client_threads, other):
            t = time.perf_counter()
            client_train(sent, 0, sizes.rounds + 1, threads)
            elapsed = time.perf_counter() - t
            (out.calib_other if threads == other else out.calib_same).append(elapsed)
    out.serde_round_s, out.message_bytes_down, out.message_bytes_up = measure_serde(
        sent, as_sent(adapted.shared_state()), n
    )
    return out


def measure_serde(down: dict[str, Any], up: dict[str, Any], clients: int) -> tuple[float, int, int]:
    """Seconds per round to turn the round's 2N messages' contents into protobuf bytes and
    back (what a gRPC deployment pays; the in-memory simulation pays at most this), and the
    byte size of one message each way."""
    from flwr.app import ConfigRecord, MetricRecord, RecordDict
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

    from flower_app.wire.records import from_array_record, to_array_record

    def roundtrip(make) -> tuple[float, int]:
        times = []
        size = 0
        for _ in range(7):
            t = time.perf_counter()
            proto = recorddict_to_proto(make())
            blob = proto.SerializeToString()
            back = recorddict_from_proto(type(proto).FromString(blob))
            from_array_record(back["arrays"])
            times.append(time.perf_counter() - t)
            size = len(blob)
        return statistics.median(times), size

    down_s, down_bytes = roundtrip(
        lambda: RecordDict(
            {
                "arrays": to_array_record(down),
                "config": ConfigRecord({"method": "florg", "server-round": 1}),
            }
        )
    )
    up_s, up_bytes = roundtrip(
        lambda: RecordDict(
            {"arrays": to_array_record(up), "metrics": MetricRecord({"num-examples": 300})}
        )
    )
    return clients * (down_s + up_s), down_bytes, up_bytes
