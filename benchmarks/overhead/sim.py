"""Simulation overhead, (a): one FLoRG run through a private simulation SuperLink, timed
per round on this process's clock, with the CPU time of every simulation process."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT
from benchmarks.overhead.monitor import CATEGORIES, SimMonitor, busy_threads, foreign_cores
from benchmarks.overhead.settings import RUN_NAME, Sizes, run_settings


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
