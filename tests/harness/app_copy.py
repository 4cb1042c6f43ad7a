"""Test helper: a copy of the Flower App with one method folder (strategies/<name>/), one
adapter-kind folder (flower_app/adapters/<name>/) or one task-kind module
(flower_app/task_kinds/) added plus its registry line, as a user adds one. Not a test
module."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

__test__ = False

ROOT = Path(__file__).resolve().parents[2]
APP_PARTS = ("pyproject.toml", "flower_app", "client_app", "server_app", "strategies", "conf")


def copy_app(folder: Path) -> Path:
    """A copy of the Flower App's files (``APP_PARTS``) in ``folder`` (created)."""
    folder.mkdir(parents=True)
    for part in APP_PARTS:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, folder / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, folder / part)
    return folder


def app_with_registered_module(
    folder: Path, package: str, name: str, source: str, registry: str
) -> Path:
    """Copy the app into ``folder``, write ``source`` as ``flower_app/<package>/<name>.py``
    and add ``name`` as the first entry of the tuple ``registry`` in that package's
    ``__init__.py``; returns ``folder``."""
    copy_app(folder)
    (folder / "flower_app" / package / f"{name}.py").write_text(textwrap.dedent(source))
    init = folder / "flower_app" / package / "__init__.py"
    text = init.read_text()
    opening = f"{registry} = (\n"
    assert text.count(opening) == 1, f"{init}: no single {registry} tuple"
    init.write_text(text.replace(opening, f'{opening}    "{name}",\n'))
    return folder


def app_with_adapter_kind_folder(folder: Path, name: str, kind_source: str) -> Path:
    """Copy the app into ``folder``, write ``kind_source`` as the adapter kind's
    ``flower_app/adapters/<name>/kind.py`` and add ``name`` as the first entry of
    ``KIND_MODULES`` in ``flower_app/adapters/registry.py``, as a user adds a kind; returns
    ``folder``."""
    copy_app(folder)
    kind_dir = folder / "flower_app" / "adapters" / name
    kind_dir.mkdir()
    (kind_dir / "kind.py").write_text(textwrap.dedent(kind_source))
    registry = folder / "flower_app" / "adapters" / "registry.py"
    text = registry.read_text()
    opening = "KIND_MODULES = (\n"
    assert text.count(opening) == 1, f"{registry}: no single KIND_MODULES tuple"
    registry.write_text(text.replace(opening, f'{opening}    "{name}",\n'))
    return folder


def app_with_method_folder(folder: Path, name: str, files: dict[str, str]) -> Path:
    """Copy the app into ``folder``, write ``files`` (file name -> source) as the method
    folder ``strategies/<name>/`` and add ``name`` as the first entry of ``METHOD_FOLDERS``
    in ``strategies/registry.py``, as a user adds a method; returns ``folder``."""
    copy_app(folder)
    method_dir = folder / "strategies" / name
    method_dir.mkdir()
    for file, source in files.items():
        (method_dir / file).write_text(textwrap.dedent(source))
    registry = folder / "strategies" / "registry.py"
    text = registry.read_text()
    opening = "METHOD_FOLDERS = (\n"
    assert text.count(opening) == 1, f"{registry}: no single METHOD_FOLDERS tuple"
    registry.write_text(text.replace(opening, f'{opening}    "{name}",\n'))
    return folder


def changed_files(app: Path) -> list[str]:
    """The files of the copy ``app`` that differ from, or are absent in, this checkout."""
    return sorted(
        str(path.relative_to(app))
        for path in app.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and (
            not (ROOT / path.relative_to(app)).is_file()
            or path.read_bytes() != (ROOT / path.relative_to(app)).read_bytes()
        )
    )
