"""Settings: the federation's rounds, local training, precision, evaluation and screening
(privacy: privacy.py)."""

from __future__ import annotations

from dataclasses import dataclass

from flower_app.settings import MODEL, setting
from flower_app.settings.checks import (
    PRECISIONS,
    QUANTIZATIONS,
    at_least_one,
    at_least_one_finite,
    fraction,
    non_negative,
    non_negative_finite,
    one_of,
    partition_list,
    positive,
    positive_finite,
)

OVERSELECT_FRACTION = 0.3  # overselect-fraction's default (another needs sync-overselect)


@dataclass(frozen=True)
class FederationSettings:
    """Settings: the federation: rounds, sampling and weighting."""

    num_server_rounds: int = setting(5, "federated rounds", check=positive, affects=())
    fraction_train: float = setting(
        1.0,
        "fraction of nodes sampled per round (client-sampling=poisson: each node's probability q)",
        check=fraction,
        affects=(),
    )
    client_sampling: str = setting(
        "fixed",
        "'fixed': max(fraction-train x N, min-train-nodes) nodes without replacement (Flower's "
        "FedAvg; dp=central accounts q = 1); 'poisson': each node independently with "
        "probability q = fraction-train (dp=central: amplification at q, the noised sum "
        "divided by q N)",
        check=one_of("fixed", "poisson"),
        affects=(),
    )
    min_train_nodes: int = setting(2, "minimum nodes sampled per round", check=positive, affects=())
    min_available_nodes: int = setting(
        2, "nodes to wait for before a round", check=positive, affects=()
    )
    aggregation_weights: str = setting(
        "uniform",
        "client weights: 'uniform', or 'num-examples' (each client's reported example count, "
        "the dataset-size weighting some methods' authors use: docs/architecture.md)",
        check=one_of("uniform", "num-examples"),
        affects=(),
    )
    uplink_encoding: str = setting(
        "fp32",
        "how the arrays of the clients' training replies travel: 'fp32' (as always), 'bf16', "
        "'fp16', 'int8' (per-row absmax scale, unbiased stochastic rounding from the "
        "round's seed), or 'int8-g' / 'int4-g' (the same rounding with a scale per 128 "
        "entries along each array's long axis, the message's arrays packed in one buffer); "
        "the server decodes them before anything reads them (flower_app/wire/encoding.py)",
        check=one_of("fp32", "bf16", "fp16", "int8", "int8-g", "int4-g"),
        affects=(),
    )
    uplink_error_feedback: bool = setting(
        False,
        "error feedback for a lossy uplink-encoding: each client adds to its update what the "
        "encoding left out of its earlier replies and keeps what it leaves out now (in the "
        "node's state and, with $FLORG_NODE_STATE_DIR, on its disk: "
        "flower_app/client/error_feedback.py), so the sum of the updates the server decodes "
        "is off by one rounding, not one a round; refused with uplink-encoding=fp32",
        affects=(),
    )
    downlink_encoding: str = setting(
        "fp32",
        "how the arrays of the server's training messages travel (as uplink-encoding; one "
        "rounding for every node, so every node decodes the same model); what a method sends "
        "besides them (its folds into W0, its fixed bases) travels fp32",
        check=one_of("fp32", "bf16", "fp16", "int8", "int8-g", "int4-g"),
        affects=(),
    )


@dataclass(frozen=True)
class AsyncRoundSettings:
    """Settings: buffered asynchronous rounds (``round-mode=async``, FedBuff's scheme;
    strategies/server/buffered_rounds.py), their synchronous rival with over-selection
    (``sync-overselect``: overselected_rounds.py there) and a simulation's stragglers."""

    round_mode: str = setting(
        "sync",
        "'sync': every round waits for its sampled clients (Flower's loop); 'async': the "
        "server keeps async-concurrency clients training and applies one update per "
        "async-buffer-size replies, each weighted by its staleness (docs/async.md); a run "
        "is num-server-rounds updates; 'sync-overselect': each round sends the model to "
        "ceil(K (1 + overselect-fraction)) nodes, K the sample size, and closes at the first K "
        "replies or at round-deadline, discarding the later ones",
        check=one_of("sync", "async", "sync-overselect"),
        affects=(),
    )
    overselect_fraction: float = setting(
        OVERSELECT_FRACTION,
        "round-mode=sync-overselect: f, a round sends the model to ceil(K (1 + f)) nodes (K "
        "= max(fraction-train x N, min-train-nodes), both at most the N connected nodes) and "
        "keeps the first K replies (0 = no over-selection)",
        check=non_negative_finite,
        affects=(),
    )
    round_deadline: float = setting(
        0.0,
        "round-mode=sync-overselect: seconds after its tasks are sent when a round closes "
        "with the replies it has, fewer than K included (0 = no deadline: it closes at K "
        "replies, or when none of its tasks is left in flight)",
        check=non_negative_finite,
        affects=(),
    )
    async_concurrency: int = setting(
        0,
        "round-mode=async: clients training at any time (0 = the synchronous sample size, "
        "max(fraction-train x N, min-train-nodes))",
        check=non_negative,
        affects=(),
    )
    async_buffer_size: int = setting(
        0,
        "round-mode=async: replies per server update (0 = async-concurrency: with every "
        "reply fresh, an update is the synchronous round's)",
        check=non_negative,
        affects=(),
    )
    async_staleness_exponent: float = setting(
        0.5,
        "round-mode=async: a reply trained from a model tau updates old moves the model by "
        "(1 + tau)^-a of its delta (a = this; 0 = no discount)",
        check=non_negative_finite,
        affects=(),
    )
    async_server_lr: float = setting(
        1.0,
        "round-mode=async: FedBuff's server learning rate eta_g: an update moves the model "
        "by eta_g times the weighted mean of the buffer's staleness-scaled deltas (1 = that "
        "mean; another rate steps eta_g of the way to a buffer of fresh replies' mean too)",
        check=positive_finite,
        affects=(),
    )
    async_max_staleness: int = setting(
        8,
        "round-mode=async: the server keeps this many past models; a reply staler than "
        "that is refused (logged and counted)",
        check=positive,
        affects=(),
    )
    slow_partitions: str = setting(
        "",
        "stragglers in a simulation: these partition ids train slowdown times slower and "
        "wait slow-delay seconds more (a SuperNode's node-config slowdown=X and "
        "delay-seconds=X set its own)",
        check=partition_list,
        affects=(),
    )
    slowdown: float = setting(
        1.0,
        "how many times its training time a client of slow-partitions takes (it waits "
        "(slowdown - 1) x the time it trained before replying)",
        check=at_least_one_finite,
        affects=(),
    )
    slow_delay: float = setting(
        0.0,
        "seconds a client of slow-partitions also waits before each reply, a fixed time "
        "whatever the machine's load (a SuperNode's node-config delay-seconds=X sets its "
        "own; under virtual-clock the clock adds it to the task's time instead)",
        check=non_negative_finite,
        affects=(),
    )


@dataclass(frozen=True)
class VirtualClockSettings:
    """Settings: a deterministic virtual clock for the nodes' speed and bandwidth
    (strategies/server/virtual_clock.py; docs/async.md, "The virtual clock")."""

    virtual_clock: bool = setting(
        False,
        "replies are taken in the order of a modelled (virtual) finish time, each task "
        "costing 2 x latency + the bytes sent and returned / bandwidth + its examples x "
        "seconds-per-example, so a run's rows do not depend on the machine's speed; rows "
        "gain virtual-seconds and virtual-round-seconds, and stragglers do not sleep",
        affects=(),
    )
    node_seconds_per_example: float = setting(
        0.05,
        "virtual-clock: a reference node's compute seconds per training example (a "
        "SuperNode's node-config seconds-per-example sets its own)",
        check=positive_finite,
        affects=(),
    )
    node_bandwidth_mbps: float = setting(
        20.0,
        "virtual-clock: each node's bandwidth in megabits per second, both directions "
        "(node-config bandwidth-mbps sets a node's own)",
        check=positive_finite,
        affects=(),
    )
    node_latency: float = setting(
        0.05,
        "virtual-clock: seconds each message takes each way before its bytes (node-config "
        "latency sets a node's own)",
        check=non_negative_finite,
        affects=(),
    )
    node_speeds: str = setting(
        "fixed",
        "virtual-clock: each node's compute multiplier: 'fixed' (slowdown for a partition "
        "of slow-partitions, else 1) or 'lognormal' (exp(node-speed-sigma x z), z ~ N(0, 1) "
        "drawn from the run's seed and the partition id); a node-config slowdown overrides "
        "either",
        check=one_of("fixed", "lognormal"),
        affects=(),
    )
    node_speed_sigma: float = setting(
        0.5,
        "virtual-clock, node-speeds=lognormal: sigma of the log of the compute multipliers",
        check=non_negative_finite,
        affects=(),
    )


@dataclass(frozen=True)
class TrainingSettings:
    """Settings: local training on each client."""

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


@dataclass(frozen=True)
class PrecisionSettings:
    """Settings: memory and speed for large models (flower_app/training/precision.py)."""

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
        "of precision; 4bit-fp4: bitsandbytes' default 4-bit, as the FlowerTune templates; "
        "8bit: LLM.int8); needs CUDA and bitsandbytes",
        check=one_of(*QUANTIZATIONS),
        affects=(MODEL,),
    )


@dataclass(frozen=True)
class EvaluationSettings:
    """Settings: evaluation: when the server and the clients score."""

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


@dataclass(frozen=True)
class ScreeningSettings:
    """Settings: robustness: update screening (docs/faults.md)."""

    screen_updates: bool = setting(
        True, "reject outlier updates, clip claimed num-examples", affects=()
    )
    screen_kappa: float = setting(
        10.0,
        "screening: outlier above kappa x the median",
        check=at_least_one,
        affects=(),
    )
