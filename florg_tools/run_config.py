"""The run config of a ``flwr run``: overrides of the app's ``[tool.flwr.app.config]``.

Flattening nested tables to Flower's dotted keys, the app's declared defaults, rejecting
unknown keys, writing the overrides as a TOML file for ``flwr run --run-config F.toml``,
``--set`` values, the presets (``load_preset``: the one reader of ``conf/<name>.toml``; the
apps never read presets), and the launcher's layering (file < ``--preset`` < ``--set``,
resolved with this app's schema; ``--resume RUN_DIR``).
"""

from __future__ import annotations

import argparse
import json
import math
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomli_w  # a dependency of flwr

import strategies.registry  # noqa: F401  (every method registers: resolve_config reads them)

__all__ = [
    "ConfigValidationError",
    "RunConfigValue",
    "app_run_config",
    "check_run_config_keys",
    "check_run_config_value",
    "collect_run_config",
    "flatten_run_config",
    "is_this_app",
    "load_preset",
    "parse_set_value",
    "preset_path",
    "resolve_layers",
    "rerun_run_config",
    "resume_run_config",
    "write_run_config_toml",
]

RunConfigValue = str | int | float | bool


class ConfigValidationError(ValueError):
    """The run config was rejected before launching."""


def flatten_run_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested tables to Flower's dotted keys (``{"a": {"b": 1}} -> {"a.b": 1}``)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_run_config(value, full))
        else:
            flat[full] = value
    return flat


def app_run_config(app_dir: Path) -> dict[str, Any]:
    """The flattened ``[tool.flwr.app.config]`` defaults of the app in ``app_dir``."""
    pyproject = Path(app_dir) / "pyproject.toml"
    try:
        with pyproject.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as err:
        raise ConfigValidationError(f"{pyproject} not found: not a Flower App") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigValidationError(f"{pyproject} is not valid TOML: {err}") from err
    app = data.get("tool", {}).get("flwr", {}).get("app")
    if not isinstance(app, dict):
        raise ConfigValidationError(f"{pyproject} has no [tool.flwr.app] section")
    return flatten_run_config(app.get("config", {}))


def check_run_config_keys(app_dir: Path, run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Reject keys the app does not declare; return the effective (merged) run config.

    Flower's SuperLink rejects unknown override keys too, but only after building and
    uploading the FAB, and with a less helpful message.
    """
    defaults = app_run_config(app_dir)
    overrides = flatten_run_config(run_config)
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ConfigValidationError(
            f"unknown run-config key(s) {', '.join(unknown)}; the app declares: "
            f"{', '.join(sorted(defaults)) or '(none)'}"
        )
    return {**defaults, **overrides}


def check_run_config_value(key: str, value: Any) -> None:
    if isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigValidationError(f"run-config value for {key!r} is not finite: {value}")
        return
    raise ConfigValidationError(
        f"run-config value for {key!r} must be str, int, float or bool, got {type(value).__name__}"
    )


def write_run_config_toml(run_config: Mapping[str, Any], path: Path) -> Path:
    """Write overrides as a TOML file for ``flwr run --run-config path.toml``.

    ``flwr`` flattens the file's tables into dotted keys, so the key ``"a.b"`` is written
    as the dotted TOML key ``a.b``. ``path`` must end in ``.toml`` (that is how ``flwr``
    tells a file from an inline ``"k=v"`` string).
    """
    path = Path(path)
    if path.suffix != ".toml":
        raise ValueError(f"{path}: flwr only accepts run-config files ending in .toml")
    nested: dict[str, Any] = {}
    for key, value in flatten_run_config(run_config).items():
        check_run_config_value(key, value)
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigValidationError(f"run-config key {key!r} clashes with {part!r}")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigValidationError(f"run-config key {key!r} is also a table")
        node[parts[-1]] = value
    path.write_text(tomli_w.dumps(nested), encoding="utf-8")
    return path


def parse_set_value(text: str) -> RunConfigValue:
    """``--set`` value: a TOML literal (``3``, ``0.5``, ``true``, ``"s"``) or a bare string."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if isinstance(value, bool | int | float | str):
        return value
    return text


def resume_run_config(run_dir: Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run config that continues the run in ``run_dir``: the settings of its
    ``config.json`` (those that differ from the defaults), ``resume`` = the folder's absolute
    path, then ``overrides``."""
    from flower_app.settings.config import defaults

    path = Path(run_dir).expanduser().resolve() / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigValidationError(f"--resume: cannot read {path}: {err}") from err
    if not isinstance(saved, dict) or set(saved) - set(defaults()):
        raise ConfigValidationError(f"--resume: {path} is not a run's config.json")
    saved["preset"] = ""  # every value is resolved already
    config = {k: v for k, v in saved.items() if v != defaults()[k]}
    config["resume"] = str(path.parent)
    config.update(overrides or {})
    return config


# Settings of a finished run that a rerun does not take over: where and under which name
# it wrote, what it resumed, the commit it ran at (the rerun records its own).
NOT_RERUN = ("output-dir", "resume", "app-commit")


def rerun_run_config(run_dir: Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run config that runs the run in ``run_dir`` again from the start: the settings of
    its ``config.json`` (those that differ from today's defaults) but ``NOT_RERUN``, its
    ``run-name`` with ``-rerun`` appended (a timestamped one where it had none), then
    ``overrides``. A key today's app does not know is refused, naming it; a key the old
    config lacks takes today's default."""
    from flower_app.settings.config import defaults

    path = Path(run_dir).expanduser().resolve() / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigValidationError(f"--rerun: cannot read {path}: {err}") from err
    if not isinstance(saved, dict):
        raise ConfigValidationError(f"--rerun: {path} is not a run's config.json")
    unknown = sorted(set(saved) - set(defaults()))
    if unknown:
        raise ConfigValidationError(
            f"--rerun: {path} has settings this app does not know: {', '.join(unknown)} "
            "(a run of another version; rerun it at its app-commit)"
        )
    saved["preset"] = ""  # every value is resolved already
    config = {k: v for k, v in saved.items() if k not in NOT_RERUN and v != defaults()[k]}
    if config.get("run-name"):
        config["run-name"] = f"{config['run-name']}-rerun"
    config.update(overrides or {})
    return config


def preset_path(name: str, app_dir: Path | None = None) -> Path:
    """``<app>/conf/<name>.toml`` (this app's by default), or ``name`` itself when it is a
    path ending in ``.toml``."""
    if name.endswith(".toml"):
        return Path(name)
    if app_dir is None:
        from flower_app.settings.config import CONF_DIR

        return CONF_DIR / f"{name}.toml"
    return Path(app_dir) / "conf" / f"{name}.toml"


def load_preset(name: str, app_dir: Path | None = None) -> dict[str, Any]:
    """The settings of the preset ``name`` (``preset_path``): a flat TOML table of run-config
    keys, the same file ``flwr run --run-config`` accepts. A missing or unreadable file
    raises ConfigValidationError naming ``--preset`` and the presets there; for this app
    (``app_dir`` None or this app) unknown keys and bad values raise its ConfigError."""
    path = preset_path(name, app_dir)
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.toml")) if path.parent.is_dir() else []
        raise ConfigValidationError(f"--preset: {path} not found; presets in conf/: {known}")
    try:
        with path.open("rb") as fh:
            values = flatten_run_config(tomllib.load(fh))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigValidationError(f"--preset: cannot read {path}: {err}") from err
    if app_dir is None or is_this_app(Path(app_dir)):
        from flower_app.settings.config import check_keys, coerce_setting

        check_keys(values, str(path))
        for key, value in values.items():
            coerce_setting(key, value)
    return values


def collect_run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The launcher's overrides from its parsed arguments: ``--resume``, ``--rerun``, or
    ``--run-config-file`` < ``--preset`` (the app's ``conf/NAME.toml``, or a ``.toml`` path:
    the file plain ``flwr run --run-config`` takes) < ``--set``, merged here, so the apps
    receive plain values (flower_app/settings/config.py); validated with ``resolve_layers`` when
    ``--app`` is this app."""

    def toml_layer(path: Path, flag: str) -> dict[str, Any]:
        try:
            with path.open("rb") as fh:
                return flatten_run_config(tomllib.load(fh))
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ConfigValidationError(f"{flag} {path}: {err}") from err

    config: dict[str, Any] = {}
    if getattr(args, "resume", None) is not None:
        return resume_run_config(args.resume, parse_sets(args.sets))
    if getattr(args, "rerun", None) is not None:
        return resolve_layers(rerun_run_config(args.rerun, parse_sets(args.sets)))
    if args.run_config_file is not None:
        config.update(toml_layer(args.run_config_file, "--run-config-file"))
    if args.preset is not None:
        config.update(load_preset(str(args.preset), args.app))
    config.update(parse_sets(args.sets))
    return resolve_layers(config) if is_this_app(args.app) else config


def add_set_argument(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """The repeatable ``--set KEY=VALUE`` option (into ``args.sets``; ``parse_sets``)."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=help or "run-config override (repeatable; VALUE is a TOML literal or a bare string)",
    )


def parse_sets(items: Iterable[str]) -> dict[str, RunConfigValue]:
    """``--set`` items as settings, later ones winning; ConfigValidationError for an item
    that is not KEY=VALUE."""
    settings: dict[str, RunConfigValue] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigValidationError(f"--set expects KEY=VALUE, got {item!r}")
        settings[key.strip()] = parse_set_value(value)
    return settings


def is_this_app(app_dir: Path) -> bool:
    """Whether ``app_dir`` declares this project's run settings (then they are resolved
    and validated with flower_app.settings.config before launching)."""
    from flower_app.settings.config import defaults

    try:
        return set(app_run_config(app_dir)) == set(defaults())
    except (OSError, ValueError, KeyError):
        return False


def resolve_layers(overrides: dict[str, Any]) -> dict[str, Any]:
    """Validate the merged layers with this app's schema and return them unchanged: the
    apps layer nothing themselves, so Flower's defaults + these values is the run config,
    as with plain ``flwr run --run-config F.toml``."""
    from flower_app.settings.config import resolve_config

    resolve_config({}, overrides)
    return dict(overrides)
