"""Checking a client's training reply before anything of it is aggregated (docs/faults.md).

``check_reply`` turns a reply Message into a ``Reply`` or raises ``ReplyRejected`` with the
reason: other records than 'arrays' and 'metrics', missing or extra keys, a dtype other
than float32/float64, a 0-d or 3-d or otherwise mis-shaped array, an array whose
serialised size exceeds its expected size (checked before it is deserialised), NaN/Inf, a
``num-examples`` / ``partition-id`` / ``train-loss`` that is not a finite number of the
right kind.  ``AdapterStrategy.check_reply`` runs it against the global state;
``FLoRGStrategy.check_reply`` adds the L/R fingerprint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, Message

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
    if len(array.data) > limit:
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
