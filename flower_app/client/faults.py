"""Client fault injection for tests and the poisoning benchmark: a Flower client mod.

``inject_faults`` (attached as ``ClientApp(mods=[inject_faults])``) wraps every message. On a
training message of the partition ``fault-partition`` (-1, the default: none) it misbehaves as
``fault-kind`` says; a comma list gives round t (``server-round``) the t-th kind, cycled:

    raise   the ClientApp raises before training (the server gets an error reply)
    nan     the reply's first array is all NaN
    shape   the reply's first array loses its last column
    scale   every adapter array of the reply x ``fault-scale`` (poisoning)
    claim   the reply claims ``fault-scale`` examples (poisoning)
Everything else passes through unchanged; the round itself (round.py) knows nothing of faults."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Context, Message, MessageType

from flower_app.settings.config import resolve_config
from flower_app.wire.encoding import decode_record
from flower_app.wire.records import ADAPTER_SUFFIXES, from_array_record, to_array_record


def partition_id(context: Context) -> int:
    """This node's ``partition-id`` (node config; a lone node holds partition 0)."""
    return int(context.node_config.get("partition-id", 0))


def round_fault_kind(kinds: str, msg: Message) -> str:
    """The kind of fault for the training round of ``msg``: the setting's t-th kind in
    round t (server-round, from 1), cycled; a single kind in every round."""
    listed = [kind.strip() for kind in kinds.split(",")]
    server_round = int(msg.content["config"].get("server-round", 1))
    return listed[(max(server_round, 1) - 1) % len(listed)]


def inject_faults(
    msg: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    """The client mod: misbehave on training messages of ``fault-partition`` (see above)."""
    if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
        return call_next(msg, context)
    config = resolve_config(context.run_config)
    pid = partition_id(context)
    if config.fault_partition != pid:
        return call_next(msg, context)
    kind = round_fault_kind(config.fault_kind, msg)
    if kind == "raise":
        raise RuntimeError(f"fault injected on partition {pid} (run config 'fault-partition')")
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    if kind == "claim":  # poisoning: claims fault-scale examples
        reply.content["metrics"]["num-examples"] = config.fault_scale
        return reply
    # the faulty reply travels float32 whatever uplink-encoding (the server takes that too)
    payload = from_array_record(decode_record(reply.content["arrays"], config.uplink_encoding))
    key = next(iter(payload))
    if kind == "nan":
        payload[key] = np.full_like(payload[key], np.nan)
    elif kind == "shape":
        payload[key] = payload[key][..., :-1]
    elif kind == "scale":  # poisoning: every adapter tensor x fault-scale
        for name in payload:
            if name.endswith(ADAPTER_SUFFIXES):
                payload[name] = payload[name] * config.fault_scale
    reply.content["arrays"] = to_array_record(payload)
    return reply
