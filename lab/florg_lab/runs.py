"""A grid run's folder, and whether it holds a finished run with the run's settings."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from florg_lab.grid import GridRun

__all__ = ["finished_run", "finished_runs_under", "is_finished", "run_dir"]


def run_dir(out: Path, run: GridRun) -> Path:
    return out / "runs" / run.run_id


def finished_run(folder: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(summary, config)`` of the run the ServerApp wrote to ``folder``, or None when
    either file is missing or unreadable or the run has not finished."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if summary.get("status") != "finished":
        return None
    return summary, config


def finished_runs_under(
    roots: Sequence[Path],
) -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """``(folder, summary, config)`` of every finished run folder directly under each of
    ``roots``, in name order; a root that is not a folder is an error."""
    for root in roots:
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such folder")
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            found = finished_run(folder)
            if found is not None:
                yield folder, *found


def is_finished(folder: Path, run: GridRun) -> bool:
    """Whether ``folder`` holds a finished run with ``run``'s settings (its config.json
    agrees with every override, so editing a grid file reruns the runs it changed)."""
    found = finished_run(folder)
    if found is None:
        return False
    return all(found[1].get(key) == value for key, value in run.overrides.items())
