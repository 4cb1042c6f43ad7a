"""benchmarks/ is a package run as modules from the repository root
(``python -m benchmarks.SUBJECT.SCRIPT``): every folder has an ``__init__.py``, nothing
edits ``sys.path``, and every module imports (scripts keep their heavy imports lazy)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import benchmarks

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def test_every_folder_is_a_package():
    folders = [p for p in BENCHMARKS.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert folders, "benchmarks/ has no subpackages"
    assert not [f for f in folders if not (f / "__init__.py").is_file()]


def test_no_benchmark_edits_sys_path():
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in BENCHMARKS.rglob("*.py")
        if "sys.path" in p.read_text()
    ]
    assert not offenders, offenders


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(benchmarks.__path__, "benchmarks.")]
    assert "benchmarks.core.core_benchmark" in names
    assert "benchmarks.centralised.centralised_reference" in names
    for name in names:
        importlib.import_module(name)
    assert benchmarks.REPO_ROOT == ROOT
