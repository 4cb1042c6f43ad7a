"""How a training message's arrays travel (``uplink-encoding``, ``downlink-encoding``).

- ``fp32``: float32, the record ``to_array_record`` builds (the default).
- ``fp16``: IEEE half, round to nearest; beyond ±65504 a value becomes ±inf (the server refuses it).
- ``bf16``: the float32's top 16 bits rounded to nearest even, as ``uint16`` (``<name>@bf16``).
- ``int8``: per row scale s_i = max_j |x_ij| / 127 and unbiased stochastic rounding
  q_ij = floor(x_ij / s_i + u_ij), u_ij ~ U[0, 1) from the round's seed: ``<name>@int8`` and
  the float32 scales ``<name>@int8-scale``.

A lossy encoding refuses NaN and ±inf at the sender (``NonFiniteArray``). ``decode_record``
gives the arrays back as float32 under their own names; what the run's encoding does not
produce is left as it came, for the server's reply checks to refuse."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord

from flower_app.wire.records import to_array_record

ENCODINGS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8")
LOSSY: tuple[str, ...] = ("bf16", "fp16", "int8")
BF16, INT8, INT8_SCALE = "@bf16", "@int8", "@int8-scale"
INT8_LEVELS = 127  # symmetric: q in [-127, 127]
# Which stream a rounding draws from (``encoding_rng``): the server's training messages,
# the same for every node, or one client's reply.
DOWN, UP = 0, 1

# bytes per entry on the wire, before the per-row scales and the framing
BYTES_PER_ENTRY = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
BF16_QUIET = 0x0040  # the top mantissa bit of a bfloat16: set, a NaN stays a NaN


class NonFiniteArray(ValueError):
    """An array holding NaN or ±inf, refused by a lossy encoding at the sender."""


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
        x = np.ascontiguousarray(value, dtype=np.float32)  # a 0-d array: shape (1,), as fp32
        finite = np.isfinite(x)
        if not finite.all():  # one pass on the finite path
            bad = x.size - np.count_nonzero(finite)
            raise NonFiniteArray(
                f"array {name!r} holds {bad} NaN/inf of {x.size} entries: the {encoding} "
                "encoding refuses non-finite values (int8 cannot carry them)"
            )
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
    """The bfloat16 of each float32 entry, round to nearest even, as its 16 bits; ±inf
    stay ±inf, and a NaN stays a NaN of its sign (its top bits, with the quiet bit set)."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    # rounding a NaN would carry its payload into the exponent or past the sign (0x7FFFFFFF
    # to -0.0, 0x7F800001 to inf): a NaN is truncated instead, its quiet bit set so that
    # a payload held only in the low 16 bits cannot leave an inf
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = (bits[nan] >> 16).astype(np.uint16) | BF16_QUIET
    return rounded


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` as int8's rows: its first axis by the rest, or one row (0-d and 1-D). The
    columns are given, not -1, so an empty array (0 rows, or rows of 0) keeps its rows."""
    if x.ndim > 1:
        return x.reshape(x.shape[0], int(np.prod(x.shape[1:])))
    return x.reshape(1, x.size)


def to_int8(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(q, s): the per-row int8 levels and float32 scales of ``x`` (1-D: one row), one
    scale a row, empty rows included (scale 1)."""
    rows = _rows(x)
    absmax = np.abs(rows).max(axis=1, keepdims=True, initial=0.0)  # an empty row: 0
    scale = np.where(absmax > 0, absmax / INT8_LEVELS, 1.0).astype(np.float32)
    # a row of subnormals whose absmax / 127 underflows to 0 would divide by zero: its
    # entries are below any scale's step, so scale 1 rounds them to 0 (or -1, unbiased)
    scale[scale == 0] = 1.0
    u = rng.random(rows.shape, dtype=np.float32)
    q = np.floor(rows / scale + u)
    q = np.clip(q, -INT8_LEVELS, INT8_LEVELS).astype(np.int8)
    return q.reshape(x.shape), scale.reshape(-1)


def from_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    rows = _rows(q)
    return (rows.astype(np.float32) * scale.reshape(-1, 1)).reshape(q.shape)
