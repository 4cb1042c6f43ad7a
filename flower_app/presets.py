"""Presets: a flat TOML table of run-config keys, ``conf/<name>.toml``.

The same file ``flwr run . CONNECTION --run-config conf/NAME.toml`` takes; the launcher
merges it between the defaults and ``--set`` values (the precedence is described in
flower_app/config.py).  ``load_preset`` reads one and checks every key and value against
the schema, so a bad preset fails before a run starts.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from flower_app.config import CONF_DIR, ConfigError, check_keys, coerce_setting


def preset_path(name: str) -> Path:
    """``conf/<name>.toml``, or ``name`` itself when it is a path ending in ``.toml``."""
    return Path(name) if name.endswith(".toml") else CONF_DIR / f"{name}.toml"


def load_preset(name: str) -> dict[str, Any]:
    """The settings of the preset ``conf/<name>.toml`` (or a TOML path): a flat table of
    run-config keys, the same file ``flwr run --run-config`` accepts. Unknown keys and bad
    values raise ConfigError."""
    path = preset_path(name)
    if not path.is_file():
        known = sorted(p.stem for p in CONF_DIR.glob("*.toml"))
        raise ConfigError(f"preset: {path} not found; presets in conf/: {known}")
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"preset: cannot read {path}: {err}") from err
    check_keys(values, str(path))
    for key, value in values.items():
        coerce_setting(key, value)
    return values
