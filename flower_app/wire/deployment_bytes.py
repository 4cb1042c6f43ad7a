"""The bytes a message takes on the wire in a Flower 1.42 deployment (``wire_bytes``,
``wire_bytes_each``), from the sizes its arrays already know.

A deployment sends a Message as content-addressed objects: the Message (its metadata), its
RecordDict, each record, each Array (dtype, shape and its chunks' ids) and each ArrayChunk
(up to 5 MiB of the array's bytes), each a header (type, child ids, body length) and a body;
an object met twice in one message travels once. The count adds up those objects' lengths
without serialising or hashing an array: chunks are matched by their length and last bytes,
then compared. The metadata's five 64-bit ids are counted at their widest and a reply's id
as a deployment's (64 hex characters), so every run counts the same bytes, at most
``MAX_ABOVE_FLOWER`` above Flower's own deflation of the message.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain
from operator import attrgetter, itemgetter

import flwr.app.message.array as flwr_array
from flwr.app import Array, ArrayRecord, Error, Message, RecordDict
from flwr.app.message.arraychunk import ArrayChunk
from flwr.common.serde_utils import error_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.proto.message_pb2 import Metadata as ProtoMetadata
from flwr.supercore.constant import HEAD_BODY_DIVIDER, HEAD_VALUE_DIVIDER

ID_CHARS = 64  # an object id: the sha256 of its deflated bytes, in hex
WIDEST_ID = (1 << 64) - 1  # a uint64 id as a 10-byte varint, the longest it can take
# run, source and destination node, source and destination task: each 1 to 10 bytes of
# varint (or absent when 0), plus one byte where a body length gains a decimal digit
MAX_ABOVE_FLOWER = 5 * 10 + 1
TAIL = 32  # the bytes two chunks of one length are first matched on
ONE_CHUNK = (0,)
# with '"' and '\\', what json.dumps escapes in an ASCII string (all but ' ' to '~')
CONTROL = bytes([*range(32), 127])
DATA = attrgetter("data")
META = attrgetter("dtype", "shape", "stype")
LAST_BYTES = itemgetter(slice(-TAIL, None))


def object_bytes(kind: str, children: int, body: int) -> int:
    """A deflated object's length: the header ``<kind> <child ids, comma-separated> <body
    length>``, the divider, the body (flwr/supercore/inflatable/inflatable_object.py,
    ``add_header_to_object_body``)."""
    ids = children * (ID_CHARS + 1) - 1 if children else 0
    head = len(kind) + 2 * len(HEAD_VALUE_DIVIDER) + ids + len(str(body))
    return head + len(HEAD_BODY_DIVIDER) + body


def references_body(names: Iterable[str]) -> int:
    """The body of a RecordDict or an ArrayRecord: the JSON ``{name: child id}``. Each entry
    is the name's JSON string, ``": "`` and the quoted id, so the list of names plus 68 bytes
    a name."""
    names = list(names)
    joined = "".join(names)
    plain = joined.isascii() and '"' not in joined and "\\" not in joined
    if plain and len(joined.encode().translate(None, CONTROL)) == len(joined):
        listed = len(joined) + 4 * len(names) if names else 2  # each quoted, ", " between
    else:  # escapes: as json.dumps writes them
        listed = len(json.dumps(names))
    return listed + len(names) * (ID_CHARS + 4)


@lru_cache(maxsize=4096)
def array_bytes(dtype: str, shape: tuple[int, ...], stype: str, chunks: tuple[int, ...]) -> int:
    """An Array object's length. Its body is the JSON of its dtype, shape, stype and, for each
    chunk, the index of its id among the Array's distinct chunks (``chunks``), which its
    header lists (ASCII: ``json.dumps`` escapes the rest)."""
    meta = {"dtype": dtype, "shape": shape, "stype": stype, "arraychunk_ids": list(chunks)}
    return object_bytes(Array.__qualname__, len(set(chunks)), len(json.dumps(meta)))


@lru_cache(maxsize=4096)
def one_chunk_array_bytes(meta: tuple[str, tuple[int, ...], str]) -> int:
    """An Array object's length from its (dtype, shape, stype), its bytes one chunk."""
    return array_bytes(*meta, ONE_CHUNK)


@lru_cache(maxsize=4096)
def chunk_bytes(length: int) -> int:
    """An ArrayChunk object's length: a header without children, then the bytes."""
    return object_bytes(ArrayChunk.__qualname__, 0, length)


def message_body(message: Message) -> int:
    """The Message object's body: its metadata (with the ids as counted: see the module) and
    a failed reply's error, as protobuf; the content travels as the child RecordDict."""
    meta = message.metadata
    fields = (meta.reply_to_message_id != "", meta.group_id, meta.message_type,
              meta.ttl != 0, meta.created_at != 0)  # fmt: skip
    if message.has_error():
        return metadata_body(*fields, error=message.error)
    return content_metadata_body(*fields)


def metadata_body(
    is_reply: bool, group_id: str, message_type: str, ttl: bool, created_at: bool,
    error: Error | None = None,
) -> int:  # fmt: skip
    """The metadata's protobuf length: the ids at their widest, a reply's message id 64 hex
    characters, the doubles (8 bytes where set) and the strings; with the error, if any."""
    proto = ProtoMetadata(
        run_id=WIDEST_ID,
        src_node_id=WIDEST_ID,
        dst_node_id=WIDEST_ID,
        src_task_id=WIDEST_ID,
        dst_task_id=WIDEST_ID,
        reply_to_message_id="0" * ID_CHARS if is_reply else "",
        group_id=group_id,
        ttl=float(ttl),
        message_type=message_type,
        created_at=float(created_at),
    )
    wrapped = error_to_proto(error) if error is not None else None
    return ProtoMessage(metadata=proto, error=wrapped).ByteSize()


content_metadata_body = lru_cache(maxsize=1024)(metadata_body)


@dataclass(frozen=True)
class RecordObjects:
    """One ArrayRecord's objects: what makes two records one object (``key``: the names and
    their arrays, in order), the record's own bytes, its distinct arrays and chunks, and the
    bytes of it all, each object once."""

    key: tuple[tuple[str, ...], tuple[int, ...]]
    own: int
    arrays: frozenset[int]
    chunks: frozenset[int]
    total: int


class WireCounter:
    """Counts messages one by one; the chunks and the ArrayRecords it has looked at are
    remembered across the messages of one counter (a round's training messages share one
    record: looked at once), each message still counting every object it carries."""

    def __init__(self) -> None:
        self.chunk_size = flwr_array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE  # as Array slices
        # distinct chunks: by length and last bytes, then each one's bytes and length
        self.chunks: dict[tuple[int, bytes], list[tuple[bytes, int, int]]] = {}
        self.chunk_bytes: list[int] = []
        # distinct Arrays: by dtype, shape, stype and chunks
        self.arrays: dict[tuple, int] = {}
        self.array_bytes: list[int] = []
        self.array_chunks: list[tuple[int, ...]] = []
        # the records already looked at, by identity (held, so an id is not reused)
        self.seen_records: dict[int, tuple[ArrayRecord, RecordObjects]] = {}
        self.seen_totals: dict[int, tuple[ArrayRecord, int]] = {}
        self.seen_contents: dict[int, tuple[RecordDict, int]] = {}
        self.last_layout: tuple[object, int] = (None, 0)

    def chunk(self, data: bytes, start: int, end: int) -> int:
        """The chunk ``data[start:end]``'s index among the distinct chunks met so far."""
        key = (end - start, data[max(start, end - TAIL) : end])
        bucket = self.chunks.get(key)
        if bucket is None:
            bucket = self.chunks[key] = []
        else:
            piece = memoryview(data)[start:end]
            for other, other_start, index in bucket:
                if other is data and other_start == start:
                    return index
                if other.startswith(piece, other_start):  # a memcmp of the two, no copy
                    return index
        index = len(self.chunk_bytes)
        self.chunk_bytes.append(chunk_bytes(end - start))
        bucket.append((data, start, index))
        return index

    def array(self, array: Array) -> int:
        """``array``'s index among the distinct Arrays: equal dtype, shape, stype and chunks
        make one object."""
        data = array.data
        if type(data) is not bytes:
            data = bytes(data)
        n, size = len(data), self.chunk_size
        if 0 < n <= size:  # one chunk: most arrays
            chunks: tuple[int, ...] = (self.chunk(data, 0, n),)
        else:
            chunks = tuple(self.chunk(data, s, min(s + size, n)) for s in range(0, n, size))
        shape = array.shape
        if type(shape) is not tuple:
            shape = tuple(shape)
        key = (array.dtype, shape, array.stype, chunks)
        index = self.arrays.get(key)
        if index is None:
            if len(chunks) == 1:
                order, distinct = ONE_CHUNK, chunks
            else:  # each chunk's index among the Array's distinct chunks, in first-seen order
                first: dict[int, int] = {}
                order = tuple(first.setdefault(c, len(first)) for c in chunks)
                distinct = tuple(first)
            index = len(self.array_bytes)
            self.arrays[key] = index
            self.array_bytes.append(array_bytes(array.dtype, shape, array.stype, order))
            self.array_chunks.append(distinct)
        return index

    def record(self, record: ArrayRecord) -> RecordObjects:
        """``record``'s objects (looked at once a counter: a record is not changed while a
        round's messages are counted)."""
        seen = self.seen_records.get(id(record))
        if seen is not None and seen[0] is record:
            return seen[1]
        names = tuple(record.keys())
        indices = tuple(map(self.array, record.values()))
        arrays = frozenset(indices)
        chunks = frozenset(chain.from_iterable(map(self.array_chunks.__getitem__, arrays)))
        own = object_bytes(ArrayRecord.__qualname__, len(arrays), references_body(names))
        total = own + self.objects_bytes(arrays, chunks)
        found = RecordObjects((names, indices), own, arrays, chunks, total)
        self.seen_records[id(record)] = (record, found)
        return found

    def objects_bytes(self, arrays: Iterable[int], chunks: Iterable[int]) -> int:
        """The bytes of distinct Arrays and chunks, by their indices."""
        return sum(map(self.array_bytes.__getitem__, arrays)) + sum(
            map(self.chunk_bytes.__getitem__, chunks)
        )

    def lone_record(self, record: ArrayRecord) -> int:
        """The bytes of ``record`` and of everything under it, each object once."""
        seen = self.seen_totals.get(id(record))
        if seen is not None and seen[0] is record:
            return seen[1]
        total = self.distinct_total(record)
        if total is None:
            total = self.record(record).total
        self.seen_totals[id(record)] = (record, total)
        return total

    def distinct_total(self, record: ArrayRecord) -> int | None:
        """The common case in one pass: each array one chunk, no two chunks ending alike, so
        no two chunks and no two Arrays are equal. None where that does not hold. Records of
        one layout (names, dtypes, shapes, lengths: a round's replies) repeat one total."""
        arrays = list(record.values())
        if not arrays:
            return None
        datas, size = list(map(DATA, arrays)), self.chunk_size
        lengths = list(map(len, datas))
        if set(map(type, datas)) != {bytes} or not 0 < min(lengths) <= max(lengths) <= size:
            return None
        if len(set(map(LAST_BYTES, datas))) < len(datas):
            return None
        layout = (list(record.keys()), list(map(META, arrays)), lengths)
        if layout == self.last_layout[0]:
            return self.last_layout[1]
        names, metas, _ = layout
        try:
            own_arrays = sum(map(one_chunk_array_bytes, metas))
        except TypeError:  # a shape given as a list (unhashable)
            return None
        own = object_bytes(ArrayRecord.__qualname__, len(arrays), references_body(names))
        total = own + own_arrays + sum(map(chunk_bytes, lengths))
        self.last_layout = (layout, total)
        return total

    def message(self, message: Message) -> int:
        """The bytes of ``message``'s objects, each distinct object once."""
        if not message.has_content():  # a failed reply: the Message object alone
            return object_bytes(Message.__qualname__, 0, message_body(message))
        own = object_bytes(Message.__qualname__, 1, message_body(message))
        return own + self.content(message.content)

    def content(self, content: RecordDict) -> int:
        """The bytes of the RecordDict ``content`` and of everything under it, each object
        once (looked at once a counter, as a record)."""
        seen = self.seen_contents.get(id(content))
        if seen is not None and seen[0] is content:
            return seen[1]
        total = 0
        distinct: set[object] = set()
        array_records: dict[int, ArrayRecord] = {}
        for record in content.values():
            if isinstance(record, ArrayRecord):
                array_records[id(record)] = record
            else:  # a ConfigRecord or a MetricRecord: a few values, deflated as they are
                deflated = record.deflate()
                if (type(record).__qualname__, deflated) not in distinct:
                    distinct.add((type(record).__qualname__, deflated))
                    total += len(deflated)
        if len(array_records) == 1:  # one record object (under one name or more)
            total += self.lone_record(next(iter(array_records.values())))
            distinct.add(ArrayRecord.__qualname__)
        elif array_records:  # records may be equal or share arrays and chunks
            found = {r.key: r for r in map(self.record, array_records.values())}.values()
            arrays = frozenset().union(*(r.arrays for r in found))
            chunks = frozenset().union(*(r.chunks for r in found))
            total += sum(r.own for r in found) + self.objects_bytes(arrays, chunks)
            distinct.update((ArrayRecord.__qualname__, r.key) for r in found)
        body = references_body(content.keys())
        total += object_bytes(RecordDict.__qualname__, len(distinct), body)
        self.seen_contents[id(content)] = (content, total)
        return total


def wire_bytes_each(messages: Iterable[Message]) -> list[int]:
    """Each message's bytes on the wire (``wire_bytes``); the arrays the messages share (a
    round's training messages carry one global record) are looked at once."""
    counter = WireCounter()
    return [counter.message(message) for message in messages]


def wire_bytes(message: Message) -> int:
    """The bytes ``message`` takes as a Flower 1.42 deployment sends it: the deflated length
    of each distinct object of its tree (the Message, its RecordDict, records, Arrays and
    ArrayChunks), as a SuperNode pushes a reply to the SuperLink or pulls an instruction
    from it, holding none of the message's objects (a pull fetches an object reached from
    two parents twice, as one chunk under two different Arrays or one Array in two records:
    counted once). Computed from the arrays' lengths, dtypes, shapes and names, the records'
    keys and the configs' and metrics' few values; the ids counted at their widest (at most
    ``MAX_ABOVE_FLOWER`` bytes above the deflation)."""
    return WireCounter().message(message)
