"""Where the fetched offline assets are: the read side of ``<cache>/registry.json``.

The fetcher (``python -m florg_tools.assets fetch``, tooling outside the FAB) downloads
real models and data published inside PyPI packages into the cache and writes the
registry; the ServerApp and ClientApps only read it, through this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REGISTRY_FILE = "registry.json"
FETCH_COMMAND = "python -m florg_tools.assets fetch"


def default_cache_dir() -> Path:
    """``$FLORG_CACHE`` if set, else ``~/.cache/florg``.

    Not relative to this file: ``flwr run`` installs the app (this module included)
    under ``$FLWR_HOME/apps``, and the ServerApp and ClientApps must find the same cache.
    """
    env = os.environ.get("FLORG_CACHE")
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "florg"


def cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser().resolve() if cache_dir else default_cache_dir()


def load_registry(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Read ``<cache>/registry.json``; FileNotFoundError with a hint when it is missing."""
    path = cache_root(cache_dir) / REGISTRY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"asset registry {path} not found; run `{FETCH_COMMAND}`")
    return json.loads(path.read_text())


def lookup(section: str, name: str, cache_dir: str | os.PathLike[str] | None) -> Any:
    """The registry entry ``name`` of ``section`` ('models' or 'tasks')."""
    entries = load_registry(cache_dir).get(section, {})
    if name not in entries:
        raise FileNotFoundError(
            f"{name!r} is not in the asset registry; run `{FETCH_COMMAND} --only {name}` "
            f"(`--all` for every asset)"
        )
    return entries[name]


def model_path(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Local folder of a fetched model (HF format)."""
    path = Path(lookup("models", name, cache_dir))
    if not path.is_dir():  # cache moved since the registry was written
        path = cache_root(cache_dir) / "models" / name
    return path


def task_info(name: str, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Registry entry of a fetched dataset; ``path`` is re-rooted if the cache moved."""
    info = dict(lookup("tasks", name, cache_dir))
    if not Path(info["path"]).is_dir():
        info["path"] = str(cache_root(cache_dir) / "data" / name)
    return info
