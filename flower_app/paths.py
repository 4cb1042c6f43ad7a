"""Where a run may write: every file lies inside an output root the operator sets.

The output root is ``$FLORG_OUTPUT_ROOT`` in the environment of the process that runs the
ServerApp (the operator's side), else that process's working directory. The run settings only
choose a folder inside it: ``output-dir`` (relative to the root, or absolute inside it),
``run-name`` (a single folder name: letters, digits and ``. _ = , + : @ % ~ -``, starting with a
letter or digit, at most 255 characters) and ``resume`` (an existing run folder, resolved like
``output-dir``); ``..`` and symbolic links that leave the root are refused (the check is on the
resolved path). Every refusal is a ``ConfigError`` naming the key, raised before anything is
written (docs/faults.md, section 4)."""

from __future__ import annotations

import os
from pathlib import Path

from flower_app.settings.config import FOLDER_NAME_HINT, ConfigError, RunConfig, is_folder_name

OUTPUT_ROOT_ENV = "FLORG_OUTPUT_ROOT"


def check_folder_name(value: str, key: str) -> str:
    """``value`` if it is a safe single folder name, else ConfigError naming ``key``."""
    if not is_folder_name(value):
        raise ConfigError(f"{key}: bad value {value!r} (must be {FOLDER_NAME_HINT})")
    return value


def output_root() -> Path:
    """The operator's output root: ``$FLORG_OUTPUT_ROOT``, else the working directory."""
    configured = os.environ.get(OUTPUT_ROOT_ENV, "").strip()
    return Path(configured or ".").expanduser().resolve()


def confined(path: str | os.PathLike[str], key: str, root: Path | None = None) -> Path:
    """``path`` resolved inside the output root (relative paths are relative to it);
    ConfigError naming ``key`` when it would lie outside."""
    root = (root or output_root()).resolve()
    text = os.fspath(path)
    if "\x00" in text:
        raise ConfigError(f"{key}: contains a NUL character")
    candidate = Path(text).expanduser()
    resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if not resolved.is_relative_to(root):
        raise ConfigError(
            f"{key}: {text!r} resolves to {resolved}, outside the output root {root} "
            f"(the operator sets the root with ${OUTPUT_ROOT_ENV}; run settings can only "
            "choose a folder inside it)"
        )
    return resolved


def run_folder(config: RunConfig, default_name: str) -> Path:
    """The run folder ``<output root>/<output-dir>/<run-name or default_name>``, checked;
    with ``resume`` set, the (existing) folder it names."""
    root = output_root()
    if config.resume:
        folder = confined(config.resume, "resume", root)
        if not folder.is_dir():
            raise ConfigError(f"resume: {folder} is not a run folder")
        return folder
    name = check_folder_name(config.run_name or default_name, "run-name")
    return confined(confined(config.output_dir, "output-dir", root) / name, "run-name", root)
