"""What a run records about its machine (flower_app/environment.py), how a grid report lists
the machines its runs recorded, and the commit a grid's runs ran at."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path

from florg_lab.aggregate import run_machines
from florg_tools.provenance import checkout_commit
from flower_app.environment import (
    KERNEL_FLAGS,
    _cpu_model_and_flags,
    describe_environment,
    environment_label,
)

CPUINFO = """processor\t: 0
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile
processor\t: 1
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile
"""


def test_cpuinfo_gives_the_model_and_only_the_kernel_flags_in_a_fixed_order(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    model, flags = _cpu_model_and_flags(cpuinfo)
    assert model == "Example CPU 9000"
    assert flags == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]
    assert all(flag in KERNEL_FLAGS for flag in flags)


def test_without_cpuinfo_the_platform_names_the_processor(tmp_path):
    model, flags = _cpu_model_and_flags(tmp_path / "missing")
    assert model and flags == []


def test_this_machine_is_described_in_json_with_its_installed_versions():
    environment = json.loads(json.dumps(describe_environment()))
    for package in ("flwr", "torch", "transformers", "peft", "datasets"):
        assert environment[package] == importlib.metadata.version(package)
    assert environment["cpu-count"] >= 1 and environment["torch-threads"] >= 1
    assert set(environment["cpu-flags"]) <= set(KERNEL_FLAGS)
    label = environment_label(environment)
    assert environment["torch"] in label and environment["cpu"] in label


def test_a_report_counts_the_machines_its_runs_recorded():
    old = {"cpu": "CPU A", "cpu-flags": ["avx2", "avx512f"], "cpu-count": 2, "torch": "2.13.0"}
    new = {"cpu": "CPU A", "cpu-flags": ["avx2"], "cpu-count": 2, "torch": "2.13.0"}
    text = run_machines([old, new, new, None])
    parts = text.split("; ")
    assert parts[0] == f"{environment_label(new)} (2 runs)"
    assert parts[1] == f"{environment_label(old)} (1 run)"
    assert parts[2].startswith("not recorded (1 run,")
    assert "avx2+avx512f" in parts[1] and "avx512f" not in parts[0]


def test_the_grid_records_the_commit_and_whether_tracked_files_were_changed(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True
        ).stdout.strip()

    assert checkout_commit(tmp_path) is None  # not a git checkout
    git("init", "-q")
    git("config", "user.email", "t@example.invalid")
    git("config", "user.name", "t")
    (tmp_path / "grid.yaml").write_text("a: 1\n")
    git("add", "grid.yaml")
    git("commit", "-qm", "grid")
    head = git("rev-parse", "HEAD")
    (tmp_path / "untracked.txt").write_text("x")
    assert checkout_commit(tmp_path) == head
    (tmp_path / "grid.yaml").write_text("a: 2\n")
    assert checkout_commit(tmp_path) == f"{head}+modified"


def test_this_checkout_has_a_commit():
    assert checkout_commit(Path(__file__).resolve().parents[2])
