"""The code's layering: the FAB carries the runtime only, and the runtime never imports
the tooling (florg_tools: launcher, deploy, experiments, asset fetcher, flwr-home writer)."""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_PACKAGES = ("flower_app", "client_app", "server_app", "strategies")
TOOLING = "florg_tools"


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imported_names(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names, function-local imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_runtime_module_imports_the_tooling():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in RUNTIME_PACKAGES
        for path in _modules(package)
        for name in _imported_names(path)
        if name == TOOLING or name.startswith(TOOLING + ".")
    ]
    assert not offenders, offenders


def test_importing_both_apps_loads_no_tooling_module():
    code = (
        "import sys, client_app.client_app, server_app.server_app; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] == {TOOLING!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_fab_include_patterns_match_runtime_files_only():
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()]
    files = [f for f in files if not f.startswith((".venv/", ".git/"))]
    included = {f for f in files for pat in app["fab-include"] if fnmatch.fnmatch(f, pat)}
    assert any(f.startswith("flower_app/") for f in included)
    assert not [f for f in included if f.startswith(TOOLING + "/")]
    top = {f.split("/")[0] for f in included}
    assert top <= set(RUNTIME_PACKAGES) | {"conf"}, top
