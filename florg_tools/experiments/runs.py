"""A grid run's folder, and whether it holds a finished run with the run's settings."""

from __future__ import annotations

import json
from pathlib import Path

from florg_tools.experiments.grid import GridRun

__all__ = ["is_finished", "run_dir"]


def run_dir(out: Path, run: GridRun) -> Path:
    return out / "runs" / run.run_id


def is_finished(folder: Path, run: GridRun) -> bool:
    """Whether ``folder`` holds a finished run with ``run``'s settings (its config.json
    agrees with every override, so editing a grid file reruns the runs it changed)."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if summary.get("status") != "finished":
        return False
    return all(config.get(key) == value for key, value in run.overrides.items())
