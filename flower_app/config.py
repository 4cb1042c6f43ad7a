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
(strategies/): the values ``method`` may take are the registered names (the
registry's check ``RegisteredMethod``), and ``resolve_config`` is the one validation every
caller runs (the apps, the launcher, the grids, the benchmarks), so it has to know them.
The registry never imports this module, not even for annotations: a method is handed a
``RunConfig`` and reads the settings it needs by name, and what a method derives from the
settings lives with the method (``Method.evaluates_on_clients``, ``Method.lora_init``,
``Method.build_strategy``). The other way round, with the check outside ``resolve_config``,
a run with a misspelt method would pass every caller that only resolves settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

from flower_app.config_checks import FOLDER_NAME_HINT as FOLDER_NAME_HINT  # re-exported
from flower_app.config_checks import (
    PRECISIONS,
    QUANTIZATIONS,
    ConfigError,
    at_least_one,
    coerce,
    empty,
    folder_name_or_empty,
    fraction,
    non_negative,
    one_of,
    open_unit_interval,
    positive,
    rank_list,
)
from flower_app.config_checks import is_folder_name as is_folder_name  # re-exported
from strategies.registry import RegisteredMethod, get_method

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # presets and grids (the tooling's)


# Groups of settings a derived artefact depends on; every setting names the groups it
# affects (``affects=``, required, so a new setting cannot be forgotten by the caches in
# flower_app/disk_cache.py: their keys hash every setting of their groups).
DATA = "data"  # which examples there are and which of them each client gets
TOKENISATION = "tokenisation"  # how examples become model inputs (the tokeniser, lengths)
MODEL = "model"  # the adapted model before any training (base model, adapter, init)
GROUPS = (DATA, TOKENISATION, MODEL)


def setting(
    default: Any,
    help: str,  # noqa: A002 - the word the generated pyproject comments use
    *,
    affects: tuple[str, ...],
    check: Callable[[Any], bool] | None = None,
) -> Any:
    """One run setting: a ``RunConfig`` field carrying its default, its help, the check of
    its values and the groups (``DATA``, ``TOKENISATION``, ``MODEL``) it ``affects``
    (``()``: it changes how a run is carried out, not what is built before training)."""
    unknown = set(affects) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown setting group(s) {sorted(unknown)}; groups: {GROUPS}")
    metadata = {"help": help, "check": check, "affects": frozenset(affects)}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class RunConfig:
    """Validated run settings; the one declaration of every setting.

    A field ``data_path`` is the key ``data-path`` (Flower's kebab-case convention);
    ``SCHEMA``, ``DEFAULTS``, pyproject's ``[tool.flwr.app.config]`` (generated:
    ``python -m florg_tools.settings --write``) and the cache keys derive from these."""

    # -- what runs: the method, the model and the task --
    preset: str = setting(
        "",
        "must be '': a preset is the file conf/NAME.toml, --run-config conf/NAME.toml",
        check=empty,
        affects=(),
    )
    method: str = setting(
        "florg",
        "federated method (strategies/)",
        check=RegisteredMethod(),
        affects=(MODEL,),
    )
    model: str = setting(
        "all-MiniLM-L6-v2",
        "Hub name, local folder or registered name",
        affects=(MODEL, TOKENISATION),
    )
    task: str = setting(
        "snli", "task name (GLUE, registered local task) or 'local'", affects=(DATA,)
    )
    task_kind: str = setting(
        "",
        "task kind (flower_app/task_kinds/: classification, extractive-qa, causal-lm); "
        "'' = the task's own (local data: classification)",
        affects=(DATA,),
    )
    seed: int = setting(
        0,
        "run seed (L, R, A init, partitioning, shuffling)",
        check=non_negative,
        affects=(MODEL, DATA),
    )
    # -- local data (task 'local') --
    data_path: str = setting("", "local data file/folder for task 'local'", affects=(DATA,))
    text_fields: str = setting("", "comma-separated text columns for task 'local'", affects=(DATA,))
    label_field: str = setting("label", "label column for task 'local'", affects=(DATA,))
    num_labels: int = setting(
        0,
        "label count for task 'local' (0 = infer)",
        check=non_negative,
        affects=(DATA,),
    )
    # -- the data each client gets, and the evaluation splits --
    partitioner: str = setting(
        "iid", "how data is split", check=one_of("dirichlet", "iid"), affects=(DATA,)
    )
    dirichlet_alpha: float = setting(
        0.5, "Dirichlet concentration rho", check=positive, affects=(DATA,)
    )
    max_train_examples: int = setting(
        2000, "training pool size (0 = all)", check=non_negative, affects=(DATA,)
    )
    max_eval_examples: int = setting(
        1000, "validation subset size (0 = all)", check=non_negative, affects=(DATA,)
    )
    max_test_examples: int = setting(
        0,
        "held-out test subset scored by the server (0 = no test)",
        check=non_negative,
        affects=(DATA,),
    )
    max_seq_length: int = setting(
        128, "tokeniser max length", check=positive, affects=(TOKENISATION,)
    )
    prompt_template: str = setting(
        "plain",
        "causal-lm: the prompt's layout, 'plain' text or the tokenizer's 'chat' template",
        check=one_of("plain", "chat"),
        affects=(TOKENISATION,),
    )
    max_new_tokens: int = setting(
        32,
        "causal-lm: greedy generation's length limit when scoring gen-exact-match / gen-f1",
        check=positive,
        affects=(),
    )
    doc_stride: int = setting(
        64,
        "extractive QA: token overlap of context windows",
        check=non_negative,
        affects=(TOKENISATION,),
    )
    # -- the adapter (flower_app/adapters/); clients' ranks (flower_app/rank_settings.py) --
    target_modules: str = setting(
        "query,value", "comma-separated module names to adapt", affects=(MODEL,)
    )
    head_modules: str = setting(
        "", "comma-separated task-head modules ('' = auto)", affects=(MODEL,)
    )
    train_head: bool = setting(True, "train and FedAvg the task head", affects=(MODEL,))
    rank: int = setting(4, "adapter rank r", check=positive, affects=(MODEL,))
    alpha: float = setting(
        16.0, "scaling numerator: s = alpha / r", check=positive, affects=(MODEL,)
    )
    client_ranks: str = setting(
        "",
        "per-client adapter ranks, a comma list cycled over partition ids ('' = every "
        "client uses rank; a SuperNode's node-config rank=R wins); s = alpha / rank for all",
        check=rank_list,
        affects=(),
    )
    a_init_std: float = setting(
        0.02,
        "FLoRG: std of the initial A (A = 0 is excluded)",
        check=positive,
        affects=(MODEL,),
    )
    projection_init: str = setting(
        "semi-orthogonal",
        "FLoRG: initialisation of L and R",
        check=one_of("semi-orthogonal", "kaiming", "svd"),
        affects=(MODEL,),
    )
    subtract_init: bool = setting(False, "FLoRG: subtract s L A1^T A1 R from W0", affects=(MODEL,))
    projection_sharing: str = setting(
        "shape",
        "FLoRG: one L, R per layer shape (from seed + shape) or per module (seed + name)",
        check=one_of("shape", "module"),
        affects=(MODEL,),
    )
    lora_init: str = setting(
        "default",
        "LoRA baselines' init",
        check=one_of("default", "federa-svd"),
        affects=(MODEL,),
    )
    # -- the federation: rounds, sampling, weighting and the methods' server options --
    num_server_rounds: int = setting(5, "federated rounds", check=positive, affects=())
    fraction_train: float = setting(
        1.0, "fraction of nodes sampled per round", check=fraction, affects=()
    )
    min_train_nodes: int = setting(2, "minimum nodes sampled per round", check=positive, affects=())
    min_available_nodes: int = setting(
        2, "nodes to wait for before a round", check=positive, affects=()
    )
    aggregation_weights: str = setting(
        "uniform",
        "client weights",
        check=one_of("uniform", "num-examples"),
        affects=(),
    )
    server_device: str = setting(
        "auto",
        "FLoRG server step device",
        check=one_of("auto", "cpu", "cuda"),
        affects=(),
    )
    rank_mismatch: str = setting(
        "procrustes",
        "FLoRG when r' > r: Procrustes over all r' rows, or top-r eigenpairs then Procrustes",
        check=one_of("procrustes", "truncate"),
        affects=(),
    )
    fedex_residual: str = setting(
        "dense",
        "FedEx residual transport",
        check=one_of("dense", "factored"),
        affects=(MODEL,),
    )
    # -- local training on each client --
    local_epochs: int = setting(1, "local epochs per round", check=positive, affects=())
    local_steps: int = setting(
        0,
        "local steps per round (0 = use local-epochs)",
        check=non_negative,
        affects=(),
    )
    batch_size: int = setting(16, "local batch size", check=positive, affects=())
    learning_rate: float = setting(
        1e-3, "AdamW learning rate of the adapter", check=positive, affects=()
    )
    head_learning_rate: float = setting(
        0.0,
        "AdamW learning rate of the task head and any other trained non-adapter "
        "parameter (0 = learning-rate)",
        check=non_negative,
        affects=(),
    )
    lr_schedule: str = setting(
        "constant",
        "per-round learning rate: 'constant', or 'cosine' from learning-rate in round 1 "
        "to min-learning-rate in the last (FlowerTune's; the head's rate scales alike)",
        check=one_of("constant", "cosine"),
        affects=(),
    )
    min_learning_rate: float = setting(
        0.0,
        "lr-schedule=cosine: the rate of the last round (<= learning-rate)",
        check=non_negative,
        affects=(),
    )
    weight_decay: float = setting(0.0, "AdamW weight decay", check=non_negative, affects=())
    device: str = setting(
        "auto",
        "torch device for training",
        check=one_of("auto", "cpu", "cuda"),
        affects=(),
    )
    # -- memory and speed for large models (flower_app/precision.py) --
    precision: str = setting(
        "fp32",
        "dtype of the frozen base weights and of the forward pass (autocast); the trained "
        "adapter and head stay float32, fp16 steps use a GradScaler",
        check=one_of(*PRECISIONS),
        affects=(MODEL,),
    )
    gradient_checkpointing: bool = setting(
        False,
        "recompute activations in the backward pass (non-reentrant) to save memory",
        affects=(MODEL,),
    )
    quantization: str = setting(
        "none",
        "load the frozen base through bitsandbytes (4bit: NF4, double quant, compute dtype "
        "of precision; 8bit: LLM.int8); needs CUDA and bitsandbytes",
        check=one_of(*QUANTIZATIONS),
        affects=(MODEL,),
    )
    # -- evaluation: when the server and the clients score --
    client_eval: str = setting(
        "auto",
        "clients evaluate each round",
        check=one_of("auto", "on", "off"),
        affects=(),
    )
    eval_every: int = setting(
        1,
        "validation rounds: 0, every N-th and the last 3 (0 = last 3 only)",
        check=non_negative,
        affects=(),
    )
    test_every: int = setting(
        5,
        "test rounds: 0, every N-th and the last 3 (0 = last 3 only)",
        check=non_negative,
        affects=(),
    )
    eval_batch_size: int = setting(64, "evaluation batch size", check=positive, affects=())
    # -- robustness: update screening (docs/faults.md) --
    screen_updates: bool = setting(
        True, "reject outlier updates, clip claimed num-examples", affects=()
    )
    screen_kappa: float = setting(
        10.0,
        "screening: outlier above kappa x the median",
        check=at_least_one,
        affects=(),
    )
    # -- privacy: central differential privacy (docs/privacy.md) --
    dp: str = setting(
        "off",
        "differential privacy: 'central' = the server clips each client's update and noises "
        "the aggregate, user-level (epsilon, delta) in metrics.jsonl's dp-epsilon",
        check=one_of("off", "central"),
        affects=(),
    )
    dp_clipping_norm: float = setting(
        1.0,
        "dp=central: L2 bound C on each client's update per round (adapter and head jointly)",
        check=positive,
        affects=(),
    )
    dp_noise_multiplier: float = setting(
        1.0,
        "dp=central: noise multiplier z (Gaussian noise std z x the sensitivity, on the sum)",
        check=positive,
        affects=(),
    )
    dp_delta: float = setting(
        1e-5,
        "dp=central: the delta epsilon is reported at; set it well below 1 / the number of clients",
        check=open_unit_interval,
        affects=(),
    )
    # -- the run folder, resuming, the console and tracking --
    output_dir: str = setting("outputs", "folder for run outputs", affects=())
    run_name: str = setting(
        "",
        "run folder name ('' = timestamp-method-task)",
        check=folder_name_or_empty,
        affects=(),
    )
    resume: str = setting("", "run folder to continue from its last checkpointed round", affects=())
    save_client_updates: bool = setting(
        False, "also save every round's client updates (.npz)", affects=()
    )
    progress_bar: bool = setting(False, "show a progress bar during local training", affects=())
    log_level: str = setting(
        "info",
        "debug: Flower's full records too",
        check=one_of("info", "debug"),
        affects=(),
    )
    tensorboard: str = setting(
        "auto", "<run>/tensorboard/ events", check=one_of("auto", "on", "off"), affects=()
    )
    # -- testing only, never in a real run: fault injection (flower_app/client/faults.py) --
    fault_partition: int = setting(
        -1, "testing: this partition id misbehaves (-1 = none)", affects=()
    )
    fault_kind: str = setting(
        "raise",
        "testing: how it misbehaves (scale: adapter x fault-scale; claim: fault-scale examples)",
        check=one_of("raise", "nan", "shape", "scale", "claim"),
        affects=(),
    )
    fault_scale: float = setting(
        10.0,
        "testing: factor of 'scale', count of 'claim'",
        check=positive,
        affects=(),
    )
    fault_server_round: int = setting(
        0, "testing: ServerApp dies after round N", check=non_negative, affects=()
    )

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
    if not config.targets:
        raise ConfigError("target-modules: name at least one module")
    _check_quantization_settings(config)
    _check_half_precision_writes(config)
    if config.lr_schedule == "cosine" and config.min_learning_rate > config.learning_rate:
        raise ConfigError(
            f"min-learning-rate: {config.min_learning_rate} is above learning-rate "
            f"{config.learning_rate}; cosine decays from learning-rate to min-learning-rate"
        )
    try:  # the checks that depend on the method (dp=central's among them)
        get_method(config.method).check_settings(config)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return config


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
