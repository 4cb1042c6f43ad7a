"""Run settings: one declaration, ``RunConfig``, from which everything else derives.

Every setting is a field of ``RunConfig`` declared with ``setting(default, help,
check=..., affects=...)``; the field ``data_path`` is the key ``data-path``. Derived from
it: ``SCHEMA`` and ``DEFAULTS``; pyproject.toml's ``[tool.flwr.app.config]`` with the help
as comments (written by ``python -m florg_tools.settings --write``; ``--check`` and
tests/test_config.py fail when it differs); the keys of the on-disk caches
(flower_app/disk_cache.py hashes every setting of the groups ``DATA``, ``TOKENISATION``,
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
built or any client trains (the value checks and the coercion: flower_app/config_checks.py).

Settings and methods depend one way, this module -> the method registry
(flower_app/methods/registry.py, filled by strategies/registry.py): the values ``method``
may take are the registered names (the registry's check ``RegisteredMethod``), and
``resolve_config`` is the one validation every caller runs (the apps, the launcher, the
grids, the benchmarks), so it has to know them. The registry never imports this module, not
even for annotations: a method is handed a ``RunConfig`` and reads the settings it needs by
name, and what a method derives from the settings lives with the method
(``Method.evaluates_on_clients``, ``Method.lora_init``, ``Method.build_strategy``). The
other way round, with the check outside ``resolve_config``, a run with a misspelt method
would pass every caller that only resolves settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

from flower_app.config_checks import FOLDER_NAME_HINT as FOLDER_NAME_HINT  # re-exported
from flower_app.config_checks import ConfigError, coerce
from flower_app.config_checks import is_folder_name as is_folder_name  # re-exported
from flower_app.methods.registry import get_method
from flower_app.settings import DATA as DATA  # re-exported: the groups caches key on
from flower_app.settings import GROUPS
from flower_app.settings import MODEL as MODEL
from flower_app.settings import TOKENISATION as TOKENISATION
from flower_app.settings.model_and_data import AdapterSettings, DataSettings, LocalData, WhatRuns
from flower_app.settings.rounds import (
    EvaluationSettings,
    FederationSettings,
    PrecisionSettings,
    PrivacySettings,
    ScreeningSettings,
    TrainingSettings,
)
from flower_app.settings.run import LeaderboardSettings, OutputSettings, TestingSettings

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # presets and grids (the tooling's)


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
    FederationSettings,
    AdapterSettings,
    DataSettings,
    LocalData,
    WhatRuns,
):
    """Validated run settings: every group of flower_app/settings/ in one object.

    A field ``data_path`` is the key ``data-path`` (Flower's kebab-case convention);
    ``SCHEMA``, ``DEFAULTS``, pyproject's ``[tool.flwr.app.config]`` (generated:
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
        return {key: getattr(self, to_attr(key)) for key in SCHEMA}


class Setting(NamedTuple):
    """One key of ``SCHEMA``, derived from its ``RunConfig`` field."""

    default: Any
    kind: type
    check: Callable[[Any], bool] | None
    help: str
    affects: frozenset[str]


def to_attr(key: str) -> str:
    return key.replace("-", "_")


def to_key(attr: str) -> str:
    return attr.replace("_", "-")


def _schema() -> dict[str, Setting]:
    hints = get_type_hints(RunConfig)
    schema: dict[str, Setting] = {}
    for f in fields(RunConfig):
        if "affects" not in f.metadata:
            raise TypeError(f"RunConfig.{f.name}: declare it with setting(...)")
        kind = hints[f.name]
        if kind not in (str, int, float, bool) or not isinstance(f.default, kind):
            raise TypeError(f"RunConfig.{f.name}: a str, int, float or bool with such a default")
        meta = f.metadata
        schema[to_key(f.name)] = Setting(
            f.default, kind, meta["check"], meta["help"], meta["affects"]
        )
    return schema


# key -> (default, type, check, help, groups affected), in declaration order.
SCHEMA: dict[str, Setting] = _schema()
DEFAULTS: dict[str, Any] = {key: spec.default for key, spec in SCHEMA.items()}


def keys_affecting(*groups: str) -> tuple[str, ...]:
    """The keys of the settings that affect any of ``groups`` (schema order)."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown setting group(s) {sorted(unknown)}; groups: {GROUPS}")
    return tuple(key for key, spec in SCHEMA.items() if spec.affects & set(groups))


def settings_for(config: RunConfig, *groups: str) -> dict[str, Any]:
    """``{key: value}`` of ``config``'s settings that affect any of ``groups``: what a
    cache of an artefact built from those groups must key on."""
    return {key: getattr(config, to_attr(key)) for key in keys_affecting(*groups)}


def coerce_setting(key: str, value: Any) -> Any:
    """``value`` coerced to the type of setting ``key`` and checked (config_checks.py)."""
    spec = SCHEMA[key]
    return coerce(key, value, spec.kind, spec.check)


def check_keys(values: Mapping[str, Any], origin: str) -> None:
    unknown = sorted(set(values) - set(SCHEMA))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {unknown} in {origin}; known settings: {', '.join(SCHEMA)}"
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
    values = {**DEFAULTS, **run_config, **explicit}
    resolved = {to_attr(k): coerce_setting(k, v) for k, v in values.items()}
    config = RunConfig(**resolved)
    for check in CROSS_CHECKS:
        check(config)
    return config


def _check_targets(config: RunConfig) -> None:
    """'' leaves the modules to the task kind; a value given must name one."""
    if config.target_modules.strip() and not config.targets:
        raise ConfigError("target-modules: name at least one module, or '' for the task's own")


def _check_lr_schedule(config: RunConfig) -> None:
    if config.lr_schedule == "cosine" and config.min_learning_rate > config.learning_rate:
        raise ConfigError(
            f"min-learning-rate: {config.min_learning_rate} is above learning-rate "
            f"{config.learning_rate}; cosine decays from learning-rate to min-learning-rate"
        )


def _check_method_settings(config: RunConfig) -> None:
    """The checks the method adds (``Method.check_settings``: dp=central's among them),
    each ValueError naming its key."""
    try:
        get_method(config.method).check_settings(config)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_half_precision_writes(config: RunConfig) -> None:
    """``precision`` bf16 / fp16 holds W0 in a half dtype, and two settings write into W0:
    ``subtract-init`` (W0 - s L A1^T A1 R, so that the start is a zero update) and a method
    that writes into W0 during the run (``Method.writes_base_weights``). A write into a
    half-precision W0 rounds every entry to 8 (bf16) or 11 (fp16) significant bits, an error
    of up to 2^-9 |W0| per entry, the size of what is written: the start would not be zero
    and what the method adds would be lost."""
    p = config.precision
    if p == "fp32":
        return
    if config.subtract_init:
        raise ConfigError(
            f"subtract-init=true writes s L A1^T A1 R into W0, which precision={p!r} holds in "
            f"{p}: the write rounds W0 by about as much as it subtracts; set subtract-init=false "
            "or precision=fp32"
        )
    if get_method(config.method).writes_base_weights:
        raise ConfigError(
            f"method={config.method!r} writes into W0 every round, which precision={p!r} "
            f"holds in {p}: the write rounds W0 by about as much as it adds; use "
            "precision=fp32"
        )


def _check_quantization_settings(config: RunConfig) -> None:
    """The machine-independent refusals of ``quantization`` (this machine's CUDA and
    bitsandbytes are checked where the model is loaded, by
    ``flower_app.precision.check_quantization_supported``): it needs a GPU, and a 4-bit /
    8-bit W0 cannot be written to, which ``subtract-init`` and a method that writes W0 do."""
    q = config.quantization
    if q == "none":
        return
    if config.device == "cpu":
        raise ConfigError(
            f"quantization={q!r} needs a CUDA GPU but device='cpu'; "
            "set quantization=none or device=auto / cuda"
        )
    if config.subtract_init:
        raise ConfigError(
            f"subtract-init=true writes s L A1^T A1 R into W0, which quantization={q!r} "
            "stores in bitsandbytes' packed format; set subtract-init=false or quantization=none"
        )
    if get_method(config.method).writes_base_weights:
        raise ConfigError(
            f"method={config.method!r} writes into W0 every round, which "
            f"quantization={q!r} stores in bitsandbytes' packed format; use quantization=none"
        )


def _check_example_dp(config: RunConfig) -> None:
    """``dp=example`` (DP-SGD with Opacus, flower_app/dp_sgd.py): Opacus' hooks record each
    module's input in the forward and compute per-example gradients in the backward, so a
    checkpointed block (whose forward runs twice) would record it twice; its noise and
    clipping run on float32 gradients, not a GradScaler's scaled ones, nor a quantised base's.
    A limit below the target could never be reached by a client that trains every round."""
    if config.dp != "example":
        return
    if config.gradient_checkpointing:
        raise ConfigError(
            "gradient-checkpointing: refused with dp=example (Opacus' per-example gradients "
            "record each block's input once per forward; checkpointing runs it twice)"
        )
    if config.precision != "fp32" or config.quantization != "none":
        key = "precision" if config.precision != "fp32" else "quantization"
        raise ConfigError(
            f"{key}: dp=example trains in float32 only (precision=fp32, quantization=none)"
        )
    target, limit = config.dp_sgd_target_epsilon, config.dp_max_epsilon
    if target > 0 and limit > 0 and limit < target:
        raise ConfigError(
            f"dp-max-epsilon: {limit} is below dp-sgd-target-epsilon {target}; a client "
            "calibrated to the target would refuse the run's last rounds"
        )


def _check_unnoised_metrics(config: RunConfig) -> None:
    """``dp-unnoised-metrics=withhold`` keeps the clients' unnoised metrics on the nodes
    (flower_app/client/round.py): it means something only with DP on, and client
    evaluation, which sends each node's scores on its own data, would undo it."""
    if config.dp_unnoised_metrics != "withhold":
        return
    if config.dp == "off":
        raise ConfigError(
            "dp-unnoised-metrics: 'withhold' keeps metrics outside a DP guarantee on the "
            "nodes, and dp='off' gives none; set dp=central or dp=example, or "
            "dp-unnoised-metrics=send"
        )
    method = get_method(config.method)
    if method.evaluates_on_clients(config):
        why = "client-eval=on" if config.client_eval == "on" else (
            f"method={config.method!r} has personal parts, so client-eval=auto evaluates on "
            "the clients"
        )  # fmt: skip
        raise ConfigError(
            f"client-eval: dp-unnoised-metrics=withhold refuses client evaluation ({why}), "
            "which sends each node's unnoised scores on its own data; set client-eval=off"
        )


# The one validation pipeline of ``resolve_config``: the checks across settings, in order,
# each raising a ConfigError that names its key; a method adds its own through
# ``Method.check_settings``. (Each value's own check runs first, in ``coerce_setting``; the
# names a run refers to are checked once before launch, flower_app/launch_checks.py.)
CROSS_CHECKS = (
    _check_targets,
    _check_quantization_settings,
    _check_half_precision_writes,
    _check_lr_schedule,
    _check_example_dp,
    _check_unnoised_metrics,
    _check_method_settings,
)
