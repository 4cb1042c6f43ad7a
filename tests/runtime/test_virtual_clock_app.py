"""virtual-clock end to end through the real simulation engine (SuperLink + Ray) on the tiny
BERT (tests/harness/flower_harness.py): the nodes state their profiles (the ClientApp's
``query.profile``), and an async run's rows are the same, apart from the wall clock, whether
the machine is quiet or a process burns a core beside it (its real reply order changes, its
virtual one does not). The loops' virtual order: tests/runtime/test_virtual_clock.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ci.behaviour_snapshot import is_wall_clock
from tests.harness.flower_harness import TINY_NUM_NODES, run_tiny_app

pytestmark = pytest.mark.integration

# async, one reply an update from 3 nodes of different virtual speeds: the reply order sets
# every row (which partition, its staleness)
CLOCKED = {
    "round-mode": "async",
    "async-buffer-size": 1,
    "num-server-rounds": 3,
    "virtual-clock": True,
    "node-speeds": "lognormal",
    "node-speed-sigma": 1.0,
    "local-steps": 2,
    "batch-size": 8,
    "max-test-examples": 0,
}
BURN = "while True:\n    pass\n"  # one core busy until killed


def comparable(run_dir: Path) -> list[dict]:
    """The rows without their wall-clock keys (the virtual ones kept)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in row.items() if k.startswith("virtual-") or not is_wall_clock(k)}
        for row in rows
    ]


def test_an_async_runs_rows_do_not_depend_on_the_machines_load(tiny_superlink, tiny_assets):
    quiet, quiet_dir = run_tiny_app(tiny_superlink, tiny_assets, "clock-quiet", **CLOCKED)
    assert quiet.ok, f"{quiet.message}\n{quiet.log_text[-3000:]}"
    burner = subprocess.Popen([sys.executable, "-c", BURN])  # a busy core beside the run
    try:
        busy, busy_dir = run_tiny_app(tiny_superlink, tiny_assets, "clock-busy", **CLOCKED)
    finally:
        burner.kill()
        burner.wait()
    assert busy.ok, f"{busy.message}\n{busy.log_text[-3000:]}"
    rows = comparable(quiet_dir)
    assert rows == comparable(busy_dir)
    assert [row["round"] for row in rows] == [0, 1, 2, 3]
    updates = rows[1:]
    seconds = [row["virtual-seconds"] for row in updates]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert all(row["virtual-round-seconds"] >= 0 for row in updates)
    assert all(len(row["partitions"]) == 1 for row in updates)
    assert "virtual-seconds" not in rows[0]
    assert len({p for row in updates for p in row["partitions"]}) <= TINY_NUM_NODES
