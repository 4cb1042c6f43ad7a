"""Run settings: one schema for pyproject's [tool.flwr.app.config], conf/ presets and overrides.

Precedence, lowest first: the defaults below (identical to pyproject.toml's
``[tool.flwr.app.config]``, a test checks it) < the YAML preset named by ``preset``
(``conf/<preset>.yaml``, read with omegaconf) < values set with ``--run-config``.
Through plain ``flwr run`` a key counts as set when its value differs from the
default; ``python -m florg_tools.launch --preset P --set key=value`` applies the
three layers explicitly.  Unknown keys and bad values raise ``ConfigError``
naming the key, before any model is built or any client trains.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flower_app.methods import get_method, method_names

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class ConfigError(ValueError):
    """A run setting that is unknown or has a bad value; the message names the key."""


def _positive(x: float) -> bool:
    return x > 0


def _non_negative(x: float) -> bool:
    return x >= 0


def _fraction(x: float) -> bool:
    return 0 < x <= 1


# Grid run ids look like "method=florg,seed=0,task=snli" (florg_tools/experiments/grid.py).
_FOLDER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+:@%~-]{0,254}")
FOLDER_NAME_HINT = (
    "a plain folder name: letters, digits and . _ = , + : @ % ~ -, starting with a letter "
    "or digit, at most 255 characters, no path separators or '..'"
)


def is_folder_name(x: str) -> bool:
    """A single, safe folder name (flower_app/paths.py confines where runs write)."""
    return bool(_FOLDER_NAME_RE.fullmatch(x)) and ".." not in x


def _folder_name_or_empty(x: str) -> bool:
    return x == "" or is_folder_name(x)


_folder_name_or_empty.hint = FOLDER_NAME_HINT  # type: ignore[attr-defined]


def _at_least_one(x: float) -> bool:
    return x >= 1


class _RegisteredMethod:
    """The ``method`` check: a name in the method registry (flower_app/methods/)."""

    __name__ = "registered_method"

    def __call__(self, x: str) -> bool:
        return x in method_names()

    @property
    def options(self) -> tuple[str, ...]:
        return method_names()


def _one_of(*options: str) -> Callable[[str], bool]:
    def check(x: str) -> bool:
        return x in options

    check.options = options  # type: ignore[attr-defined]
    return check


# key: (default, type, check, help).  Keys follow Flower's kebab-case convention.
SCHEMA: dict[str, tuple[Any, type, Callable[[Any], bool] | None, str]] = {
    "preset": ("", str, None, "name of a YAML preset in conf/ ('' = none)"),
    "method": ("florg", str, _RegisteredMethod(), "federated method (flower_app/methods/)"),
    "model": ("all-MiniLM-L6-v2", str, None, "Hub name, local folder or registered name"),
    "task": ("snli", str, None, "task name (GLUE, registered local task) or 'local'"),
    "data-path": ("", str, None, "local data file/folder for task 'local'"),
    "text-fields": ("", str, None, "comma-separated text columns for task 'local'"),
    "label-field": ("label", str, None, "label column for task 'local'"),
    "num-labels": (0, int, _non_negative, "label count for task 'local' (0 = infer)"),
    "target-modules": ("query,value", str, None, "comma-separated module names to adapt"),
    "head-modules": ("", str, None, "comma-separated task-head modules ('' = auto)"),
    "train-head": (True, bool, None, "train and FedAvg the task head"),
    "rank": (4, int, _positive, "adapter rank r"),
    "alpha": (16.0, float, _positive, "scaling numerator: s = alpha / r"),
    "seed": (0, int, _non_negative, "run seed (L, R, A init, partitioning, shuffling)"),
    "num-server-rounds": (5, int, _positive, "federated rounds"),
    "fraction-train": (1.0, float, _fraction, "fraction of nodes sampled per round"),
    "min-train-nodes": (2, int, _positive, "minimum nodes sampled per round"),
    "min-available-nodes": (2, int, _positive, "nodes to wait for before a round"),
    "client-eval": ("auto", str, _one_of("auto", "on", "off"), "clients evaluate each round"),
    "partitioner": ("iid", str, _one_of("dirichlet", "iid"), "how data is split"),
    "dirichlet-alpha": (0.5, float, _positive, "Dirichlet concentration rho"),
    "max-train-examples": (2000, int, _non_negative, "training pool size (0 = all)"),
    "max-eval-examples": (1000, int, _non_negative, "validation subset size (0 = all)"),
    "max-test-examples": (
        0,
        int,
        _non_negative,
        "held-out test subset scored by the server (0 = no test)",
    ),
    "test-every": (
        5,
        int,
        _non_negative,
        "test rounds: 0, every N-th and the last 3 (0 = last 3 only)",
    ),
    "local-epochs": (1, int, _positive, "local epochs per round"),
    "local-steps": (0, int, _non_negative, "local steps per round (0 = use local-epochs)"),
    "batch-size": (16, int, _positive, "local batch size"),
    "eval-batch-size": (64, int, _positive, "evaluation batch size"),
    "learning-rate": (1e-3, float, _positive, "AdamW learning rate"),
    "weight-decay": (0.0, float, _non_negative, "AdamW weight decay"),
    "max-seq-length": (128, int, _positive, "tokeniser max length"),
    "doc-stride": (64, int, _non_negative, "extractive QA: token overlap of context windows"),
    "aggregation-weights": ("uniform", str, _one_of("uniform", "num-examples"), "client weights"),
    "a-init-std": (0.02, float, _positive, "FLoRG: std of the initial A (A = 0 is excluded)"),
    "projection-init": (
        "semi-orthogonal",
        str,
        _one_of("semi-orthogonal", "kaiming", "svd"),
        "FLoRG: initialisation of L and R",
    ),
    "subtract-init": (False, bool, None, "FLoRG: subtract s L A1^T A1 R from W0"),
    # FLoRG, issue 12 / 11: L/R sharing, the server step's device and rank-mismatch policy
    "projection-sharing": (
        "shape",
        str,
        _one_of("shape", "module"),
        "FLoRG: one L, R per layer shape (from seed + shape) or per module (seed + name)",
    ),
    "server-device": ("auto", str, _one_of("auto", "cpu", "cuda"), "FLoRG server step device"),
    "rank-mismatch": (
        "procrustes",
        str,
        _one_of("procrustes", "truncate"),
        "FLoRG when r' > r: Procrustes over all r' rows, or top-r eigenpairs then Procrustes",
    ),
    "lora-init": ("default", str, _one_of("default", "federa-svd"), "LoRA baselines' init"),
    "fedex-residual": ("dense", str, _one_of("dense", "factored"), "FedEx residual transport"),
    "device": ("auto", str, _one_of("auto", "cpu", "cuda"), "torch device for training"),
    "progress-bar": (False, bool, None, "show a progress bar during local training"),
    "output-dir": ("outputs", str, None, "folder for run outputs"),
    "save-client-updates": (False, bool, None, "also save every round's client updates (.npz)"),
    "fault-partition": (-1, int, None, "testing: this partition id misbehaves (-1 = none)"),
    "fault-kind": (
        "raise",
        str,
        _one_of("raise", "nan", "shape", "scale", "claim"),
        "testing: how it misbehaves (scale: adapter x fault-scale; claim: fault-scale examples)",
    ),
    "run-name": ("", str, _folder_name_or_empty, "run folder name ('' = timestamp-method-task)"),
    # -- issue 15: screening, fault injection, resume (docs/faults.md) --
    "screen-updates": (True, bool, None, "reject outlier updates, clip claimed num-examples"),
    "screen-kappa": (10.0, float, _at_least_one, "screening: outlier above kappa x the median"),
    "fault-scale": (10.0, float, _positive, "testing: factor of 'scale', count of 'claim'"),
    "fault-server-round": (0, int, _non_negative, "testing: ServerApp dies after round N"),
    "resume": ("", str, None, "run folder to continue from its last checkpointed round"),
    # -- issue 14: console and metric tracking (flower_app/console.py, tracking.py) --
    "log-level": ("info", str, _one_of("info", "debug"), "debug: Flower's full records too"),
    "tensorboard": ("auto", str, _one_of("auto", "on", "off"), "<run>/tensorboard/ events"),
}


def to_attr(key: str) -> str:
    return key.replace("-", "_")


@dataclass(frozen=True)
class RunConfig:
    """Validated run settings (attribute names are the keys with '-' -> '_')."""

    preset: str
    method: str
    model: str
    task: str
    data_path: str
    text_fields: str
    label_field: str
    num_labels: int
    target_modules: str
    head_modules: str
    train_head: bool
    rank: int
    alpha: float
    seed: int
    num_server_rounds: int
    fraction_train: float
    min_train_nodes: int
    min_available_nodes: int
    client_eval: str
    partitioner: str
    dirichlet_alpha: float
    max_train_examples: int
    max_eval_examples: int
    max_test_examples: int
    test_every: int
    local_epochs: int
    local_steps: int
    batch_size: int
    eval_batch_size: int
    learning_rate: float
    weight_decay: float
    max_seq_length: int
    doc_stride: int
    aggregation_weights: str
    a_init_std: float
    projection_init: str
    subtract_init: bool
    projection_sharing: str
    server_device: str
    rank_mismatch: str
    lora_init: str
    fedex_residual: str
    device: str
    progress_bar: bool
    output_dir: str
    save_client_updates: bool
    fault_partition: int
    fault_kind: str
    run_name: str
    screen_updates: bool
    screen_kappa: float
    fault_scale: float
    fault_server_round: int
    resume: str
    log_level: str
    tensorboard: str

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.target_modules.split(",") if t.strip())

    @property
    def heads(self) -> tuple[str, ...] | None:
        names = tuple(h.strip() for h in self.head_modules.split(",") if h.strip())
        return names or None

    @property
    def clients_evaluate(self) -> bool:
        """A method with personal parts (FedSA-LoRA's B) is evaluated on the clients."""
        return self.client_eval == "on" or (
            self.client_eval == "auto" and get_method(self.method).personal
        )

    def tests_round(self, server_round: int) -> bool:
        """Whether the server scores the held-out test split after ``server_round``:
        round 0, every ``test-every``-th round and the last three (the reported ones)."""
        if self.max_test_examples <= 0:
            return False
        last = self.num_server_rounds
        every = self.test_every > 0 and server_round % self.test_every == 0
        return server_round == 0 or every or server_round > last - 3

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, to_attr(key)) for key in SCHEMA}


DEFAULTS: dict[str, Any] = {key: spec[0] for key, spec in SCHEMA.items()}


def _coerce(key: str, value: Any) -> Any:
    _, kind, check, _ = SCHEMA[key]
    try:
        if kind is bool:
            if isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            if not isinstance(value, bool):
                raise TypeError
        elif kind is int:
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise TypeError
            value = int(float(value))
        elif kind is float:
            if isinstance(value, bool):
                raise TypeError
            value = float(value)
        else:
            value = str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    if check is not None and not check(value):
        options = getattr(check, "options", None)
        hint = f"one of {', '.join(options)}" if options else check.__name__.strip("_")
        hint = getattr(check, "hint", hint)
        raise ConfigError(f"{key}: bad value {value!r} (must be {hint})")
    return value


def check_keys(values: Mapping[str, Any], origin: str) -> None:
    unknown = sorted(set(values) - set(SCHEMA))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {unknown} in {origin}; known settings: {', '.join(SCHEMA)}"
        )


def load_preset(name: str) -> dict[str, Any]:
    """The settings of ``conf/<name>.yaml`` (or a YAML path), read with omegaconf."""
    from omegaconf import OmegaConf

    path = Path(name) if name.endswith((".yaml", ".yml")) else CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
        raise ConfigError(f"preset: {path} not found; presets in conf/: {known}")
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(values, dict):
        raise ConfigError(f"preset: {path} must hold a mapping of settings")
    check_keys(values, str(path))
    return values


def resolve_config(
    run_config: Mapping[str, Any], explicit: Mapping[str, Any] | None = None
) -> RunConfig:
    """Validate and layer the settings: defaults < preset < explicit overrides.

    ``run_config`` is what Flower hands the apps (all keys, defaults filled in); a key
    of it counts as explicitly set when it differs from the default.  ``explicit``
    adds overrides that always win (the launcher's ``--set``).
    """
    check_keys(run_config, "the run config")
    explicit = dict(explicit or {})
    check_keys(explicit, "the overrides")
    values = dict(DEFAULTS)
    set_by_user = {k: v for k, v in run_config.items() if _coerce(k, v) != DEFAULTS[k]}
    set_by_user.update(explicit)
    preset = str(set_by_user.get("preset", "") or "")
    if preset:
        values.update(load_preset(preset))
    values.update(set_by_user)
    resolved = {to_attr(k): _coerce(k, v) for k, v in values.items()}
    config = RunConfig(**resolved)
    if not config.targets:
        raise ConfigError("target-modules: name at least one module")
    return config
