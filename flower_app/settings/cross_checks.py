"""The checks across run settings that ``resolve_config`` (flower_app/settings/config.py) runs after
each value's own check, in order (``CROSS_CHECKS``): each raises a ``ConfigError`` naming
its key, before any model is built or any client trains; a method adds its own through
``Method.check_settings``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flower_app.methods.registry import get_method, method_names
from flower_app.settings.checks import ConfigError
from flower_app.settings.rounds import OVERSELECT_FRACTION, VirtualClockSettings

if TYPE_CHECKING:
    from flower_app.settings.config import RunConfig


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
    ``flower_app.training.precision.check_quantization_supported``): it needs a GPU, and a 4-bit /
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
    """``dp=example`` (DP-SGD with Opacus, flower_app/privacy/dp_sgd.py): Opacus' hooks record each
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


def _check_encodings(config: RunConfig) -> None:
    """A method that folds into W0 (``Method.writes_base_weights``) computes the fold from
    the global arrays it keeps exact: nodes that received them rounded would hold a model
    the fold no longer completes, so its downlink stays fp32 (its uplink may be encoded:
    the server folds what it decodes)."""
    if config.downlink_encoding == "fp32":
        return
    if get_method(config.method).writes_base_weights:
        raise ConfigError(
            f"downlink-encoding: {config.downlink_encoding!r} is refused for "
            f"method={config.method!r}, which folds into W0 what it computes from the global "
            "arrays it keeps exact; nodes that received them rounded would hold a model the "
            "fold does not complete, drifting from the server's: use downlink-encoding=fp32 "
            "(uplink-encoding may be lossy)"
        )


def _check_error_feedback(config: RunConfig) -> None:
    """``uplink-error-feedback`` feeds back what a lossy uplink encoding leaves out; fp32
    leaves nothing out."""
    if config.uplink_error_feedback and config.uplink_encoding == "fp32":
        raise ConfigError(
            "uplink-error-feedback: true needs a lossy uplink-encoding (bf16, fp16, int8, "
            "int8-g, int4-g); uplink-encoding=fp32 sends the update exactly and leaves "
            "nothing to feed back"
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


def _check_async_rounds(config: RunConfig) -> None:
    """``round-mode=async`` (strategies/server/buffered_rounds.py) runs a method whose rule
    takes a reply trained from an older model exactly (``Method.async_update``), with the
    settings its buffer keeps apart from: no central DP (its accountant counts releases of a
    uniform sample, and a buffer holds the clients that were fastest, not a sample), a
    fixed sample (no Poisson), clients of one rank, no client evaluation rounds, and a
    buffer no larger than the clients in flight. ``dp=example`` runs: a node trains at most
    once from each version, so at most num-server-rounds tasks, the rounds its DP-SGD noise
    is calibrated for."""
    if config.round_mode != "async":
        if config.async_concurrency or config.async_buffer_size:
            raise ConfigError(
                "async-concurrency / async-buffer-size: set only with round-mode=async"
            )
        if config.async_server_lr != 1.0:  # a synchronous round applies the mean as it is
            raise ConfigError(
                f"async-server-lr: {config.async_server_lr} is FedBuff's server rate and "
                "set only with round-mode=async (a synchronous round applies the clients' "
                "aggregate as it is)"
            )
        return
    method = get_method(config.method)
    if method.async_update is None:
        able = ", ".join(n for n in method_names() if get_method(n).async_update)
        why = method.async_refusal or (
            "its server rule is neither a mean of the replies' parts nor FLoRG's Gram "
            "average, so a reply trained from an older model has no exact place in its update"
        )
        raise ConfigError(
            f"round-mode: async is refused for method={config.method!r}: {why} (async runs {able})"
        )
    refusals = (
        (config.dp == "central", "dp",
         "dp=central is refused with round-mode=async: its accountant counts releases of a "
         "uniform sample of clients, and an asynchronous buffer holds the clients that "
         "replied first"),
        (config.client_sampling != "fixed", "client-sampling",
         "client-sampling=poisson is a per-round sample; round-mode=async keeps "
         "async-concurrency clients busy instead: use client-sampling=fixed"),
        (bool(config.client_ranks.strip()), "client-ranks",
         "round-mode=async runs clients of one rank; set client-ranks=''"),
        (method.evaluates_on_clients(config), "client-eval",
         "round-mode=async has no client evaluation rounds; set client-eval=off (a method "
         "with personal parts evaluates on its clients and is refused)"),
    )  # fmt: skip
    for refused, key, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {why}")
    concurrency = config.async_concurrency
    if concurrency and config.async_buffer_size > concurrency:
        raise ConfigError(
            f"async-buffer-size: {config.async_buffer_size} replies per update cannot come "
            f"from async-concurrency={concurrency} clients in flight"
        )


def _check_overselected_rounds(config: RunConfig) -> None:
    """``round-mode=sync-overselect`` (strategies/server/overselected_rounds.py) keeps the
    first K replies of the ceil(K (1 + f)) it sends: the fastest clients, not a sample, so no
    central DP (its accountant counts releases of a uniform sample); a fixed sample size (K
    is one); no client evaluation rounds; no method that folds into W0 (what each node is
    sent is read from its replies in the strategy's own ``aggregate_train``, which the loop
    does not run). Its settings are refused in the other modes, as the async ones are in
    this one (``_check_async_rounds``)."""
    if config.round_mode != "sync-overselect":
        if config.overselect_fraction != OVERSELECT_FRACTION:
            raise ConfigError(
                "overselect-fraction: set only with round-mode=sync-overselect (another "
                "mode sends a round's tasks to its sample alone)"
            )
        if config.round_deadline:
            raise ConfigError(
                "round-deadline: set only with round-mode=sync-overselect (a synchronous "
                "round waits for its sample up to the run's timeout)"
            )
        return
    method = get_method(config.method)
    refusals = (
        (config.dp == "central", "dp",
         "dp=central is refused with round-mode=sync-overselect: its accountant counts "
         "releases of a uniform sample of clients, and an over-selected round keeps the "
         "clients that replied first"),
        (config.client_sampling != "fixed", "client-sampling",
         "client-sampling=poisson is a sample of random size; round-mode=sync-overselect "
         "over-selects a fixed sample size K: use client-sampling=fixed"),
        (method.evaluates_on_clients(config), "client-eval",
         "round-mode=sync-overselect has no client evaluation rounds; set client-eval=off (a "
         "method with personal parts evaluates on its clients and is refused)"),
        (method.writes_base_weights, "round-mode",
         f"sync-overselect is refused for method={config.method!r}: each node's folds into "
         "W0 are tracked from its replies in the method's own aggregate_train, which the "
         "over-selected loop does not run (it checks each reply as it arrives)"),
    )  # fmt: skip
    for refused, key, why in refusals:
        if refused:
            raise ConfigError(f"{key}: {why}")


def _check_stragglers(config: RunConfig) -> None:
    """``slow-delay`` applies to ``slow-partitions``: set without any, it would do nothing."""
    if config.slow_delay > 0 and not config.slow_partitions.strip():
        raise ConfigError(
            "slow-delay: set it with slow-partitions (the partitions that wait), or give a "
            "SuperNode its own node-config delay-seconds"
        )


def _check_virtual_clock(config: RunConfig) -> None:
    """``virtual-clock`` (strategies/server/virtual_clock.py) orders replies by a modelled
    finish time: its settings are refused without it, ``node-speed-sigma`` without
    ``node-speeds=lognormal`` and ``slow-partitions`` with it (the draw sets every node's
    speed). The loops' own refusals stand; a task lost by the run's timeout stays a
    wall-clock event, which no setting here can make deterministic."""
    defaults = VirtualClockSettings()
    if not config.virtual_clock:
        for key in ("node-seconds-per-example", "node-bandwidth-mbps", "node-latency",
                    "node-speeds", "node-speed-sigma"):  # fmt: skip
            attr = key.replace("-", "_")
            if getattr(config, attr) != getattr(defaults, attr):
                raise ConfigError(f"{key}: set only with virtual-clock=true (it models the nodes)")
        return
    if config.node_speeds != "lognormal" and config.node_speed_sigma != defaults.node_speed_sigma:
        raise ConfigError(
            "node-speed-sigma: set only with node-speeds=lognormal (node-speeds=fixed takes "
            "slowdown for slow-partitions and 1 for the others)"
        )
    if config.node_speeds == "lognormal" and config.slow_partitions.strip():
        raise ConfigError(
            "slow-partitions: node-speeds=lognormal draws every partition's compute "
            "multiplier; use node-speeds=fixed for named slow partitions"
        )


# What reads one client's reply, which the server never sees under secure aggregation:
# each is refused with the reason (the setting's key first).
_REFUSED = (
    (lambda c: c.round_mode != "sync", "round-mode: secure aggregation runs synchronous "
     "rounds; async and sync-overselect apply or keep single replies"),
    (lambda c: c.uplink_encoding != "fp32", "uplink-encoding: under secure aggregation the "
     "uplink is the masked integer vector; set uplink-encoding=fp32"),
    (lambda c: c.save_client_updates, "save-client-updates: under secure aggregation the "
     "server never holds a client's update"),
    (lambda c: bool(c.client_ranks.strip()), "client-ranks: secure aggregation sums "
     "contributions of one shape; clients of different ranks are not supported"),
    (lambda c: c.virtual_clock, "virtual-clock: it orders single replies, which secure "
     "aggregation does not have"),
    (lambda c: c.product_gap, "product-gap: it reads each client's factors, which secure "
     "aggregation never hands the server"),
)  # fmt: skip


# dp=central under secure aggregation: (Method.dp_mechanism, Method.secure_sum) pairs whose
# client clips the plain mechanism's unit and whose server noises the sum of those units
# (``secure_private_contribution``, ``aggregate_secure_private``).
_SECURE_MECHANISMS = {("mean", "mean"), ("gram", "gram"), ("product-mean", "product")}


def _check_secure_aggregation(config: RunConfig) -> None:
    """``secure-aggregation=secaggplus``: a method that declares its secure sum
    (``Method.secure_sum``, else its ``secure_refusal``), none of the settings that read
    single replies (``_REFUSED``), SecAgg+'s settings valid."""
    if config.secure_aggregation == "off":
        return
    from flower_app.secure.settings import secaggplus_settings

    method = get_method(config.method)
    if method.secure_sum is None:
        raise ConfigError(
            f"secure-aggregation: method {config.method!r} cannot run under secure "
            f"aggregation: {method.secure_refusal or 'it declares no secure sum'}"
        )
    for refused, reason in _REFUSED:
        if refused(config):
            raise ConfigError(reason)
    settings = secaggplus_settings(config)
    if config.dp != "central" or method.dp_mechanism is None:
        return  # a method without a mechanism: its own dp_refusal (_check_method_settings)
    if (method.dp_mechanism, method.secure_sum) not in _SECURE_MECHANISMS:
        raise ConfigError(
            f"dp: dp=central under secure aggregation is built for the mean, Gram and "
            f"product-mean mechanisms on their own sums; method {config.method!r} has "
            f"{method.dp_mechanism!r} on {method.secure_sum!r}"
        )
    # a clipped update (the mean methods' arrays, the product methods' B A updates with the
    # head) has every value within ±C; FLoRG's Gram entries are not bounded by C alone
    # (docs/privacy.md section 6): C above the range would refuse rounds, not clip them
    within_c = method.secure_sum in ("mean", "product")
    if within_c and config.dp_clipping_norm > settings.clipping_range:
        raise ConfigError(
            f"dp-clipping-norm: {config.dp_clipping_norm:g} is above secaggplus-clipping-range "
            f"{settings.clipping_range:g}; a clipped update's values must fit the range"
        )


def _check_product_gap(config: RunConfig) -> None:
    """``product-gap`` (strategies/server/product_gap.py) compares the replies' LoRA
    products B A with the rule's new B A (a method whose adapter is not LoRA records none:
    FLoRG's counterpart, gram_rel_error, is always recorded); under dp=central the replies
    are read by the mechanism alone (the gap, a function of the unnoised replies, would be
    released outside the guarantee)."""
    if not config.product_gap:
        return
    if config.dp == "central":
        raise ConfigError(
            "product-gap: refused with dp=central (it reads every client's unnoised B and A "
            "after the mechanism, outside the privacy guarantee): set product-gap=false"
        )


# The one validation pipeline of ``resolve_config``: the checks across settings, in order,
# each raising a ConfigError that names its key; a method adds its own through
# ``Method.check_settings``. (Each value's own check runs first, in ``coerce_setting``; the
# names a run refers to are checked once before launch, flower_app/preflight/references.py.)
CROSS_CHECKS = (
    _check_targets,
    _check_quantization_settings,
    _check_half_precision_writes,
    _check_lr_schedule,
    _check_example_dp,
    _check_unnoised_metrics,
    _check_encodings,
    _check_error_feedback,
    _check_async_rounds,
    _check_overselected_rounds,
    _check_stragglers,
    _check_virtual_clock,
    _check_secure_aggregation,
    _check_product_gap,
    _check_method_settings,
)
