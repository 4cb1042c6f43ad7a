"""Run every run of a grid through the Flower simulation engine, resuming where it stopped.

One private simulation SuperLink serves the whole grid (started on a free port, stopped
by PID at the end, also on failure or Ctrl-C); each run is a ``flwr run`` of this app with
the run's settings, writing ``<out>/runs/<run id>/`` (the ServerApp's run folder).

A run counts as finished when its ``summary.json`` says ``"status": "finished"`` and its
``config.json`` has the run's settings; finished runs are skipped, so an interrupted grid
resumes (and a grid file edited since reruns exactly the runs whose settings changed).
The folder of a run that failed or was interrupted is moved, not deleted, to
``<out>/incomplete/<run id>-<time>/`` before the run starts again. Each run's log is
in ``<out>/logs/<run id>.log``; ``<out>/grid.json`` records every run's last outcome and the
commit the app was at (``checkout_commit``); each run's ``summary.json`` records its machine
(``environment``, flower_app/environment.py).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import tomli_w

from florg_lab.communication import load_metrics
from florg_lab.grid import Grid, GridRun
from florg_lab.runs import is_finished, run_dir
from florg_lab.tuning import tuned_grid
from florg_tools.flwr_cli import run_flower_app
from florg_tools.flwr_home import CONFIG_FILE_NAME, simulation_connection
from florg_tools.provenance import checkout_commit
from florg_tools.superlink import local_superlink

__all__ = ["GridOutcome", "run_grid"]

APP_DIR = Path(__file__).resolve().parents[2]
CONNECTION = "grid-simulation"


@dataclass
class GridOutcome:
    finished: list[str]
    skipped: list[str]
    failed: dict[str, str]

    @property
    def ok(self) -> bool:
        return not self.failed


def _set_aside(folder: Path, out: Path) -> Path | None:
    """Move an incomplete run folder to ``<out>/incomplete/`` (kept for inspection)."""
    if not folder.exists():
        return None
    target = out / "incomplete" / f"{folder.name}-{datetime.now():%Y%m%d-%H%M%S}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(folder), str(target))
    return target


def _final_value(folder: Path, metric: str) -> float | None:
    rows = load_metrics(folder / "metrics.jsonl")
    value = max(rows, key=lambda r: r["round"], default={}).get(metric)
    return None if value is None else float(value)


def _write_connection(flwr_home: Path, address: str, grid: Grid) -> None:
    connection = simulation_connection(  # insecure: the SuperLink listens on loopback only
        address,
        num_supernodes=grid.num_supernodes,
        num_cpus_per_client=grid.num_cpus_per_client,
        num_gpus_per_client=grid.num_gpus_per_client,
        ray_num_cpus=grid.ray_num_cpus,
    )
    document = {"superlink": {"default": CONNECTION, CONNECTION: connection}}
    (flwr_home / CONFIG_FILE_NAME).write_text(tomli_w.dumps(document), encoding="utf-8")


def _record(
    out: Path, run: GridRun, status: str, seconds: float, message: str, commit: str | None
) -> None:
    path = out / "grid.json"
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        state = {}
    state[run.run_id] = {
        "status": status,
        "seconds": round(seconds, 1),
        "message": message,
        "blocks": list(run.blocks),
        "overrides": run.overrides,
        "commit": commit,
        "at": datetime.now().isoformat(timespec="seconds"),
    }
    path.write_text(json.dumps(state, indent=2) + "\n")


def _pending(grid: Grid, out: Path, only: list[str] | None, tried: set[str]) -> tuple[list, list]:
    selected = [r for r in grid.runs if not only or any(s in r.run_id for s in only)]
    pending, skipped = [], []
    for run in selected:
        if is_finished(run_dir(out, run), run):
            skipped.append(run)
        elif run.run_id not in tried:
            pending.append(run)
    return pending, skipped


def _with_choices(grid: Grid, out: Path) -> Grid:
    """A grid with a tuning stage, re-read with the choices (and, with ``extend``, the
    extended candidate values) its finished tuning runs make."""
    return tuned_grid(grid, out)


def run_grid(
    grid: Grid,
    out: Path,
    *,
    only: list[str] | None = None,
    max_runs: int | None = None,
    stream: IO[str] | None = sys.stdout,
    app_dir: Path = APP_DIR,
) -> GridOutcome:
    """Run the unfinished runs of ``grid`` (those whose id contains one of ``only``, if
    given; at most ``max_runs`` of them) and return what happened.

    A grid with a tuning stage is re-read after every run: once the tuning runs of a
    combination have finished, its choice is made and its grid runs join the queue."""
    out = Path(out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    grid = _with_choices(grid, out)
    tried: set[str] = set()
    pending, skipped = _pending(grid, out, only, tried)

    def say(text: str) -> None:
        if stream is not None:
            print(f"[grid {grid.name}] {text}", file=stream, flush=True)

    waiting = f", {len(grid.pending_combos)} combinations await tuning" if grid.tuning else ""
    say(
        f"{grid.expected_runs} runs: {len(skipped)} already finished, {len(pending)} to run"
        f"{waiting} -> {out}"
    )
    outcome = GridOutcome([], [r.run_id for r in skipped], {})
    if not pending:
        return outcome
    commit = checkout_commit(app_dir)
    say(f"app at commit {commit or 'unknown (not a git checkout)'}")
    started = time.monotonic()
    done_here = 0
    with tempfile.TemporaryDirectory(prefix="florg-grid-home-") as tmp:
        flwr_home = Path(tmp)
        with local_superlink(flwr_home, cwd=out, log_path=out / "logs" / "superlink.log") as link:
            _write_connection(flwr_home, link.address, grid)
            while pending and (max_runs is None or done_here < max_runs):
                run = pending[0]
                tried.add(run.run_id)
                done_here += 1
                index = f"{len(skipped) + done_here}/{grid.expected_runs}"
                folder = run_dir(out, run)
                moved = _set_aside(folder, out)
                if moved is not None:
                    say(f"kept the incomplete folder of {run.run_id} as {moved}")
                say(f"{index} {run.run_id} ...")
                t0 = time.monotonic()
                config = {**run.overrides, "output-dir": str(out / "runs"), "run-name": run.run_id}
                with (out / "logs" / f"{run.run_id}.log").open("w") as log:
                    result = run_flower_app(
                        app_dir, CONNECTION, config, flwr_home, grid.run_timeout, stream=log,
                    )  # fmt: skip
                seconds = time.monotonic() - t0
                done = result.ok and is_finished(folder, run)
                if done:
                    outcome.finished.append(run.run_id)
                    headline = _final_value(folder, grid.metric)
                    shown = "n/a" if headline is None else f"{headline:.4f}"
                    say(f"{index} {run.run_id} finished in {seconds:.0f}s ({grid.metric} {shown})")
                else:
                    message = result.message if not result.ok else "no finished summary.json"
                    outcome.failed[run.run_id] = message
                    say(
                        f"{index} {run.run_id} FAILED after {seconds:.0f}s: "
                        f"{message} (log: {out / 'logs' / (run.run_id + '.log')})"
                    )
                _record(
                    out,
                    run,
                    "finished" if done else "failed",
                    seconds,
                    "" if done else outcome.failed[run.run_id],
                    commit,
                )
                grid = _with_choices(grid, out)
                pending, finished_before = _pending(grid, out, only, tried)
                elapsed = time.monotonic() - started
                left = grid.expected_runs - len(finished_before) - len(outcome.failed)
                if left > 0:
                    say(
                        f"{elapsed / 60:.1f} min so far; about "
                        f"{elapsed / done_here * left / 60:.0f} min left for {left} runs"
                    )
    return outcome
