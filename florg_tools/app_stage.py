"""A staged copy of a Flower App: only the files its FAB can contain, for ``flwr run``
(``stage_app``, ``fab_include_roots``).

``flwr run <app>`` walks and resolves every file under the app's root before it filters
them (``flwr.cli.utils.collect_files``): seconds per launch in a checkout with its
``.venv`` inside. When the app's ``[tool.flwr.app] fab-include`` patterns all start with a
literal folder, ``stage_app`` copies ``pyproject.toml``, ``.gitignore`` and those folders'
matching files into a fresh folder; ``flwr run`` on it builds the same FAB, byte for byte
(tests/tooling/test_app_stage.py). Without such patterns the app's own folder is used.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

import pathspec

__all__ = ["fab_include_roots", "stage_app"]

# Copied whenever present: the FAB's manifest and the publish filter read them.
ALWAYS_COPIED = ("pyproject.toml", ".gitignore")
GLOB_CHARACTERS = frozenset("*?[")


def fab_include_roots(app_dir: Path) -> tuple[list[str], list[str]] | None:
    """``(patterns, roots)``: the app's ``fab-include`` patterns and the top-level folders
    they start with, or ``None`` when there are no patterns or one may match a file
    anywhere (a leading glob, a top-level file pattern, a negation)."""
    config = tomllib.loads((app_dir / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config.get("tool", {}).get("flwr", {}).get("app", {}).get("fab-include")
    if not patterns or not isinstance(patterns, list):
        return None
    roots: list[str] = []
    for pattern in patterns:
        if not isinstance(pattern, str) or pattern.startswith("!"):
            return None
        parts = pattern.lstrip("/").split("/")
        if len(parts) < 2 or GLOB_CHARACTERS & set(parts[0]) or parts[0] in ("", ".", ".."):
            return None
        if parts[0] not in roots:
            roots.append(parts[0])
    return patterns, roots


def stage_app(app_dir: Path, dest: Path) -> Path:
    """Copy the files ``app_dir``'s FAB can contain into the new folder ``dest`` and return
    it; return ``app_dir`` itself when its ``fab-include`` patterns do not confine the FAB
    to named folders (see ``fab_include_roots``)."""
    app_dir = Path(app_dir).resolve()
    found = fab_include_roots(app_dir)
    if found is None:
        return app_dir
    patterns, roots = found
    spec = pathspec.GitIgnoreSpec.from_lines(patterns)  # gitignore semantics, as Flower
    dest.mkdir(parents=True)
    for name in ALWAYS_COPIED:
        if (app_dir / name).is_file():
            shutil.copy2(app_dir / name, dest / name)
    for root in roots:
        top = app_dir / root
        if not top.is_dir() or top.is_symlink():
            continue  # Flower names the pattern that matches nothing
        # followlinks=False and no symlinked files: what Flower's own walk keeps.
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                path = Path(dirpath) / filename
                relative = path.relative_to(app_dir).as_posix()
                if path.is_symlink() or not spec.match_file(relative):
                    continue
                target = dest / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    return dest
