"""The keys of the on-disk caches (flower_app/cache/disk.py): SHA-256 hashes of everything a
cached result depends on, none of it listed by hand: the run settings of the groups the
cache declares, the identity (name, size, mtime) of the model and data files, the library
versions, and the source of the module that builds the result and of every module of this
project it imports, transitively, function-local imports included (``_code_hash``)."""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from flower_app.environment import package_versions
from flower_app.settings.config import settings_for

_ROOT = Path(__file__).resolve().parents[2]  # the repository's root
# The packages whose source a cached result may depend on (the runtime; never the tooling).
_PROJECT_PACKAGES = ("flower_app", "strategies", "client_app", "server_app")


def _module_file(name: str) -> Path | None:
    base = _ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


_DYNAMIC_IMPORTS = frozenset({"import_module", "__import__"})

# CPython 3.11 keeps the AST constructor's recursion counter once per interpreter, so an
# ``ast.parse`` in another thread at the same moment (Flower's simulation runs the ServerApp
# in a thread beside the engine's) can fail ours with "SystemError: AST constructor recursion
# depth mismatch" although the source is fine (python/cpython#106905; seen once in CI).
_PARSE_LOCK = threading.Lock()
_PARSE_TRIES = 3
_PARSE_RACE = "recursion depth mismatch"


def _parse(path: Path) -> ast.Module:
    """``ast.parse`` of a project file, parsed again when another thread's parse corrupted
    the interpreter's AST recursion counter (see ``_PARSE_RACE``); any other error, or the
    race ``_PARSE_TRIES`` times over, is raised."""
    source = path.read_bytes()
    with _PARSE_LOCK:  # our own threads never race each other
        for _ in range(_PARSE_TRIES - 1):
            try:
                return ast.parse(source, str(path))
            except SystemError as err:
                if _PARSE_RACE not in str(err):
                    raise
        return ast.parse(source, str(path))  # the last try: whatever it raises is raised


def _imports(name: str, path: Path) -> set[str]:
    """The modules ``name`` imports (function-local imports included), their parent
    packages too (importing ``a.b.c`` runs ``a`` and ``a.b``); ``from p import m`` names
    ``p.m`` when that is a module. A module that imports by name at run time
    (``importlib.import_module``, ``__import__``: the method registry) is taken to import
    every module of its package."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and package:
            called = node.func
            called_name = getattr(called, "id", None) or getattr(called, "attr", None)
            if called_name in _DYNAMIC_IMPORTS:
                folder = path.parent
                found.update(
                    ".".join([*package, *f.relative_to(folder).with_suffix("").parts])
                    for f in folder.rglob("*.py")
                    if f.name != "__init__.py"
                )
    with_parents = set(found)
    for module in found:
        parts = module.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return with_parents


def _code_files(module: str) -> dict[str, Path]:
    """``module`` and every module of this project (``_PROJECT_PACKAGES``) it imports,
    transitively: ``{name: file}``."""
    files: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = None if name in files else _module_file(name)
        if path is None:
            continue
        files[name] = path
        todo.extend(m for m in _imports(name, path) if m.split(".")[0] in _PROJECT_PACKAGES)
    return files


@functools.lru_cache(maxsize=8)
def _code_hash(module: str) -> str:
    """SHA-256 over the source of ``_code_files(module)``."""
    h = hashlib.sha256()
    for name, path in sorted(_code_files(module).items()):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def path_identity(path: str | os.PathLike[str] | None) -> Any:
    """(name, size, mtime) of a file or of every file under a folder; a name that is not a
    local path (a Hub id) stands for itself."""
    if not path:
        return None
    p = Path(path).expanduser()
    if not p.exists():
        return str(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return [
        [str(f.relative_to(p)) if p.is_dir() else str(f.resolve()), st.st_size, st.st_mtime_ns]
        for f in files
        for st in [f.stat()]
    ]


@functools.cache
def _versions() -> dict[str, str]:
    """The installed versions of the libraries a cached entry depends on, read once per
    process from their package metadata: importing them to read ``__version__`` would load
    PEFT (seconds of CPU) into every FLoRG process, which never uses it otherwise."""
    return package_versions(("torch", "transformers", "datasets", "peft"))


def _settings(config: Any, groups: tuple[str, ...]) -> dict[str, Any]:
    if not groups:
        raise ValueError("a cache must name the setting groups its result depends on")
    return settings_for(config, *groups)


def _key(kind: str, parts: dict[str, Any]) -> str:
    text = json.dumps({"kind": kind, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _model_identity(model: str) -> Any:
    from flower_app.modeling import resolve_model_source

    return path_identity(resolve_model_source(model))
