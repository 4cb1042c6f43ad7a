"""How a training message's arrays travel: the settings ``uplink-encoding`` (the clients'
replies) and ``downlink-encoding`` (the server's training messages), each one of
``ENCODINGS``.

- ``fp32``: float32, as every array has always travelled (the default; the record is built
  exactly as before, so a run is bit for bit what it was).
- ``fp16``: IEEE half precision, round to nearest (numpy's cast): 11 significant bits,
  values beyond ±65504 become ±inf (and the server rejects the reply as non-finite).
- ``bf16``: bfloat16, the top 16 bits of the float32 rounded to nearest even: float32's
  range, 8 significant bits. numpy has no bfloat16, so it travels as ``uint16`` under the
  key ``<name>@bf16``.
- ``int8``: per row absmax scaling, s_i = max_j |x_ij| / 127, and unbiased stochastic
  rounding q_ij = floor(x_ij / s_i + u_ij), u_ij ~ U[0, 1) drawn from the round's seed, so
  E[q_ij s_i] = x_ij and |q_ij s_i - x_ij| < s_i. It travels as ``int8`` under
  ``<name>@int8`` with the float32 scales (one per row; a 1-D array is one row) under
  ``<name>@int8-scale``.

The receiver decodes before anything else reads the arrays (``decode_record``, given the
run's encoding: float32 arrays under their own names), so every method's rule, the
server's reply checks, screening and DP clipping see arrays as before, only rounded; what
the run's encoding does not produce is left for those checks to refuse. ``decode_record``
of a float32 record is the record itself.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from flower_app.records import to_array_record

ENCODINGS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8")
LOSSY: tuple[str, ...] = ("bf16", "fp16", "int8")
BF16, INT8, INT8_SCALE = "@bf16", "@int8", "@int8-scale"
INT8_LEVELS = 127  # symmetric: q in [-127, 127]
# Which stream a rounding draws from (``encoding_rng``): the server's training messages,
# the same for every node, or one client's reply.
DOWN, UP = 0, 1

# bytes per entry on the wire, before the per-row scales and the framing
BYTES_PER_ENTRY = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def encoding_rng(seed: int, server_round: int, direction: int, partition: int = 0):
    """The generator of one message's stochastic rounding: the run's seed, the round, the
    direction and, uplink, the client's partition. Downlink it is one stream for every
    node, so every node decodes the same global model."""
    return np.random.default_rng([seed, server_round, direction, partition])


def encode_record(
    state: Mapping[str, np.ndarray], encoding: str, rng: np.random.Generator | None = None
) -> ArrayRecord:
    """``state`` as it travels under ``encoding`` (``rng``: int8's rounding)."""
    if encoding == "fp32":
        return to_array_record(state)
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {ENCODINGS}")
    if encoding == "int8" and rng is None:
        raise ValueError("int8 encoding draws its stochastic rounding from an rng")
    arrays: dict[str, Array] = {}
    for name, value in state.items():
        x = np.ascontiguousarray(value, dtype=np.float32)
        if encoding == "fp16":
            arrays[name] = Array(x.astype(np.float16))
        elif encoding == "bf16":
            arrays[name + BF16] = Array(to_bf16_bits(x))
        else:
            q, scale = to_int8(x, rng)
            arrays[name + INT8] = Array(q)
            arrays[name + INT8_SCALE] = Array(scale)
    return ArrayRecord(array_dict=arrays)


def decode_record(record: ArrayRecord, encoding: str) -> ArrayRecord:
    """``record``, sent under ``encoding``, with its encoded arrays back as float32 under
    their own names; under ``fp32`` (or with nothing encoded) the record itself. Only the
    forms ``encoding`` produces are decoded: anything else is left as it came, for the
    receiver's checks to refuse (a float16 array in an fp32 run stays float16)."""
    if encoding == "fp32" or all(a.dtype == "float32" and "@" not in k for k, a in record.items()):
        return record
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {ENCODINGS}")
    arrays = {k: v.numpy() for k, v in record.items()}
    out: dict[str, Array] = {}
    for key, value in arrays.items():
        if encoding == "int8" and key.endswith(INT8_SCALE):
            continue
        if encoding == "bf16" and key.endswith(BF16) and value.dtype == np.uint16:
            out[key.removesuffix(BF16)] = Array(from_bf16_bits(value))
        elif encoding == "int8" and key.endswith(INT8) and value.dtype == np.int8:
            name = key.removesuffix(INT8)
            if name + INT8_SCALE not in arrays:
                raise ValueError(f"int8 array {name!r} arrived without its scales")
            out[name] = Array(from_int8(value, arrays[name + INT8_SCALE]))
        elif encoding == "fp16" and value.dtype == np.float16:
            out[key] = Array(value.astype(np.float32))
        else:  # not this encoding's form: as it came, for the receiver's checks
            out[key] = Array(np.ascontiguousarray(value))
    return ArrayRecord(array_dict=out)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 of each float32 entry, round to nearest even, as its 16 bits."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_int8(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(q, s): the per-row int8 levels and float32 scales of ``x`` (1-D: one row)."""
    rows = x.reshape(x.shape[0], -1) if x.ndim > 1 else x.reshape(1, -1)
    absmax = np.abs(rows).max(axis=1, keepdims=True) if rows.size else np.zeros((1, 1))
    scale = np.where(absmax > 0, absmax / INT8_LEVELS, 1.0).astype(np.float32)
    u = rng.random(rows.shape, dtype=np.float32)
    q = np.floor(rows / scale + u)
    q = np.clip(q, -INT8_LEVELS, INT8_LEVELS).astype(np.int8)
    return q.reshape(x.shape), scale.reshape(-1)


def from_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    rows = q.reshape(q.shape[0], -1) if q.ndim > 1 else q.reshape(1, -1)
    return (rows.astype(np.float32) * scale.reshape(-1, 1)).reshape(q.shape)
