"""Error feedback for a lossy ``uplink-encoding`` (``uplink-error-feedback``; EF-SGD).

A client keeps, per array name, the residual e of what the encoding left out of its update.
With x_recv the state it received and d = x - x_recv its update, it sends Q(x_recv + d + e)
and keeps e <- (d + e) - (decode(sent) - x_recv), decoded as the server decodes it. e is an
update (x_recv cancels), so it still applies when the global model has moved; the server's
decoded updates then sum to the true ones up to the last e, one rounding. Arrays a round
does not send (``Method.uplink``) keep theirs. The residual lives in the node's context
(``RECORD``) and, where the node keeps state on its disk (flower_app/client/node_state.py),
under ``uplink-residual/`` there; one whose names or shapes no longer match is dropped,
with a warning; a failed encode keeps the old one."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, Context, Message
from flwr.common.logger import log as flwr_log

from flower_app.client.node_state import (
    load_local_state,
    node_state_dir,
    save_local_state,
)
from flower_app.wire.encoding import decode_record, encode_record
from flower_app.wire.ranks import truncate_to_rank
from flower_app.wire.records import from_array_record, to_array_record

if TYPE_CHECKING:
    from flower_app.adapted import AdaptedModel
    from flower_app.settings.config import RunConfig

RECORD = "uplink-residual"  # the context's record of the residual
FOLDER = "uplink-residual"  # its folder in the node's state folder
WARNING = 30


def feedback_step(
    trained: Mapping[str, np.ndarray],
    received: Mapping[str, np.ndarray],
    residual: Mapping[str, np.ndarray],
    encoding: str,
    rng: np.random.Generator | None,
) -> tuple[ArrayRecord, dict[str, np.ndarray]]:
    """(the record that travels, the new residual of its arrays): each array of ``trained``
    as its update from ``received`` (from zero where that has no array of its name and
    shape) plus its ``residual``, encoded, and what of that ``decode_record`` gives back
    short. float64 arithmetic, so the residual is exactly what was left out, float32
    rounding included; a decoded entry that is not finite (fp16 beyond its range: the
    server refuses the reply) leaves the residual as it was ({}). Raises NonFiniteArray
    as ``encode_record`` does."""
    carried: dict[str, np.ndarray] = {}  # d + e
    bases: dict[str, np.ndarray] = {}  # x_recv
    target: dict[str, np.ndarray] = {}  # x_recv + d + e, as it is encoded
    for name, value in trained.items():
        x = np.asarray(value, np.float64)
        base = received.get(name)
        base = np.zeros_like(x) if base is None or np.shape(base) != x.shape else base
        bases[name] = np.asarray(base, np.float64)
        carried[name] = x - bases[name]
        if name in residual:
            carried[name] += np.asarray(residual[name], np.float64).reshape(x.shape)
        target[name] = (bases[name] + carried[name]).astype(np.float32)
    record = encode_record(target, encoding, rng)
    decoded = from_array_record(decode_record(record, encoding))  # as the server decodes
    if not all(np.isfinite(decoded[name]).all() for name in carried):
        return record, {}
    left_out = {}
    for name, update in carried.items():
        sent = decoded[name].astype(np.float64).reshape(update.shape) - bases[name]
        left_out[name] = (update - sent).astype(np.float32)
    return record, left_out


def _shape(value: np.ndarray) -> tuple[int, ...]:
    """A shape as an ArrayRecord keeps it (a 0-d array as shape (1,))."""
    return tuple(np.atleast_1d(value).shape)


def residual_dir(msg: Message, partition_id: int) -> Path | None:
    """The residual's folder in the node's state folder, or None (none configured)."""
    folder = node_state_dir(msg, partition_id)
    return None if folder is None else folder / FOLDER


def load_residual(
    context: Context,
    msg: Message,
    partition_id: int,
    server_round: int,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, np.ndarray]:
    """The node's residual: the context's, else the newest its disk holds from a round
    before ``server_round`` (a resumed run redoes the later ones), else none ({}). Dropped
    with a warning where a name is not one of ``shapes`` (the shared arrays' names and
    shapes) or its shape differs (a change of rank, of model or of method)."""
    record = context.state.array_records.get(RECORD)
    if record is not None:
        residual, where = from_array_record(record), "the node's context"
    else:
        folder = residual_dir(msg, partition_id)
        found = load_local_state(folder, server_round) if folder is not None else None
        residual, where = dict(found or {}), str(folder)
    wrong = sorted(k for k, v in residual.items() if shapes.get(k) != _shape(v))
    if wrong:
        flwr_log(
            WARNING,
            "[florg] dropping the uplink error-feedback residual in %s: %d of its arrays "
            "(%s) no longer match the model's shared arrays by name and shape",
            where,
            len(wrong),
            ", ".join(wrong[:3]),
        )
        return {}
    return residual


def save_residual(
    context: Context,
    msg: Message,
    partition_id: int,
    server_round: int,
    residual: Mapping[str, np.ndarray],
) -> None:
    """Keep the residual in the context and, where configured, on the node's disk."""
    context.state[RECORD] = to_array_record(residual)
    folder = residual_dir(msg, partition_id)
    if folder is not None and residual:
        save_local_state(folder, server_round, dict(residual))


def encode_with_feedback(
    msg: Message,
    context: Context,
    config: RunConfig,
    adapted: AdaptedModel,
    sent: Mapping[str, np.ndarray],
    *,
    rank: int,
    partition_id: int,
    server_round: int,
    rng: np.random.Generator,
) -> ArrayRecord:
    """``sent`` (this round's uplink) as ``uplink-encoding`` sends it with error feedback:
    its update from the state ``msg`` carried (decoded, at the node's ``rank``) plus the
    node's residual; the new residual kept, over the old one's for the arrays sent."""
    shapes = {k: _shape(v) for k, v in adapted.shared_state().items()}
    residual = load_residual(context, msg, partition_id, server_round, shapes)
    arrays = decode_record(msg.content["arrays"], config.downlink_encoding)
    received = truncate_to_rank(from_array_record(arrays), rank)
    # NonFiniteArray propagates before anything is saved: the old residual stays
    record, left_out = feedback_step(sent, received, residual, config.uplink_encoding, rng)
    save_residual(context, msg, partition_id, server_round, {**residual, **left_out})
    return record
