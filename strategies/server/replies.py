"""The reply gate: what a client's reply must pass before it is aggregated (docs/faults.md).

1. Validation (``check_reply``): other records than 'arrays' and 'metrics', missing or extra
   keys, a dtype other than float32/float64, a mis-shaped array (at the rank the reply
   declares, ``RankRouter.expected_state``), an array whose serialised size exceeds its
   expected size (checked before it is deserialised), NaN/Inf, a ``num-examples`` /
   ``partition-id`` / ``train-loss`` that is not a finite number of the right kind:
   ``ReplyRejected`` with the reason, never aggregated.
2. Screening (``screen``; ``screen-updates``, on by default): an update farther from its
   start than kappa times the round's median distance is rejected, a claimed
   ``num-examples`` above kappa times the median claim clipped (off under dp=central).
``ReplyGate`` holds both for the common strategy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, Message

from flower_app.wire.encoding import DecodedArray
from flower_app.wire.records import split_state

if TYPE_CHECKING:
    from strategies.server.rank_router import RankRouter

log = logging.getLogger("flwr.florg")  # propagates to Flower's console handler

ACCEPTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
REPLY_RECORDS = frozenset({"arrays", "metrics"})
NPY_HEADER_SLACK = 4096  # bytes of .npy header allowed on top of the array's own data


class ReplyRejected(ValueError):
    """A client reply that must not be aggregated."""


@dataclass(frozen=True)
class Reply:
    """A checked client reply."""

    node: int
    partition: int
    arrays: dict[str, np.ndarray]
    num_examples: float
    train_loss: float
    rank: int = 0  # the adapter rank it trained at (0: not checked)
    # round-mode=async (buffered_rounds.py): the global state it trained from, and how
    # many updates were applied since (None, 0: the current state, as every sync reply)
    start: Mapping[str, np.ndarray] | None = None
    staleness: int = 0


def metric_number(metrics: Any, key: str, *, required: bool = True) -> float | None:
    """``metrics[key]`` as a finite float, None when absent and not ``required``;
    ReplyRejected when it is missing, a list, a bool, NaN or infinite."""
    if key not in metrics:
        if required:
            raise ReplyRejected(f"metric {key!r} is missing")
        return None
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyRejected(f"metric {key!r} must be a number, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise ReplyRejected(f"metric {key!r} must be finite, got {value}")
    return float(value)


def check_array(key: str, array: Array, expected: tuple[int, ...]) -> np.ndarray:
    """One reply array, deserialised only once its size is plausible; ReplyRejected
    unless it is a float32/float64 array of exactly the ``expected`` shape."""
    limit = int(np.prod(expected, dtype=np.int64)) * 8 + NPY_HEADER_SLACK
    # a decoded array is already in memory, made by the server's own decoder: no bytes to
    # bound (reading its ``data`` would serialise it)
    if not isinstance(array, DecodedArray) and len(array.data) > limit:
        raise ReplyRejected(
            f"{key}: {len(array.data)} bytes, more than the {limit} an array of shape "
            f"{expected} can take"
        )
    try:
        value = array.numpy()
    except Exception as err:  # wrong stype, not .npy, object dtype (no pickles)
        raise ReplyRejected(f"{key}: cannot be read as a numeric array ({err})") from None
    if value.dtype not in ACCEPTED_DTYPES:
        raise ReplyRejected(f"{key}: dtype {value.dtype} (only float32/float64 accepted)")
    if value.ndim != len(expected):
        raise ReplyRejected(f"{key}: {value.ndim}-d array, expected {len(expected)}-d")
    if value.shape != expected:
        raise ReplyRejected(f"{key}: shape {value.shape} != expected {expected}")
    if not np.all(np.isfinite(value)):
        raise ReplyRejected(f"{key}: contains NaN/Inf")
    return value


def declared_rank(metrics: Any, *, default: int, k: int, largest: int) -> int:
    """The adapter rank a reply's ``rank`` metric declares (``default`` when absent: a
    client that predates per-client ranks); ReplyRejected unless it is an integer
    1 <= r_n <= k (k = min(d_in, d_out) over the adapted layers) and r_n <= ``largest``
    (the run's largest rank, the global state's: docs/architecture.md)."""
    value = metric_number(metrics, "rank", required=False)
    if value is None:
        return default
    if value != int(value) or value < 1:
        raise ReplyRejected(f"rank must be an integer >= 1, got {value}")
    rank = int(value)
    if rank > k:
        raise ReplyRejected(f"declared rank {rank} exceeds k=min(d_in, d_out)={k}")
    if rank > largest:
        raise ReplyRejected(
            f"declared rank {rank} exceeds the run's largest rank {largest} "
            "(max of 'rank' and 'client-ranks')"
        )
    return rank


def check_reply(message: Message, global_state: Mapping[str, np.ndarray]) -> Reply:
    """The checked reply to a round that sent ``global_state`` (or, for a client of
    another rank, arrays of ``global_state``'s shapes at that rank), or ReplyRejected with
    the reason (never aggregated)."""
    content = message.content
    if "arrays" not in content.array_records or "metrics" not in content.metric_records:
        raise ReplyRejected("reply lacks the 'arrays' ArrayRecord or the 'metrics' record")
    extra = sorted(set(content.keys()) - REPLY_RECORDS)
    if extra:
        raise ReplyRejected(f"unexpected records {extra[:3]}")
    record = content["arrays"]
    missing = sorted(set(global_state) - set(record.keys()))
    unexpected = sorted(set(record.keys()) - set(global_state))
    if missing or unexpected:
        raise ReplyRejected(f"keys differ: missing {missing[:3]}, unexpected {unexpected[:3]}")
    metrics = content["metrics"]
    num_examples = metric_number(metrics, "num-examples")
    if not num_examples > 0:
        raise ReplyRejected(f"num-examples must be > 0, got {num_examples}")
    partition = metric_number(metrics, "partition-id", required=False)
    if partition is not None and (partition != int(partition) or partition < 0):
        raise ReplyRejected(f"partition-id must be an integer >= 0, got {partition}")
    train_loss = metric_number(metrics, "train-loss", required=False)
    arrays = {key: check_array(key, record[key], global_state[key].shape) for key in global_state}
    return Reply(
        node=int(message.metadata.src_node_id),
        partition=-1 if partition is None else int(partition),
        arrays=arrays,
        num_examples=float(num_examples),
        train_loss=math.nan if train_loss is None else train_loss,
    )


def train_time_metrics(replies: list[Message]) -> dict[str, float]:
    """``client-train-seconds``, the mean over the round's replies of the ``train-seconds``
    each reports (flower_app/client/round.py: its wall time in the local steps), with its
    sum and max: training proper, beside the round's wall time (benchmarks/scale). Only
    timed, never aggregated: a reply without a finite number there is left out."""
    seconds = []
    for msg in replies:
        if msg.has_error() or "metrics" not in msg.content.metric_records:
            continue
        value = msg.content["metrics"].get("train-seconds")
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            seconds.append(float(value))
    if not seconds:
        return {}
    return {
        "client-train-seconds": float(np.mean(seconds)),
        "client-train-seconds-sum": float(np.sum(seconds)),
        "client-train-seconds-max": float(np.max(seconds)),
    }


# -- screening -------------------------------------------------------------------------
# For each client n and each group of tensors it sends (the adapter: every layer's A, or
# lora_A / lora_B; the task head), d_n = ||x_n - x_prev||_F over the group, x_prev the state
# the round started from; a client is rejected when d_n > kappa * median(d) in any group
# (the lower median). FLoRG's server sums Q = sum_n w_n A_n^T A_n, quadratic in A_n (a
# client sending c * A weighs c^2 times its share), so it is screened on ||A_n - A_prev||,
# linear in the attack. Every round also reports update-norm-median / -max: ||x_n - x_start||
# over all the arrays a client sends, the unit dp=central clips to C (docs/privacy.md).

DEFAULT_KAPPA = 10.0  # docs/faults.md: honest spreads measured up to ~6x the median


def _low_median(values: np.ndarray) -> float:
    """The lower median: the median for an odd count, the smaller middle value otherwise
    (with two clients, the larger one is compared with the smaller)."""
    ordered = np.sort(np.asarray(values, np.float64))
    return float(ordered[(len(ordered) - 1) // 2])


def _distances(
    replies: Sequence[Reply],
    global_state: Mapping[str, np.ndarray],
    starts: Sequence[Mapping[str, np.ndarray]] | None,
    keys: Sequence[str],
) -> np.ndarray:
    """d_n = ||x_n - x_start||_F over ``keys`` (x_start: ``starts[n]`` where given, else
    ``global_state``)."""
    return np.array(
        [
            math.sqrt(
                sum(
                    float(np.sum((r.arrays[k] - (starts[i] if starts else global_state)[k]) ** 2))
                    for k in keys
                )
            )
            for i, r in enumerate(replies)
        ]
    )


def screen(
    server_round: int,
    replies: list[Reply],
    global_state: Mapping[str, np.ndarray],
    *,
    kappa: float,
    enabled: bool,
    starts: Sequence[Mapping[str, np.ndarray]] | None = None,
) -> tuple[list[Reply], list[float], dict]:
    """Outlier screening of ``replies`` to a round that started from ``global_state``
    (module doc); ``starts``: per reply the state that client started from, where
    clients of different rank were sent different states.  With ``enabled``
    false nothing is rejected or clipped, but the largest ratio, ``screen-ratio-max``, is
    still measured.  Returns the kept replies, their (clipped) example counts and the
    metrics."""
    metrics: dict[str, float] = {"screened": 0, "clipped": 0}
    sizes = [r.num_examples for r in replies]
    head = split_state(global_state)[1]
    adapter_keys = [k for k in global_state if k not in head]
    groups = {"adapter": adapter_keys, "head": list(head)}
    distances = {
        group: _distances(replies, global_state, starts, keys)
        for group, keys in groups.items()
        if keys
    }
    if replies:  # the groups cover every array sent: the joint norm is DP's clipped unit
        norms = np.sqrt(sum(d**2 for d in distances.values()))
        metrics["update-norm-median"] = float(np.median(norms))
        metrics["update-norm-max"] = float(np.max(norms))
    if len(replies) < 2:
        return replies, sizes, metrics
    reasons: dict[int, str] = {}
    worst = 0.0
    for group, d in distances.items():
        keys = groups[group]
        prev = global_state
        scale = math.sqrt(sum(float(np.sum(prev[k] ** 2)) for k in keys))
        median = max(_low_median(d), 1e-12 * (1.0 + scale))
        ratios = d / median
        worst = max(worst, float(ratios.max()))
        for i in np.flatnonzero(ratios > kappa):
            reasons.setdefault(
                int(i),
                f"{group} update distance {d[i]:.4g} = {ratios[i]:.1f} x the round's "
                f"median {median:.4g} (kappa {kappa:g})",
            )
    metrics["screen-ratio-max"] = worst  # measured also with screening off
    if not enabled:
        return replies, sizes, metrics
    kept: list[Reply] = []
    for i, r in enumerate(replies):
        if i in reasons:
            log.warning(
                "round %d: screened out update from partition %s (node %s): %s",
                server_round,
                r.partition,
                r.node,
                reasons[i],
            )
        else:
            kept.append(r)
    metrics["screened"] = len(reasons)
    claims = np.array([r.num_examples for r in kept])
    cap = kappa * _low_median(claims)
    for r in kept:
        if r.num_examples > cap:
            log.warning(
                "round %d: partition %s (node %s) claims %.6g examples, clipped to %.6g "
                "(kappa %g x the round's median claim)",
                server_round,
                r.partition,
                r.node,
                r.num_examples,
                cap,
                kappa,
            )
    metrics["clipped"] = int(np.sum(claims > cap))
    return kept, np.minimum(claims, cap).tolist(), metrics


# -- the gate the strategy holds ---------------------------------------------------------


class ReplyGate:
    """Validation and screening of one run's replies."""

    def __init__(self, *, screen_updates: bool = True, screen_kappa: float = DEFAULT_KAPPA):
        if not screen_kappa >= 1:
            raise ValueError(f"screen_kappa must be >= 1, got {screen_kappa!r}")
        self.screen_updates = bool(screen_updates)
        self.screen_kappa = float(screen_kappa)

    def turn_off_screening_for_dp(self) -> None:
        """Under dp=central whether a client is kept must not depend on the other clients
        (the privacy analysis does not cover it); clipping bounds what one client moves."""
        if self.screen_updates:
            log.info("dp=central: the median-ratio screening is off (docs/privacy.md)")
        self.screen_updates = False

    def check(
        self,
        message: Message,
        global_state: Mapping[str, np.ndarray],
        router: RankRouter,
        *,
        method_name: str,
        heterogeneous: bool,
        private: bool,
    ) -> Reply:
        """The checked reply, or ReplyRejected with the reason (never aggregated)."""
        metrics = message.content["metrics"] if "metrics" in message.content.metric_records else {}
        rank, expected = router.expected_state(
            metrics, global_state, method_name=method_name, heterogeneous=heterogeneous,
            private=private,
        )  # fmt: skip
        reply = check_reply(message, expected)
        return replace(reply, rank=rank)

    def screen(
        self,
        server_round: int,
        replies: list[Reply],
        global_state: Mapping[str, np.ndarray],
        starts: list[dict[str, np.ndarray]] | None = None,
    ) -> tuple[list[Reply], list[float], dict]:
        """The kept replies, their (clipped) example counts and the screening metrics;
        ``starts``: the state each reply started from (mixed ranks), else the global one."""
        return screen(
            server_round,
            replies,
            global_state,
            kappa=self.screen_kappa,
            enabled=self.screen_updates,
            starts=starts,
        )
