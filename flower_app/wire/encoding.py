"""How a training message's arrays travel (``uplink-encoding``, ``downlink-encoding``).

- ``fp32``: float32, the record ``to_array_record`` builds (the default).
- ``fp16``: IEEE half, round to nearest; beyond ±65504 a value becomes ±inf (the server refuses it).
- ``bf16``: the float32's top 16 bits rounded to nearest even, as ``uint16`` (``<name>@bf16``).
- ``int8``: per row scale s_i = max_j |x_ij| / 127, unbiased stochastic rounding
  q_ij = floor(x_ij / s_i + u_ij), u_ij ~ U[0, 1) from the round's seed (``<name>@int8``).
- ``int8-g`` / ``int4-g``: a scale per ``GROUP`` entries along each array's long axis, the
  same rounding to ±127 / ±7; one message's arrays in one uint8 buffer (``@packed``).

A lossy encoding refuses NaN and ±inf at the sender (``NonFiniteArray``). ``decode_record``
gives float32 back under the arrays' own names; other forms stay as they came, for the checks."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

from flower_app.wire.records import to_array_record

ENCODINGS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "int8-g", "int4-g")
LOSSY: tuple[str, ...] = ("bf16", "fp16", "int8", "int8-g", "int4-g")
BF16, INT8, INT8_SCALE = "@bf16", "@int8", "@int8-scale"
INT8_LEVELS = 127  # symmetric: q in [-127, 127]
# The grouped encodings: their symmetric levels (q in [-L, L]) and bits an entry
GROUPED: dict[str, tuple[int, int]] = {"int8-g": (127, 8), "int4-g": (7, 4)}
GROUP = 128  # entries a scale covers, consecutive along an array's long axis
PACKED = "@packed"  # the one array a grouped message carries
PACK_MAGIC = b"FLP1"  # a packed buffer's first bytes: its format and version
# Which stream a rounding draws from (``encoding_rng``): the server's training messages,
# the same for every node, or one client's reply.
DOWN, UP = 0, 1

# bytes per entry on the wire, before the scales and the framing
BYTES_PER_ENTRY = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int8-g": 1, "int4-g": 0.5}
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
    """``state`` as it travels under ``encoding`` (``rng``: the integer encodings' rounding)."""
    if encoding == "fp32":
        return to_array_record(state)
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {ENCODINGS}")
    if encoding in GROUPED:
        if rng is None:
            raise ValueError(f"{encoding} encoding draws its stochastic rounding from an rng")
        return ArrayRecord(array_dict={PACKED: Array(pack_groups(state, encoding, rng))})
    if encoding == "int8" and rng is None:
        raise ValueError("int8 encoding draws its stochastic rounding from an rng")
    arrays: dict[str, Array] = {}
    for name, value in state.items():
        x = np.ascontiguousarray(value, dtype=np.float32)  # a 0-d array: shape (1,), as fp32
        _refuse_non_finite(name, x, encoding)
        if encoding == "fp16":
            arrays[name] = Array(x.astype(np.float16))
        elif encoding == "bf16":
            arrays[name + BF16] = Array(to_bf16_bits(x))
        else:
            q, scale = to_int8(x, rng)
            arrays[name + INT8] = Array(q)
            arrays[name + INT8_SCALE] = Array(scale)
    return ArrayRecord(array_dict=arrays)


def _refuse_non_finite(name: str, x: np.ndarray, encoding: str) -> None:
    finite = np.isfinite(x)
    if not finite.all():  # one pass on the finite path
        bad = x.size - np.count_nonzero(finite)
        raise NonFiniteArray(
            f"array {name!r} holds {bad} NaN/inf of {x.size} entries: the {encoding} "
            "encoding refuses non-finite values (its levels cannot carry them)"
        )


class DecodedArray(Array):
    """A decoded float32 array as a Flower ``Array`` the receiver reads without the .npy round
    trip: ``numpy()`` returns it (read-only), and ``data``, the bytes ``Array(x)`` holds, is
    made only if something asks for it (the object ids of a message sent on)."""

    def __init__(self, value: np.ndarray) -> None:  # sets the dataclass fields itself
        value = np.ascontiguousarray(value)
        value.flags.writeable = False
        self.__dict__.update(dtype=str(value.dtype), shape=tuple(value.shape), stype=SType.NUMPY)
        self._value = value

    def __getattr__(self, name: str) -> bytes:
        if name != "data":
            raise AttributeError(name)
        data = Array(self._value).data  # np.save's bytes, as any Array of it holds
        self.__dict__["data"] = data
        return data

    def numpy(self) -> np.ndarray:
        return self._value


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
            out[key.removesuffix(BF16)] = DecodedArray(from_bf16_bits(value))
        elif encoding == "int8" and key.endswith(INT8) and value.dtype == np.int8:
            name = key.removesuffix(INT8)
            if name + INT8_SCALE not in arrays:
                raise ValueError(f"int8 array {name!r} arrived without its scales")
            out[name] = DecodedArray(from_int8(value, arrays[name + INT8_SCALE]))
        elif encoding == "fp16" and value.dtype == np.float16:
            out[key] = DecodedArray(value.astype(np.float32))
        elif encoding in GROUPED and key == PACKED and value.dtype == np.uint8:
            for name, x in unpack_groups(value, encoding).items():
                if name in arrays or name in out:
                    raise ValueError(f"packed array {name!r} arrived twice in one record")
                out[name] = DecodedArray(x)
        else:  # not this encoding's form: as it came, for the receiver's checks
            out[key] = Array(np.ascontiguousarray(value))
    record = ArrayRecord()  # set item by item: ArrayRecord(array_dict=) re-serialises each
    for key, array in out.items():
        record[key] = array
    return record


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


# -- int8-g / int4-g: group-wise scales, one packed buffer per message ---------------------
#
# The buffer: PACK_MAGIC, the header's length (uint32, little-endian), the header (compact
# JSON, space-padded to an even length: {"encoding", "group", "arrays": [[name, shape]...]}),
# every array's scales (bfloat16 bits, uint16 little-endian), then every array's levels
# (int8 bytes, or int4 two to a byte, the first in the low nibble). Each array's offsets
# follow from its shape and the group, so the header holds no offset that could disagree.


def _lines(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(rows, cols, lines, length) of an array of ``shape``: its first axis by the rest (1-D
    and 0-d: one row), then the lines its groups run along, on the longer axis, and their
    length: (rows, cols), or (cols, rows) when rows > cols (groups run down the columns)."""
    if len(shape) > 1:
        rows, cols = int(shape[0]), math.prod(int(n) for n in shape[1:])
    else:
        rows, cols = 1, math.prod(int(n) for n in shape)
    if rows > cols:
        return rows, cols, cols, rows
    return rows, cols, rows, cols


def _counts(shape: tuple[int, ...], group: int) -> tuple[int, int]:
    """(entries, scales) of an array of ``shape`` grouped by ``group``."""
    _, _, lines, length = _lines(shape)
    return lines * length, lines * -(-length // group)


def _bf16_up(x: np.ndarray) -> np.ndarray:
    """The bits of the smallest bfloat16 >= each positive finite float32 entry: a scale
    rounded up, so no entry exceeds the levels and the error stays within one step."""
    bits = x.view(np.uint32)
    return ((bits >> 16) + ((bits & 0xFFFF) != 0)).astype(np.uint16)


def to_groups(
    x: np.ndarray, levels: int, rng: np.random.Generator, group: int = GROUP
) -> tuple[np.ndarray, np.ndarray]:
    """(q, s): the levels of float32 ``x`` as int8 of shape (lines, length) (``_lines``) and
    each group's scale as bfloat16 bits, s >= max |x| / levels rounded up (1: all zero)."""
    rows, cols, lines, length = _lines(x.shape)
    m = x.reshape(rows, cols)
    if lines != rows:
        m = m.T
    groups = -(-length // group)
    if m.size == 0:
        return np.zeros((lines, length), np.int8), np.zeros(lines * groups, np.uint16)
    padded = np.zeros((lines, groups, group), np.float32)  # zeros: no group's max changes
    padded.reshape(lines, -1)[:, :length] = m
    absmax = np.abs(padded).max(axis=2)
    scale = np.where(absmax > 0, absmax / levels, 1.0).astype(np.float32)
    scale[scale == 0] = 1.0  # a group of subnormals whose absmax / levels underflows
    bits = _bf16_up(scale)
    padded /= from_bf16_bits(bits)[:, :, None]
    y = padded.reshape(lines, -1)[:, :length]
    y += rng.random((lines, length), dtype=np.float32)
    q = np.clip(np.floor(y), -levels, levels).astype(np.int8)
    return q, bits.reshape(-1)


def from_groups(
    q: np.ndarray, bits: np.ndarray, shape: tuple[int, ...], group: int = GROUP
) -> np.ndarray:
    """float32 of ``shape`` from its levels ``q`` (lines x length, flat) and scale bits."""
    rows, cols, lines, length = _lines(shape)
    if lines * length == 0:
        return np.zeros(shape, np.float32)
    groups = -(-length // group)
    padded = np.zeros((lines, groups, group), np.float32)
    padded.reshape(lines, -1)[:, :length] = q.reshape(lines, length)
    padded *= from_bf16_bits(bits).reshape(lines, groups, 1)
    m = padded.reshape(lines, -1)[:, :length]
    if lines != rows:
        m = m.T
    return np.ascontiguousarray(m.reshape(shape))


def pack_groups(
    state: Mapping[str, np.ndarray], encoding: str, rng: np.random.Generator
) -> np.ndarray:
    """``state`` under ``encoding`` (int8-g, int4-g) as one packed uint8 buffer."""
    levels, nbits = GROUPED[encoding]
    index, scales, entries = [], [], []
    for name, value in state.items():
        x = np.ascontiguousarray(value, dtype=np.float32)  # a 0-d array: shape (1,), as fp32
        _refuse_non_finite(name, x, encoding)
        q, bits = to_groups(x, levels, rng)
        index.append([name, list(x.shape)])
        scales.append(bits.astype("<u2"))
        entries.append(q.reshape(-1))
    header = json.dumps(
        {"encoding": encoding, "group": GROUP, "arrays": index}, separators=(",", ":")
    ).encode()
    header += b" " * (len(header) % 2)  # the scales start on an even byte
    levels_q = np.concatenate(entries) if entries else np.zeros(0, np.int8)
    if nbits == 4:  # two's complement nibbles, two to a byte
        nibbles = levels_q.view(np.uint8) & 0x0F
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(0))
        body = nibbles[0::2] | (nibbles[1::2] << 4)
    else:
        body = levels_q.view(np.uint8)
    parts = [
        np.frombuffer(PACK_MAGIC + len(header).to_bytes(4, "little") + header, np.uint8),
        *(s.view(np.uint8) for s in scales),
        body,
    ]
    return np.concatenate(parts)


def _header(buffer: np.ndarray, encoding: str) -> tuple[int, list[tuple[str, tuple]], int]:
    """(group, [(name, shape)], where the scales start) of a packed buffer, checked."""
    if buffer.ndim != 1 or buffer.size < 8 or buffer[:4].tobytes() != PACK_MAGIC:
        raise ValueError(f"{PACKED} is not a packed {encoding} buffer (no {PACK_MAGIC!r} mark)")
    size = int.from_bytes(buffer[4:8].tobytes(), "little")
    if 8 + size > buffer.size:
        raise ValueError(f"{PACKED} is truncated: its header needs {size} bytes")
    try:
        header = json.loads(buffer[8 : 8 + size].tobytes().decode("utf-8"))
        group, arrays = header["group"], header["arrays"]
        sent = header["encoding"]
        index = [(name, tuple(shape)) for name, shape in arrays]
    except (ValueError, KeyError, TypeError) as err:  # JSON, UTF-8, a missing or bad field
        raise ValueError(f"{PACKED} has a malformed header: {err}") from err
    if not all(isinstance(name, str) for name, _ in index):
        raise ValueError(f"{PACKED} has a malformed header: an array's name is not a string")
    if sent != encoding:
        raise ValueError(f"{PACKED} was packed under {sent!r}, not the run's {encoding!r}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"{PACKED} has a bad group size {group!r}")
    for name, shape in index:
        if not all(isinstance(n, int) and 0 <= n < 2**31 for n in shape):
            raise ValueError(f"{PACKED} gives array {name!r} a bad shape {shape!r}")
    if len({name for name, _ in index}) != len(index):
        raise ValueError(f"{PACKED} names an array twice")
    return group, index, 8 + size


def unpack_groups(buffer: np.ndarray, encoding: str) -> dict[str, np.ndarray]:
    """The float32 arrays, under their own names and shapes, of a buffer ``pack_groups``
    made under ``encoding``; a malformed buffer (truncated, a bad header, sizes that do
    not add up, levels or scales no encoder makes) raises ValueError."""
    levels, nbits = GROUPED[encoding]
    group, index, at = _header(buffer, encoding)
    counts = [_counts(shape, group) for _, shape in index]
    entries = sum(n for n, _ in counts)
    n_scales = sum(s for _, s in counts)
    expected = at + 2 * n_scales + (entries if nbits == 8 else -(-entries // 2))
    if buffer.size != expected:
        raise ValueError(
            f"{PACKED} holds {buffer.size} bytes where its header's {len(index)} arrays take "
            f"{expected}: truncated or mismatched"
        )
    bits = buffer[at : at + 2 * n_scales].copy().view("<u2").astype(np.uint16)
    scale = from_bf16_bits(bits)
    if not (np.isfinite(scale) & (scale > 0)).all():
        raise ValueError(f"{PACKED} holds a scale that is not positive and finite")
    body = buffer[at + 2 * n_scales :]
    if nbits == 4:
        nibbles = np.empty(2 * body.size, np.uint8)
        nibbles[0::2], nibbles[1::2] = body & 0x0F, body >> 4
        q = ((nibbles[:entries] ^ 8).astype(np.int8) - 8).astype(np.int8)  # sign-extended
    else:
        q = body.view(np.int8)
    if q.size and (q.min() < -levels or q.max() > levels):
        raise ValueError(f"{PACKED} holds a level beyond ±{levels}")
    out: dict[str, np.ndarray] = {}
    e = s = 0
    for (name, shape), (n, k) in zip(index, counts, strict=True):
        out[name] = from_groups(q[e : e + n], bits[s : s + k], shape, group)
        e, s = e + n, s + k
    return out
