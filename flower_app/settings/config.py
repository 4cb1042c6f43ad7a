"""Run settings: one declaration each, from which everything else derives.

Every setting is a field declared with ``setting(default, help, check=..., affects=...)``: the
core's in ``RunConfig`` (its groups in flower_app/settings/), a method's own in its folder
(``Method.settings``). ``run_config_class()`` is ``RunConfig`` with every registered method's
settings; derived from it: ``schema()``, ``defaults()``, pyproject.toml's
``[tool.flwr.app.config]`` (``python -m florg_tools.settings --write``) and the disk caches' keys
(the groups a setting ``affects``). ``resolve_config`` is the one validation every caller runs:
unknown keys and bad values raise ``ConfigError`` naming the key. It reads the method registry
(the values of ``method``, every method's own keys) and the registry never imports this module,
so a misspelt method fails every caller that resolves settings. Precedence (defaults < preset <
explicit values): docs/usage.md, "Presets and how settings combine"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, make_dataclass
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, get_type_hints

from flower_app.methods.registry import get_method, method_names
from flower_app.settings import DATA as DATA  # re-exported: the groups caches key on
from flower_app.settings import GROUPS
from flower_app.settings import MODEL as MODEL
from flower_app.settings import TOKENISATION as TOKENISATION
from flower_app.settings.checks import FOLDER_NAME_HINT as FOLDER_NAME_HINT  # re-exported
from flower_app.settings.checks import ConfigError, coerce
from flower_app.settings.checks import is_folder_name as is_folder_name  # re-exported
from flower_app.settings.cross_checks import CROSS_CHECKS
from flower_app.settings.run_settings import RunSettings

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the presets (the tooling's)


@dataclass(frozen=True)
class RunConfig(RunSettings):
    """Validated run settings: the core's (``RunSettings``) and, in the instances
    ``resolve_config`` returns (``run_config_class()``), every registered method's own
    settings after them.

    A field ``data_path`` is the key ``data-path`` (Flower's kebab-case convention);
    ``schema()``, ``defaults()``, pyproject's ``[tool.flwr.app.config]`` (generated:
    ``python -m florg_tools.settings --write``) and the cache keys derive from these."""

    def as_dict(self) -> dict[str, Any]:
        return {to_key(f.name): getattr(self, f.name) for f in fields(self)}

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled by value: the class with the methods' settings is built per process
        return (_rebuild, ({f.name: getattr(self, f.name) for f in fields(self)},))


class Setting(NamedTuple):
    """One key of ``schema()``, derived from its ``RunConfig`` field."""

    default: Any
    kind: type
    check: Callable[[Any], bool] | None
    help: str
    affects: frozenset[str]


def to_attr(key: str) -> str:
    return key.replace("-", "_")


def to_key(attr: str) -> str:
    return attr.replace("_", "-")


def run_config_class() -> type[RunConfig]:
    """``RunConfig`` with every registered method's own settings (``Method.settings``, a
    frozen dataclass of ``setting(...)`` fields in the method's folder) added after the
    core's: the class ``resolve_config`` builds. The core's keys come first, then each
    method's in registration order; a method's settings class shared by several methods
    counts once. Built once per set of registered settings."""
    return composed_run_config(method_settings_classes())


def method_settings_classes() -> tuple[type, ...]:
    """The registered methods' settings classes, each once, in registration order."""
    classes: list[type] = []
    for name in method_names():
        declared = get_method(name).settings
        if declared is not None and declared not in classes:
            classes.append(declared)
    return tuple(classes)


def method_setting_owners() -> dict[str, tuple[str, ...]]:
    """Each method-declared key -> the registered methods that declare it."""
    owners: dict[str, tuple[str, ...]] = {}
    for name in method_names():
        declared = get_method(name).settings
        for f in fields(declared) if declared is not None else ():
            owners[to_key(f.name)] = (*owners.get(to_key(f.name), ()), name)
    return owners


@cache
def composed_run_config(classes: tuple[type, ...]) -> type[RunConfig]:
    """``RunConfig`` with the settings ``classes`` after its own fields; TypeError when a
    key is declared twice (by the core and a method, or by two methods)."""
    if not classes:
        return RunConfig
    seen = {f.name: "the core" for f in fields(RunConfig)}
    for declared in classes:
        for f in fields(declared):
            if f.name in seen:
                raise TypeError(
                    f"setting {to_key(f.name)!r} of {declared.__qualname__} is declared "
                    f"by {seen[f.name]} already: a key has one declaration"
                )
            seen[f.name] = declared.__qualname__
    # A dataclass lists its bases' fields from the last base on: the core's, then the
    # methods' in registration order.
    composed = make_dataclass("RunConfig", [], bases=(*reversed(classes), RunConfig), frozen=True)
    composed.__module__ = __name__
    composed.__qualname__ = "run_config_class()"
    composed.__doc__ = RunConfig.__doc__
    return composed


def _rebuild(values: dict[str, Any]) -> RunConfig:
    """A pickled run config back, as the class of this process's registered methods."""
    return run_config_class()(**values)


def schema() -> Mapping[str, Setting]:
    """key -> (default, type, check, help, groups affected), in declaration order: the
    core's settings, then every registered method's own."""
    return _schema(run_config_class())


def defaults() -> dict[str, Any]:
    """key -> default, every setting of ``schema()``."""
    return {key: spec.default for key, spec in schema().items()}


@cache
def _schema(config_class: type[RunConfig]) -> Mapping[str, Setting]:
    hints = get_type_hints(config_class)
    out: dict[str, Setting] = {}
    for f in fields(config_class):
        if "affects" not in f.metadata:
            raise TypeError(f"RunConfig.{f.name}: declare it with setting(...)")
        kind = hints[f.name]
        if kind not in (str, int, float, bool) or not isinstance(f.default, kind):
            raise TypeError(f"RunConfig.{f.name}: a str, int, float or bool with such a default")
        meta = f.metadata
        out[to_key(f.name)] = Setting(f.default, kind, meta["check"], meta["help"], meta["affects"])
    return MappingProxyType(out)


def keys_affecting(*groups: str) -> tuple[str, ...]:
    """The keys of the settings that affect any of ``groups`` (schema order)."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown setting group(s) {sorted(unknown)}; groups: {GROUPS}")
    return tuple(key for key, spec in schema().items() if spec.affects & set(groups))


def settings_for(config: RunConfig, *groups: str) -> dict[str, Any]:
    """``{key: value}`` of ``config``'s settings that affect any of ``groups``: what a
    cache of an artefact built from those groups must key on."""
    return {key: getattr(config, to_attr(key)) for key in keys_affecting(*groups)}


def coerce_setting(key: str, value: Any) -> Any:
    """``value`` coerced to the type of setting ``key`` and checked (config_checks.py)."""
    spec = schema()[key]
    return coerce(key, value, spec.kind, spec.check)


def check_keys(values: Mapping[str, Any], origin: str) -> None:
    known = schema()
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {unknown} in {origin}; known settings: {', '.join(known)}"
        )


def resolve_config(
    run_config: Mapping[str, Any], explicit: Mapping[str, Any] | None = None
) -> RunConfig:
    """Validate the settings: the defaults, updated with ``run_config``, then ``explicit``.

    ``run_config`` is what Flower hands the apps (every key, the defaults filled in, the
    ``--run-config`` values already on top); every value in it is taken as given, a value
    equal to its default included. ``explicit`` adds overrides on top (grids, tests).
    """
    check_keys(run_config, "the run config")
    explicit = dict(explicit or {})
    check_keys(explicit, "the overrides")
    values = {**defaults(), **run_config, **explicit}
    resolved = {to_attr(k): coerce_setting(k, v) for k, v in values.items()}
    config = run_config_class()(**resolved)
    for check in CROSS_CHECKS:  # flower_app/settings/cross_checks.py
        check(config)
    return config
