"""Simulation overhead: R rounds of FLoRG through the real Flower simulation engine versus the
same local training + aggregation + server evaluation in a plain Python loop, in one run.

    python benchmarks/simulation_overhead.py                    # 4 rounds, 2 clients
    python benchmarks/simulation_overhead.py --rounds 6 --clients 2
    python benchmarks/simulation_overhead.py --quick            # 2 rounds, tiny sizes (smoke test)

(a) Simulation.  A private ``flower-superlink --simulation`` on a free port
    (``florg_tools.superlink.local_simulation_superlink``: N supernodes, 1 CPU each, stopped
    by PID with every process it spawned), and one FLoRG run submitted with
    ``florg_tools.flwr_cli.run_flower_app`` (model all-MiniLM-L6-v2, task snli, IID partitions,
    600 training / 200 validation examples, batch 16, progress bar off, outputs in a temp
    dir).  Per-round times come from the run's ``metrics.jsonl`` (``elapsed-seconds``, taken
    by the ServerApp's RunRecorder, whose clock starts after the ServerApp has loaded the
    data and the model; row 0 is the initial evaluation).  A monitor thread in this process
    polls the run folder every 50 ms, so the ServerApp's start (``config.json`` appears)
    and every row are also placed on this process's clock, relative to the launch; it also
    samples the CPU time (utime + stime, ``florg_tools.processes``) of every process of the
    simulation (SuperLink, SuperExec, ``flwr-simulation`` = ServerApp + Ray driver, Ray
    services, the ClientApp actors) and of the ``flwr`` CLI children of the launcher, at
    every row.
(b) Loop.  The same work in this process with the app's own modules: ``load_task_data``,
    ``cached_adapted_model``, per client ``tokenized_split(config, "train", pid, N)``,
    ``make_loader`` with the ClientApp's seed, ``train_local`` with the ClientApp's
    arguments, the strategy's ``aggregate_adapter`` (``aggregate_florg`` per layer) + FedAvg
    of the head from ``build_strategy``, and the ServerApp's evaluation of the global model
    on the validation split.

Parallelism.  The simulation trains the clients IN PARALLEL, one Ray actor per client with
1 CPU; Ray sets ``OMP_NUM_THREADS`` to the actor's CPUs (1) inside each actor when it
starts (``ray._private.utils.set_omp_num_threads_if_unset``), so every actor's torch uses
1 thread, while the ServerApp (the ``flwr-simulation`` process, Ray's driver) evaluates
with torch's default thread count.  The loop trains its clients ONE AFTER ANOTHER, each
with ``--loop-threads`` torch threads (default 1, what an actor gets), and evaluates with
the default thread count like the ServerApp.  On 2 cores the simulation therefore has up
to 2x the loop's training throughput; the report also gives the round time of an ideal,
overhead-free parallel run (per round: slowest client of the loop + aggregation +
evaluation) and the simulation's time over it.  A calibration step trains client 0 once
more with the other thread count (torch's default), to show what intra-op threads are
worth here: on a 2-core machine shared with other work, 2 OpenMP threads per process can
be several times SLOWER than 1 (threads wait for each other at every barrier while one of
them is descheduled).

Headline: overhead ratio = mean simulation round time / mean loop round time over rounds
2..R (round 1 carries the actors' start-up: imports, model load, tokenisation), target
<= 1.3; first-round start-up = (launch -> end of round 1 in the simulation) - loop round 1.
The machine is shared, so wall times move with foreign load; CPU times (this process's
``time.process_time`` for the loop, the sum over the simulation's processes for (a)) are
printed next to them, and so is the other work on the machine during every round (the
machine's busy CPU time from ``/proc/stat`` minus ours, in cores).  The last printed line
is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.3
RUN_NAME = "simulation-overhead"


def _ensure_repo_on_path() -> None:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    rounds: int
    clients: int
    max_train: int
    max_eval: int
    batch_size: int
    max_seq_length: int


def run_settings(sizes: Sizes, output_dir: Path) -> dict[str, Any]:
    """The run config of both measurements (every setting that matters is pinned, so a
    change of the app's defaults cannot make the two sides differ)."""
    return {
        "method": "florg",
        "model": "all-MiniLM-L6-v2",
        "task": "snli",
        "partitioner": "iid",
        "seed": 0,
        "rank": 4,
        "alpha": 16.0,
        "num-server-rounds": sizes.rounds,
        "fraction-train": 1.0,
        "min-train-nodes": sizes.clients,
        "min-available-nodes": sizes.clients,
        "client-eval": "off",
        "max-train-examples": sizes.max_train,
        "max-eval-examples": sizes.max_eval,
        "local-epochs": 1,
        "local-steps": 0,
        "batch-size": sizes.batch_size,
        "eval-batch-size": 64,
        "learning-rate": 1e-3,
        "weight-decay": 0.0,
        "max-seq-length": sizes.max_seq_length,
        "aggregation-weights": "uniform",
        "device": "cpu",
        "progress-bar": False,
        "save-client-updates": False,
        "output-dir": str(output_dir),
        "run-name": RUN_NAME,
    }


# --------------------------------------------------------------------------------------
# CPU time of the simulation's processes and of the machine (florg_tools.processes, psutil)
# --------------------------------------------------------------------------------------


def busy_threads(before: dict[int, float], after: dict[int, float]) -> int:
    """Threads that did real work between two ``thread_cpu_seconds`` samples (>= 25% of the
    busiest thread's CPU and >= 50 ms): torch's OpenMP workers show up here."""
    deltas = [cpu - before.get(tid, 0.0) for tid, cpu in after.items()]
    top = max(deltas, default=0.0)
    return sum(1 for d in deltas if d >= max(0.05, 0.25 * top))


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, non-idle), from /proc/stat."""
    import psutil

    try:
        t = psutil.cpu_times()
    except (psutil.Error, OSError):
        return float("nan")
    # everything but idle and iowait (guest is included in user)
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def foreign_cores(busy_s: float, own_cpu_s: float, wall_s: float) -> float:
    """Average number of cores busy with work other than ours over an interval."""
    return max(0.0, busy_s - own_cpu_s) / wall_s if wall_s > 0 else float("nan")


CATEGORIES = (
    "ray actors (ClientApps)",
    "flwr-simulation (ServerApp + Ray driver)",
    "ray services",
    "superlink + superexec",
    "flwr CLI (launcher)",
    "other",
)


def categorise(cmdline: str) -> str:
    if cmdline.startswith("ray::"):
        return CATEGORIES[0]
    if "flwr-simulation" in cmdline:
        return CATEGORIES[1]
    if any(s in cmdline for s in ("raylet", "gcs_server", "/ray/", "dashboard", "log_monitor")):
        return CATEGORIES[2]
    if "flower-superlink" in cmdline or "flower-superexec" in cmdline:
        return CATEGORIES[3]
    if "flwr" in cmdline:
        return CATEGORIES[4]
    return CATEGORIES[5]


@dataclass
class RowSeen:
    row: dict[str, Any]
    seen: float  # perf_counter of this process when the row was first read
    cpu: dict[str, float]  # cumulative CPU seconds per category at that moment
    busy: float  # machine_busy_s() at that moment
    own: float  # this process's CPU seconds (monitor, SuperLink tracker, launcher)
    threads: dict[tuple[int, float], dict[int, float]]  # ServerApp + actors: thread CPU


class SimMonitor(threading.Thread):
    """Watches the run folder (ServerApp start, metrics rows) and the simulation's CPU."""

    def __init__(self, run_dir: Path, superlink: Any, poll: float = 0.05, cpu_every: float = 1.0):
        super().__init__(name="sim-monitor", daemon=True)
        self.run_dir = run_dir
        self.superlink = superlink
        self.poll = poll
        self.cpu_every = cpu_every
        self.config_seen: float | None = None
        self.metrics_seen: float | None = None
        self.rows: list[RowSeen] = []
        self._cpu: dict[tuple[int, float], float] = {}
        self._cat: dict[tuple[int, float], str] = {}
        self._stop_event = threading.Event()
        self.error: BaseException | None = None

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10.0)

    def sample_cpu(self) -> dict[str, float]:
        from florg_tools.processes import children, cpu_seconds, process_info

        pids = {info.pid for info in self.superlink.recorded()}
        pids.update(children(os.getpid()))
        for pid in pids:
            # re-read: a Ray worker renames itself once it hosts an actor
            info = process_info(pid)
            cpu = None if info is None or info.zombie else cpu_seconds(info)
            if info is None or cpu is None:
                continue
            if info.cmdline:
                self._cat[info.key] = categorise(info.cmdline)
            self._cpu[info.key] = max(self._cpu.get(info.key, 0.0), cpu)
        totals = dict.fromkeys(CATEGORIES, 0.0)
        for key, cpu in self._cpu.items():
            totals[self._cat.get(key, CATEGORIES[5])] += cpu
        return totals

    def sample_threads(self) -> dict[tuple[int, float], dict[int, float]]:
        from florg_tools.processes import thread_cpu_seconds

        watched = (CATEGORIES[0], CATEGORIES[1])
        sampled = {key: thread_cpu_seconds(key[0]) for key, c in self._cat.items() if c in watched}
        return {key: threads for key, threads in sampled.items() if threads}  # live ones

    def category(self, key: tuple[int, float]) -> str:
        return self._cat.get(key, CATEGORIES[5])

    def run(self) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        last_cpu = 0.0
        try:
            while not self._stop_event.is_set():
                now = time.perf_counter()
                if self.config_seen is None and (self.run_dir / "config.json").exists():
                    self.config_seen = now
                new_rows: list[dict[str, Any]] = []
                if metrics.exists():
                    if self.metrics_seen is None:
                        self.metrics_seen = now
                    with contextlib.suppress(OSError):
                        lines = metrics.read_text().split("\n")[:-1]  # complete lines only
                        new_rows = [json.loads(ln) for ln in lines[len(self.rows) :] if ln]
                if new_rows or now - last_cpu >= self.cpu_every:
                    totals = self.sample_cpu()
                    last_cpu = time.perf_counter()
                    busy, own = machine_busy_s(), time.process_time()
                    threads = self.sample_threads() if new_rows else {}
                    for row in new_rows:
                        self.rows.append(RowSeen(row, now, totals, busy, own, threads))
                self._stop_event.wait(self.poll)
        except BaseException as err:  # reported by the caller; never kill the run
            self.error = err


# --------------------------------------------------------------------------------------
# (a) The simulation
# --------------------------------------------------------------------------------------


@dataclass
class SimResult:
    superlink_start_s: float
    launcher_wall_s: float
    superlink_stop_s: float
    launch_to_serverapp_s: float | None
    serverapp_to_recorder_s: float | None
    rows: list[dict[str, Any]]
    round_end_from_launch: list[float]  # our clock, per row (row 0 = initial evaluation)
    cpu_by_round: list[dict[str, float | None]]  # per row i >= 1: CPU between rows i-1 and i
    foreign_cores_by_round: list[float | None]  # other work on the machine, per round
    busy_threads_by_round: list[dict[str, list[int]]]  # per category: busy threads per process
    cpu_total: dict[str, float]
    cpu_before_row0: dict[str, float]
    config: dict[str, Any]


def run_simulation(sizes: Sizes, work: Path, timeout: float) -> SimResult:
    _ensure_repo_on_path()
    from florg_tools.flwr_cli import run_flower_app
    from florg_tools.superlink import local_simulation_superlink

    output_dir = work / "outputs"
    run_dir = output_dir / RUN_NAME
    settings = run_settings(sizes, output_dir)
    log_path = work / "run.log"
    t_sl0 = time.perf_counter()
    with local_simulation_superlink(
        work / "superlink", num_supernodes=sizes.clients, num_cpus_per_client=1
    ) as sim:
        t_sl1 = time.perf_counter()
        monitor = SimMonitor(run_dir, sim.superlink)
        monitor.start()
        t_launch = time.perf_counter()
        try:
            with log_path.open("w") as log:
                outcome = run_flower_app(
                    REPO_ROOT, sim.connection, settings, sim.flwr_home, timeout, stream=log
                )
            t_done = time.perf_counter()
        finally:
            monitor.stop()
        cpu_total = monitor.sample_cpu()  # processes are still up here
        t_stop0 = time.perf_counter()
    t_stop1 = time.perf_counter()
    if not outcome.ok:
        tail = log_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"simulation run failed: {outcome.message}\n{tail}")
    if monitor.error is not None:
        raise RuntimeError(f"the run monitor failed: {monitor.error!r}")

    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    if [r["round"] for r in rows] != list(range(sizes.rounds + 1)):
        raise RuntimeError(f"unexpected rounds in metrics.jsonl: {[r['round'] for r in rows]}")
    seen = {rs.row["round"]: rs for rs in monitor.rows}
    # The recorder's t0 on our clock: every row is read at most one poll after it is written.
    t0_server = min(
        seen[r["round"]].seen - r["elapsed-seconds"] for r in rows if r["round"] in seen
    )
    round_end = [t0_server + r["elapsed-seconds"] - t_launch for r in rows]
    cpu_by_round: list[dict[str, float | None]] = []
    busy_by_round: list[dict[str, list[int]]] = []
    foreign: list[float | None] = []
    for i in range(1, len(rows)):
        a, b = seen.get(i - 1), seen.get(i)
        if a is None or b is None:
            cpu_by_round.append(dict.fromkeys(CATEGORIES))
            busy_by_round.append({})
            foreign.append(None)
            continue
        cpu = {c: b.cpu[c] - a.cpu[c] for c in CATEGORIES}
        cpu_by_round.append(cpu)
        busy: dict[str, list[int]] = {}
        for key, after in b.threads.items():
            before = a.threads.get(key, {})
            if sum(after.values()) - sum(before.values()) >= 0.2:  # did work this round
                busy.setdefault(monitor.category(key), []).append(busy_threads(before, after))
        busy_by_round.append(busy)
        own = sum(cpu.values()) + (b.own - a.own)
        foreign.append(foreign_cores(b.busy - a.busy, own, b.seen - a.seen))
    config = json.loads((run_dir / "config.json").read_text())
    return SimResult(
        superlink_start_s=t_sl1 - t_sl0,
        launcher_wall_s=t_done - t_launch,
        superlink_stop_s=t_stop1 - t_stop0,
        launch_to_serverapp_s=None
        if monitor.config_seen is None
        else monitor.config_seen - t_launch,
        serverapp_to_recorder_s=None
        if monitor.config_seen is None
        else t0_server - monitor.config_seen,
        rows=rows,
        round_end_from_launch=round_end,
        cpu_by_round=cpu_by_round,
        foreign_cores_by_round=foreign,
        busy_threads_by_round=busy_by_round,
        cpu_total=cpu_total,
        cpu_before_row0=seen[0].cpu if 0 in seen else {},
        config=config,
    )


# --------------------------------------------------------------------------------------
# (b) The plain loop
# --------------------------------------------------------------------------------------


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
    _ensure_repo_on_path()
    t_import0 = time.perf_counter()
    import numpy as np
    import torch

    from flower_app.config import resolve_config
    from flower_app.methods import build_strategy
    from flower_app.modeling import pick_device
    from flower_app.runtime import cached_adapted_model
    from flower_app.task_data import load_task_data, make_loader, tokenized_split
    from flower_app.training import evaluate, train_local
    from strategies.averaging import weighted_average
    from strategies.flower.base import split_state
    from strategies.validation import normalize_weights

    import_s = time.perf_counter() - t_import0
    n = sizes.clients
    config = resolve_config({}, run_settings(sizes, work / "loop-outputs"))

    t_setup0 = time.perf_counter()
    data = load_task_data(config)
    adapted = cached_adapted_model(config, data.num_labels)
    strategy = build_strategy(
        config.method,
        adapted.shared_state(),
        fraction_train=config.fraction_train,
        min_train_nodes=config.min_train_nodes,
        min_available_nodes=config.min_available_nodes,
        weighting=config.aggregation_weights,
        clients_evaluate=False,
        updates_dir=None,
        residual_mode=config.fedex_residual,
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
        adapted.load_shared_state(state)
        adapted.load_local_state(None)
        result = evaluate(adapted.model, eval_loader, device)
        adapted.model.to("cpu")
        return result

    default_threads = torch.get_num_threads()
    client_threads = client_threads or default_threads

    def client_train(state: dict[str, Any], pid: int, server_round: int, threads: int = 0):
        torch.set_num_threads(threads or client_threads)
        try:
            return _client_train(state, pid, server_round)
        finally:
            torch.set_num_threads(default_threads)

    def _client_train(state: dict[str, Any], pid: int, server_round: int):
        adapted.load_shared_state(state)
        adapted.load_local_state(None)
        loader = make_loader(
            tokenized_split(config, "train", pid, n),
            config.batch_size,
            shuffle=True,
            seed=config.seed + 1000 * server_round + pid,
        )
        result = train_local(
            adapted.model,
            loader,
            epochs=config.local_epochs,
            max_steps=config.local_steps,
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            device=device,
            progress=False,
        )
        adapted.model.to("cpu")
        return adapted.shared_state(), result

    t = time.perf_counter()
    initial = server_evaluate(as_sent(strategy.global_state))
    initial_eval_s = time.perf_counter() - t

    rounds: list[LoopRound] = []
    for server_round in range(1, sizes.rounds + 1):
        w0, c0, b0 = time.perf_counter(), time.process_time(), machine_busy_s()
        sent = as_sent(strategy.global_state)
        payloads, sizes_n, train_wall, train_cpu = [], [], [], []
        for pid in range(n):
            tw, tc = time.perf_counter(), time.process_time()
            payload, result = client_train(sent, pid, server_round)
            train_wall.append(time.perf_counter() - tw)
            train_cpu.append(time.process_time() - tc)
            payloads.append(as_sent(payload))
            sizes_n.append(float(result.num_examples))
        ta = time.perf_counter()
        weights = normalize_weights(
            None if config.aggregation_weights == "uniform" else sizes_n, len(payloads)
        )
        new_state, _ = strategy.aggregate_adapter(server_round, payloads, weights)
        for key in split_state(strategy.global_state)[1]:
            new_state[key] = weighted_average([p[key] for p in payloads], weights, key)
        strategy.global_state = new_state
        te = time.perf_counter()
        result = server_evaluate(as_sent(new_state))
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

    from strategies.flower.base import from_array_record, to_array_record

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


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.2f}"
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def report(sim: SimResult, loop: LoopResult, sizes: Sizes) -> dict[str, Any]:
    rows = sim.rows
    elapsed = [r["elapsed-seconds"] for r in rows]
    sim_rounds = [elapsed[i] - elapsed[i - 1] for i in range(1, len(rows))]
    loop_rounds = [r.wall for r in loop.rounds]
    after = slice(1, None)  # rounds 2..R
    sim_after, loop_after = sim_rounds[after], loop_rounds[after]
    sim_mean, loop_mean = _mean(sim_after), _mean(loop_after)
    ratio = sim_mean / loop_mean
    launch_to_r1 = sim.round_end_from_launch[1]
    startup = launch_to_r1 - loop_rounds[0]
    loop_setup = loop.import_s + loop.setup_s + loop.initial_eval_s

    sim_cpu = [sum(v or 0.0 for v in c.values()) for c in sim.cpu_by_round]
    loop_cpu = [r.cpu for r in loop.rounds]
    cpu_ratio = _mean(sim_cpu[after]) / _mean(loop_cpu[after])
    sim_foreign_known = [x for x in sim.foreign_cores_by_round[after] if x is not None]
    sim_foreign = _mean(sim_foreign_known) if sim_foreign_known else None
    loop_foreign = _mean([r.foreign_cores for r in loop.rounds[after]])

    print()
    print(
        f"## Simulation overhead: FLoRG, {sizes.clients} clients, {sizes.rounds} rounds, "
        f"all-MiniLM-L6-v2 / snli, {sizes.max_train} train / {sizes.max_eval} eval examples, "
        f"batch {sizes.batch_size}, IID"
    )
    print()
    print(
        f"Simulation: {sizes.clients} Ray actors x 1 CPU train IN PARALLEL (1 torch thread "
        f"each, set by Ray); the ServerApp evaluates with torch's default thread count. "
        f"Loop: clients ONE AFTER ANOTHER with {loop.client_threads} torch thread(s) each; "
        f"evaluation with {loop.eval_threads} (torch's default) threads."
    )
    observed = []
    for cat in (CATEGORIES[1], CATEGORIES[0]):
        counts = [c for busy in sim.busy_threads_by_round[after] for c in busy.get(cat, [])]
        if counts:
            observed.append(f"{cat}: {', '.join(str(c) for c in sorted(set(counts)))}")
    if observed:
        print(
            f"Threads doing work in a simulation process during rounds 2..{sizes.rounds} "
            f"(from /proc/PID/task): {'; '.join(observed)}."
        )
    with contextlib.suppress(OSError):
        print(f"Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("### Start-up (seconds; simulation times from the launch of `flwr run`)")
    print()
    row0 = rows[0]["elapsed-seconds"]
    print(
        md_table(
            ["phase", "simulation", "loop"],
            [
                ["SuperLink start (before the launch, not counted)", sim.superlink_start_s, None],
                [
                    "launch -> ServerApp main() (FAB, SuperExec, flwr-simulation)",
                    sim.launch_to_serverapp_s,
                    None,
                ],
                [
                    "ServerApp main() -> recorder clock start (imports done; data + model load)",
                    sim.serverapp_to_recorder_s,
                    loop.import_s + loop.setup_s,
                ],
                [
                    "recorder start -> round 0 row (`elapsed-seconds` of row 0: validation "
                    "tokenisation + initial evaluation)",
                    row0,
                    loop.initial_eval_s,
                ],
                [
                    "round 1 (actors start, import, load the model, tokenise; train, aggregate, "
                    "evaluate)",
                    sim_rounds[0],
                    loop_rounds[0],
                ],
                ["launch -> end of round 1", launch_to_r1, loop_setup + loop_rounds[0]],
                [
                    "**first-round start-up** = launch -> end of round 1 - loop round 1",
                    startup,
                    None,
                ],
                [
                    "launch -> launcher returns (total wall)",
                    sim.launcher_wall_s,
                    loop_setup + sum(loop_rounds),
                ],
                [
                    "after the last row -> launcher returns (final save, shutdown, status)",
                    sim.launcher_wall_s - sim.round_end_from_launch[-1],
                    None,
                ],
                [
                    "SuperLink + Ray stop (after the launcher, not counted)",
                    sim.superlink_stop_s,
                    None,
                ],
            ],
        )
    )
    print()
    print("### Per round (seconds)")
    print()
    table = []
    for i, lr in enumerate(loop.rounds):
        sr = rows[i + 1]
        table.append(
            [
                i + 1,
                sim_rounds[i],
                lr.wall,
                sim_rounds[i] / lr.wall,
                " + ".join(f"{x:.2f}" for x in lr.train_wall),
                lr.agg_wall,
                sr.get("agg-seconds"),
                lr.eval_wall,
                sim_cpu[i],
                lr.cpu,
                f"{_fmt(sim.foreign_cores_by_round[i])} / {lr.foreign_cores:.2f}",
                f"{sr['accuracy']:.4f} / {lr.accuracy:.4f}",
            ]
        )
    table.append(
        [
            f"**mean 2..{sizes.rounds}**",
            sim_mean,
            loop_mean,
            f"**{ratio:.2f}**",
            None,
            _mean([r.agg_wall for r in loop.rounds[after]]),
            _mean([r.get("agg-seconds", 0.0) for r in rows[2:]]),
            _mean([r.eval_wall for r in loop.rounds[after]]),
            _mean(sim_cpu[after]),
            _mean(loop_cpu[after]),
            f"{_fmt(sim_foreign)} / {loop_foreign:.2f}",
            None,
        ]
    )
    print(
        md_table(
            [
                "round",
                "sim wall",
                "loop wall",
                "sim / loop",
                "loop train per client",
                "loop agg",
                "sim agg",
                "loop eval",
                "sim CPU (all procs)",
                "loop CPU",
                "other work on the machine (cores) sim / loop",
                "accuracy sim / loop",
            ],
            table,
        )
    )
    print()
    print(
        f"Overhead ratio after warm-up (mean sim round / mean loop round, rounds "
        f"2..{sizes.rounds}): **{ratio:.3f}** (target <= {TARGET_RATIO}: "
        f"{'met' if ratio <= TARGET_RATIO else 'NOT met'}); CPU-time ratio {cpu_ratio:.3f}."
    )

    # Where the time goes, rounds 2..R.
    eval_mean = _mean([r.eval_wall for r in loop.rounds[after]])
    agg_mean = _mean([r.agg_wall for r in loop.rounds[after]])
    train_seq = _mean([sum(r.train_wall) for r in loop.rounds[after]])
    train_slowest = _mean([max(r.train_wall) for r in loop.rounds[after]])
    ideal_parallel = ideal_ratio = None
    if loop.client_threads == 1:  # the loop's clients ran exactly like the actors' (1 thread)
        ideal_parallel = _mean(
            [max(r.train_wall) + r.agg_wall + r.eval_wall for r in loop.rounds[after]]
        )
        ideal_ratio = sim_mean / ideal_parallel
    breakdown: list[list[Any]] = [
        [
            f"loop: {sizes.clients} clients trained one after another "
            f"({loop.client_threads} thread(s)), sum",
            train_seq,
        ],
        ["loop: slowest client", train_slowest],
        ["loop: aggregation (FLoRG Gram + Procrustes per layer, head FedAvg)", agg_mean],
        [f"loop: server evaluation ({loop.eval_threads} threads)", eval_mean],
        ["**loop: round**", loop_mean],
    ]
    if ideal_parallel is not None:
        breakdown.append(
            ["ideal parallel round = slowest client + aggregation + evaluation", ideal_parallel]
        )
    breakdown += [
        ["**sim: round**", sim_mean],
        [
            "sim: round - loop aggregation - loop evaluation (client phase incl. messaging)",
            sim_mean - agg_mean - eval_mean,
        ],
    ]
    if ideal_parallel is not None:
        breakdown.append(
            [
                "sim: round - ideal parallel round (Flower/Ray scheduling, 0.1 s polls, "
                "messaging, 2 actors sharing 2 loaded cores)",
                sim_mean - ideal_parallel,
            ]
        )
    breakdown += [
        [
            f"message (de)serialisation to protobuf, {2 * sizes.clients} messages "
            f"({loop.message_bytes_down / 1e6:.2f} MB down, {loop.message_bytes_up / 1e6:.2f} MB up"
            " each)",
            loop.serde_round_s,
        ],
    ]
    if loop.calib_other:
        breakdown.append(
            [
                f"calibration, client 0: {loop.calib_threads} threads vs "
                f"{loop.client_threads} (median of 2 each, alternating)",
                f"{statistics.median(loop.calib_other):.2f} vs "
                f"{statistics.median(loop.calib_same):.2f}",
            ]
        )
    print()
    print(f"### Where the time goes (mean over rounds 2..{sizes.rounds}, seconds)")
    print()
    print(md_table(["item", "seconds"], breakdown))
    print()
    if ideal_ratio is not None:
        print(
            f"Simulation round / ideal parallel round: {ideal_ratio:.3f} (overhead of the "
            f"engine itself, with the actors' parallelism taken out)."
        )
        print()
    cpu_rows = []
    for cat in CATEGORIES:
        per = [c[cat] for c in sim.cpu_by_round[after] if c.get(cat) is not None]
        cpu_rows.append(
            [
                cat,
                sim.cpu_before_row0.get(cat),
                sim.cpu_by_round[0].get(cat),
                _mean(per) if per else None,
                sim.cpu_total.get(cat),
            ]
        )
    cpu_rows.append(
        [
            "**all simulation processes**",
            sum(sim.cpu_before_row0.values()),
            sim_cpu[0],
            _mean(sim_cpu[after]),
            sum(sim.cpu_total.values()),
        ]
    )
    cpu_rows.append(["loop (this process)", None, loop_cpu[0], _mean(loop_cpu[after]), None])
    print(f"### CPU time by process (seconds; {os.cpu_count()} cores)")
    print()
    print(
        md_table(
            [
                "process",
                "SuperLink start -> round 0 row",
                "round 1",
                f"per round 2..{sizes.rounds}",
                "whole run",
            ],
            cpu_rows,
        )
    )
    print()

    result = {
        "overhead_ratio_after_warmup": round(ratio, 4),
        "first_round_startup_s": round(startup, 3),
        "sim_round_s": round(sim_mean, 3),
        "loop_round_s": round(loop_mean, 3),
        "rounds": sizes.rounds,
        "clients": sizes.clients,
        "target_ratio": TARGET_RATIO,
        "target_met": bool(ratio <= TARGET_RATIO),
        "sim_round_s_by_round": [round(x, 3) for x in sim_rounds],
        "loop_round_s_by_round": [round(x, 3) for x in loop_rounds],
        "cpu_ratio_after_warmup": round(cpu_ratio, 4),
        "serverapp_start_to_round0_s": round(row0, 3),
        "launch_to_serverapp_s": None
        if sim.launch_to_serverapp_s is None
        else round(sim.launch_to_serverapp_s, 3),
        "launch_to_round1_end_s": round(launch_to_r1, 3),
        "launcher_wall_s": round(sim.launcher_wall_s, 3),
        "loop_setup_s": round(loop_setup, 3),
        "ideal_parallel_round_s": None if ideal_parallel is None else round(ideal_parallel, 3),
        "sim_over_ideal_parallel": None if ideal_ratio is None else round(ideal_ratio, 4),
        "loop_client_threads": loop.client_threads,
        "foreign_load_cores_sim": None if sim_foreign is None else round(sim_foreign, 2),
        "foreign_load_cores_loop": round(loop_foreign, 2),
    }
    return result


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds R (default 4; quick 2)")
    parser.add_argument("--clients", type=int, default=2, help="supernodes N (default 2)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, tiny sizes")
    parser.add_argument("--max-train-examples", type=int, default=None)
    parser.add_argument("--max-eval-examples", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1800.0, help="simulation run timeout")
    parser.add_argument("--loop-first", action="store_true", help="run the loop before the sim")
    parser.add_argument(
        "--loop-threads",
        type=int,
        default=1,
        help="torch threads per client in the loop (default 1 = a Ray actor's; 0 = torch's "
        "default)",
    )
    parser.add_argument(
        "--no-calibration",
        action="store_true",
        help="skip training client 0 with the other thread count",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep run outputs and logs here (default: temp)"
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 4
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (rounds 2..R are the after-warm-up rounds)")
    if args.clients < 1:
        parser.error("--clients must be >= 1")
    if args.loop_threads < 0:
        parser.error("--loop-threads must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    # Models and data come from the fetched offline assets (as in scripts/test.sh).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sizes = Sizes(
        rounds=args.rounds,
        clients=args.clients,
        max_train=args.max_train_examples or (64 if args.quick else 600),
        max_eval=args.max_eval_examples or (32 if args.quick else 200),
        batch_size=args.batch_size,
        max_seq_length=64 if args.quick else 128,
    )
    with contextlib.ExitStack() as stack:
        if args.workdir is not None:
            work = args.workdir.expanduser().resolve()
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sim-overhead-")))
        print(f"[bench] {sizes}; work dir {work}", flush=True)

        def do_sim() -> SimResult:
            print("[bench] simulation ...", flush=True)
            t = time.perf_counter()
            sim = run_simulation(sizes, work / "sim", args.timeout)
            print(f"[bench] simulation done in {time.perf_counter() - t:.1f}s", flush=True)
            return sim

        def do_loop() -> LoopResult:
            print("[bench] plain loop ...", flush=True)
            return run_loop(
                sizes, work / "loop", args.loop_threads, calibrate=not args.no_calibration
            )

        if args.loop_first:
            loop = do_loop()
            sim = do_sim()
        else:
            sim = do_sim()
            loop = do_loop()

    ignore = {"output-dir", "run-name"}
    differ = sorted(
        k for k in loop.config if k not in ignore and sim.config.get(k) != loop.config[k]
    )
    if differ:
        print(f"[bench] WARNING: the two sides' settings differ: {differ}", flush=True)
    result = report(sim, loop, sizes)
    result["settings_identical"] = not differ
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
