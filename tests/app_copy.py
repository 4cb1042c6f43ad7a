"""Test helper: a copy of the Flower App with one module added to one registry, as a user
adds a method (strategies/) or a task kind (flower_app/task_kinds/): one module plus
one registry line. Not a test module."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

__test__ = False

ROOT = Path(__file__).resolve().parent.parent
APP_PARTS = ("pyproject.toml", "flower_app", "client_app", "server_app", "strategies", "conf")


def app_with_registered_module(
    folder: Path, package: str, name: str, source: str, registry: str
) -> Path:
    """Copy the app into ``folder``, write ``source`` as ``flower_app/<package>/<name>.py``
    and add ``name`` as the first entry of the tuple ``registry`` in that package's
    ``__init__.py``; returns ``folder``."""
    folder.mkdir(parents=True)
    for part in APP_PARTS:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, folder / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, folder / part)
    (folder / "flower_app" / package / f"{name}.py").write_text(textwrap.dedent(source))
    init = folder / "flower_app" / package / "__init__.py"
    text = init.read_text()
    opening = f"{registry} = (\n"
    assert text.count(opening) == 1, f"{init}: no single {registry} tuple"
    init.write_text(text.replace(opening, f'{opening}    "{name}",\n'))
    return folder
