"""The cost of scale, one cell: a FLoRG run of N SuperNodes with K clients per round through
a private simulation SuperLink, timed from its metrics rows, with the memory of all its
processes sampled while it runs.

What a round's row gives (flower_app/run_output/recorder.py, strategies/server/strategy.py):
``elapsed-seconds`` (the ServerApp's clock when the row is written), ``eval-seconds`` /
``test-seconds`` (the server's evaluation of that round), ``agg-seconds`` (the strategy's
aggregation) and ``client-train-seconds`` (the mean over the round's replies of the wall
time each ClientApp spent in its local steps). So per round t:

    round wall      W = elapsed[t] - elapsed[t-1] - eval-seconds[t] - test-seconds[t]
    per client      W A / K   (A Ray actors, the clients' parallelism; 1 CPU each)
    training        T = client-train-seconds[t]
    everything else W A / K - T   (message, serialisation, model load, Ray, the server)

and the limit the issue compares with, the training compute alone, is K T / A per round.
Memory: every 0.5 s the proportional set size (PSS: shared pages split among the processes
sharing them, so the sum is what the process set holds) of every process the SuperLink
started, summed; the peak, and the peak above the SuperLink's own at launch.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import REPO_ROOT
from benchmarks.overhead.monitor import child_pids

RUN_NAME = "scale"
ACTOR_PREFIX = "ray::ClientAppActor"


@dataclass(frozen=True)
class Cell:
    nodes: int  # N SuperNodes
    per_round: int  # K clients sampled per round

    @property
    def label(self) -> str:
        return f"N={self.nodes} K={self.per_round}"


def run_settings(cell: Cell, rounds: int, output_dir: Path, assets: dict[str, str]) -> dict:
    """The pinned run: FLoRG, 2 local steps of batch 8 per client (the issue's "tiny local
    work"), K = fraction-train x N clients per round (fixed sample size), no client
    evaluation, a small validation set for the server, no test split, checkpoints as always."""
    return {
        "method": "florg",
        **assets,
        "partitioner": "iid",
        "seed": 0,
        "rank": 4,
        "num-server-rounds": rounds,
        "fraction-train": cell.per_round / cell.nodes,
        "min-train-nodes": cell.per_round,
        "min-available-nodes": cell.nodes,
        "client-eval": "off",
        "local-steps": 2,
        "batch-size": 8,
        "max-eval-examples": 32,
        "max-test-examples": 0,
        "eval-every": 0,
        "device": "cpu",
        "progress-bar": False,
        "save-client-updates": False,
        "output-dir": str(output_dir),
        "run-name": RUN_NAME,
    }


class MemorySampler(threading.Thread):
    """Sums the PSS (RSS where PSS cannot be read) of the SuperLink's processes and of this
    process's children every ``every`` seconds; ``peak`` and ``idle`` (the first sample)
    in bytes, and the most ClientApp actors alive at once."""

    def __init__(self, superlink: Any, every: float = 0.5) -> None:
        super().__init__(name="memory-sampler", daemon=True)
        self.superlink = superlink
        self.every = every
        self.peak = 0
        self.idle: int | None = None
        self.actors = 0
        self._stop_event = threading.Event()

    def sample(self) -> tuple[int, int]:
        import psutil

        pids = {info.pid for info in self.superlink.recorded()}
        pids.update(child_pids(os.getpid()))
        total = actors = 0
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                try:
                    total += proc.memory_full_info().pss
                except (psutil.AccessDenied, AttributeError):
                    total += proc.memory_info().rss
                actors += " ".join(proc.cmdline()).startswith(ACTOR_PREFIX)
            except psutil.Error:
                continue
        return total, actors

    def run(self) -> None:
        while not self._stop_event.is_set():
            total, actors = self.sample()
            if self.idle is None:
                self.idle = total
            self.peak = max(self.peak, total)
            self.actors = max(self.actors, actors)
            self._stop_event.wait(self.every)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10.0)


def round_measurements(rows: list[dict[str, Any]], cell: Cell, actors: int) -> list[dict]:
    """Per round t >= 1 of the run: the quantities of the module docstring."""
    out = []
    for prev, row in zip(rows, rows[1:], strict=False):
        wall = (
            row["elapsed-seconds"]
            - prev["elapsed-seconds"]
            - row.get("eval-seconds", 0.0)
            - row.get("test-seconds", 0.0)
        )
        train = float(row.get("client-train-seconds", float("nan")))
        per_client = wall * actors / cell.per_round
        out.append(
            {
                "round": row["round"],
                "clients": row.get("clients"),
                "round-seconds": wall,
                "client-seconds": per_client,
                "train-seconds": train,
                "other-seconds": per_client - train,
                "overhead-ratio": (per_client - train) / train,
                "training-bound-seconds": cell.per_round * train / actors,
                "agg-seconds": row.get("agg-seconds"),
            }
        )
    return out


def run_cell(cell: Cell, rounds: int, work: Path, assets: dict[str, str], timeout: float) -> dict:
    """One run of ``cell``; its rows' measurements, the peak memory and the actors."""
    from florg_tools.flwr_cli import run_flower_app
    from florg_tools.superlink import local_simulation_superlink

    work.mkdir(parents=True, exist_ok=True)
    output_dir = work / "outputs"
    run_dir = output_dir / RUN_NAME
    log_path = work / "run.log"
    t0 = time.perf_counter()
    with local_simulation_superlink(
        work / "superlink", num_supernodes=cell.nodes, num_cpus_per_client=1
    ) as sim:
        memory = MemorySampler(sim.superlink)
        memory.start()
        try:
            with log_path.open("w") as log:
                outcome = run_flower_app(
                    REPO_ROOT,
                    sim.connection,
                    run_settings(cell, rounds, output_dir, assets),
                    sim.flwr_home,
                    timeout,
                    stream=log,
                )
        finally:
            memory.stop()
    wall = time.perf_counter() - t0
    if not outcome.ok:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{cell.label}: the run failed: {outcome.message}\n{tail}")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    actors = memory.actors or 1
    return {
        "nodes": cell.nodes,
        "per-round": cell.per_round,
        "rounds": round_measurements(rows, cell, actors),
        "actors": actors,
        "peak-memory-bytes": memory.peak,
        "idle-memory-bytes": memory.idle or 0,
        "run-wall-seconds": wall,
    }
