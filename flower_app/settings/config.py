"""Run settings: one declaration each, from which everything else derives.

Every setting is a field declared with ``setting(default, help, check=..., affects=...)``:
the core's in ``RunConfig`` (its groups in flower_app/settings/), a method's own in its
folder (``Method.settings``, ``strategies/<method>/settings.py``). ``run_config_class()`` is
``RunConfig`` with every registered method's settings added; the field ``data_path`` is the
key ``data-path``. Derived from it: ``schema()`` and ``defaults()``; pyproject.toml's
``[tool.flwr.app.config]`` with the help as comments (written by ``python -m
florg_tools.settings --write``; ``--check`` and tests/runtime/test_config.py fail when it
differs); the keys of the on-disk caches
(flower_app/cache/disk.py hashes every setting of the groups ``DATA``, ``TOKENISATION``,
``MODEL`` that a cache depends on; each setting names the groups it ``affects``).

Precedence, lowest first, the same for plain ``flwr run`` and for the launcher, because
presets are resolved before a run starts:

1. the defaults (pyproject's table);
2. a preset: a flat TOML table of run-config keys, ``conf/<name>.toml``
   (read and checked by the tooling, ``florg_tools.run_config.load_preset``; the apps
   never read presets);
3. explicit values: ``--run-config "key=value ..."`` (flwr run), ``--set key=value``
   (launcher).

``flwr run . CONNECTION --run-config conf/paper.toml`` runs a preset as it is (Flower 1.41
takes a TOML file or key=value pairs, not both: to change a preset's value there, copy the
file and edit it). ``python -m florg_tools.launch --preset paper --set batch-size=16``
merges ``--run-config-file`` < ``--preset`` < ``--set`` and submits the result as one TOML
file. Flower puts the given values over the defaults and the apps take every value as
given, one equal to its default included: an explicit value always wins. (The apps cannot
tell which keys a run config set, so nothing is layered inside them: the key ``preset``
remains only to refuse ``preset=NAME`` with a pointer to the above; it must be ''.)
Unknown keys and bad values raise ``ConfigError`` naming the key, before any model is
built or any client trains (the value checks and the coercion: flower_app/settings/checks.py).

Settings and methods depend one way, this module -> the method registry
(flower_app/methods/registry.py, filled by strategies/registry.py): the values ``method``
may take are the registered names (the registry's check ``RegisteredMethod``) and the
keys a run may set include every registered method's own, and ``resolve_config`` is the one
validation every caller runs (the apps, the launcher, the grids, the benchmarks), so it has
to know them. The registry never imports this module, not
even for annotations: a method is handed a ``RunConfig`` and reads the settings it needs by
name, and what a method derives from the settings lives with the method
(``Method.evaluates_on_clients``, ``Method.lora_init``, ``Method.build_strategy``). The
other way round, with the check outside ``resolve_config``, a run with a misspelt method
would pass every caller that only resolves settings.
"""

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
from flower_app.settings.model_and_data import AdapterSettings, DataSettings, LocalData, WhatRuns
from flower_app.settings.rounds import (
    AsyncRoundSettings,
    EvaluationSettings,
    FederationSettings,
    PrecisionSettings,
    PrivacySettings,
    ScreeningSettings,
    TrainingSettings,
)
from flower_app.settings.run import LeaderboardSettings, OutputSettings, TestingSettings

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the presets (the tooling's)


# The groups in reverse: a dataclass lists its bases' fields from the last base on, so the
# keys keep the order of flower_app/settings/.
@dataclass(frozen=True)
class RunConfig(
    TestingSettings,
    LeaderboardSettings,
    OutputSettings,
    PrivacySettings,
    ScreeningSettings,
    EvaluationSettings,
    PrecisionSettings,
    TrainingSettings,
    AsyncRoundSettings,
    FederationSettings,
    AdapterSettings,
    DataSettings,
    LocalData,
    WhatRuns,
):
    """Validated run settings: every group of flower_app/settings/ in one object, and, in
    the instances ``resolve_config`` returns (``run_config_class()``), every registered
    method's own settings after them.

    A field ``data_path`` is the key ``data-path`` (Flower's kebab-case convention);
    ``schema()``, ``defaults()``, pyproject's ``[tool.flwr.app.config]`` (generated:
    ``python -m florg_tools.settings --write``) and the cache keys derive from these."""

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.target_modules.split(",") if t.strip())

    @property
    def heads(self) -> tuple[str, ...] | None:
        names = tuple(h.strip() for h in self.head_modules.split(",") if h.strip())
        return names or None

    @property
    def head_lr(self) -> float:
        """The task head's learning rate: ``head-learning-rate``, or ``learning-rate``
        where that is 0 (the default: one rate for everything, the paper's protocol)."""
        return self.head_learning_rate or self.learning_rate

    def tests_round(self, server_round: int) -> bool:
        """Whether the server scores the held-out test split after ``server_round``:
        round 0, every ``test-every``-th round and the last three (the reported ones)."""
        return self.max_test_examples > 0 and self._scheduled(server_round, self.test_every)

    def validates_round(self, server_round: int) -> bool:
        """Whether the server scores the validation split after ``server_round``: round 0,
        every ``eval-every``-th round and the last three (what tuning reads)."""
        return self._scheduled(server_round, self.eval_every)

    def in_last_rounds(self, server_round: int) -> bool:
        """Whether ``server_round`` is one of the run's last three rounds, whose mean
        validation score the tuning reads (so every method is scored there)."""
        return server_round > self.num_server_rounds - 3

    def _scheduled(self, server_round: int, every: int) -> bool:
        periodic = every > 0 and server_round % every == 0
        return server_round == 0 or periodic or self.in_last_rounds(server_round)

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
