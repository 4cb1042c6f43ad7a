"""What travels between ServerApp and ClientApps: named arrays as Flower ArrayRecords.

A model's shared state is a flat ``{key: array}``; a key ending in one of
``ADAPTER_SUFFIXES`` is an adapter matrix (FLoRG's ``A``, LoRA's ``lora_A`` / ``lora_B``,
LoRA-SB's ``R``),
every other key belongs to the task head, which every method FedAvgs (``split_state``).
The counts (``record_params``, ``declared_params``) are the parameters a round actually
sends and receives, reported as the ``down-params`` / ``up-params`` metrics;
``message_bytes`` is the size of a message's content as protobuf (the encodings' tests
compare it); the ``downlink-bytes`` / ``uplink-bytes`` metrics are the bytes a deployment
sends (flower_app/wire/deployment_bytes.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

ADAPTER_SUFFIXES: tuple[str, ...] = (".A", ".lora_A", ".lora_B", ".R")


def to_array_record(state: Mapping[str, np.ndarray]) -> ArrayRecord:
    """float32 ArrayRecord of named arrays (ArrayRecord cannot carry bfloat16)."""
    return ArrayRecord(
        array_dict={k: Array(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state.items()}
    )


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


def message_bytes(message: Any) -> int:
    """The size in bytes of ``message``'s content (a Flower ``Message``'s RecordDict)
    serialised to protobuf (``flwr.common.serde.recorddict_to_proto``); a failed reply's,
    its error (code and reason). The routing metadata is left out (its random ids would
    make a rerun count different bytes). It costs one serialisation (about 20 ms per MB on
    a 2-core CPU); what a deployment sends, counted without one, is
    ``flower_app.wire.deployment_bytes.wire_bytes``."""
    from flwr.common.serde import error_to_proto, recorddict_to_proto

    if message.has_error():
        return int(error_to_proto(message.error).ByteSize())
    return int(recorddict_to_proto(message.content).ByteSize())


def record_params(message_content: Any) -> int:
    """Number of array entries carried by all ArrayRecords of a message's content."""
    return int(
        sum(
            arr.numpy().size
            for rec in message_content.array_records.values()
            for arr in rec.values()
        )
    )


def declared_params(message_content: Any) -> int:
    """Array entries a message's ArrayRecords declare (their shapes; nothing deserialised)."""
    total = 0
    for rec in message_content.array_records.values():
        for arr in rec.values():
            try:
                total += int(np.prod(arr.shape, dtype=np.int64))
            except (TypeError, ValueError):
                continue
    return total


def split_state(state: Mapping[str, np.ndarray]) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """({layer: {'A' | 'lora_A' | 'lora_B' | 'R': array}}, {head key: array})."""
    layers: dict[str, dict[str, np.ndarray]] = {}
    head: dict[str, np.ndarray] = {}
    for key, value in state.items():
        suffix = next((s for s in ADAPTER_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            head[key] = value
        else:
            layers.setdefault(key[: -len(suffix)], {})[suffix[1:]] = value
    return layers, head
