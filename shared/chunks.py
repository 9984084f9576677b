"""The immutable chunk object: one sealed piece of a stream, self-describing (design §5).

    offset 0                                                                    32
    +----------+-------------+-------------+-------------------+-----------------+
    | magic    | version     | header len  | index length      | data length     |  prelude
    | DS3CHNK1 | u32 BE (=1) | u32 BE  (H) | u64 BE (I = 9*N)  | u64 BE (D)      |  32 bytes
    +----------+-------------+-------------+-------------------+-----------------+
    | header: H bytes of UTF-8 JSON                                              |
    |   {"sid", "chunk", "start", "end", "content_type", "records", "closed",    |
    |    "created_at", "path"}                                                   |
    +---------------------------------------------+------------------------------+
    | index: N entries of 9 bytes                 |                              |
    |   end position u64 BE | flags u8            |  entry i: record i ends at   |
    |   (bit 0: last message of its append)       |  stream position end[i]      |
    +---------------------------------------------+------------------------------+
    | data: D bytes, the records back to back; data byte k is stream position    |
    |   start + k; record i is [end[i-1] (or start), end[i])                     |  data_offset =
    +----------------------------------------------------------------------------+  32 + H + I

Readers fetch the head (prelude + header + index: `head_size`) once, cache it, and then
serve any message-aligned range with one ranged GET of the data, because records are
contiguous (JSON records already carry their trailing ',' delimiter, so a JSON response is
'[' + slice + ']' without the trailing comma; this module does not care about content types).

Pure module: no aiohttp, lmdb or aiobotocore. The PySpark pipeline decodes chunks with it.
The header JSON is written with sorted keys and no spaces, so re-sealing the same records
with the same header gives a byte-identical object.
"""

from __future__ import annotations

import json
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, NamedTuple

MAGIC: Final = b"DS3CHNK1"
VERSION: Final = 1
_PRELUDE: Final = struct.Struct(">8sIIQQ")
_ENTRY: Final = struct.Struct(">QB")
PRELUDE_SIZE: Final = _PRELUDE.size  # 32
INDEX_ENTRY_SIZE: Final = _ENTRY.size  # 9
FLAG_LAST_IN_APPEND: Final = 0x01
# A corrupt prelude must not make a reader fetch gigabytes of "header".
MAX_HEADER_LENGTH: Final = 64 * 1024

assert PRELUDE_SIZE == 32 and INDEX_ENTRY_SIZE == 9


class ChunkFormatError(ValueError):
    """The bytes are not a valid chunk object (or the records given to encode_chunk are not
    a valid chunk)."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    sid: int  # the stream's internal id
    chunk: int  # chunk id (as in offsets)
    start: int  # stream position of the first data byte
    end: int  # stream position just after the last data byte
    content_type: str
    records: int
    closed: bool  # this chunk ends a closed stream
    created_at: float  # Unix time the chunk was sealed
    path: str  # the stream's path when sealed (informational)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ChunkHeader:
        try:
            obj = json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
            raise ChunkFormatError(f"chunk header is not UTF-8 JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ChunkFormatError("chunk header is not a JSON object")
        # Unknown fields are ignored: a newer writer may add some within version 1.
        return cls(
            sid=_field(obj, "sid", int), chunk=_field(obj, "chunk", int),
            start=_field(obj, "start", int), end=_field(obj, "end", int),
            content_type=_field(obj, "content_type", str), records=_field(obj, "records", int),
            closed=_field(obj, "closed", bool), created_at=float(_field(obj, "created_at", float)),
            path=_field(obj, "path", str),
        )


def _field(obj: dict[str, Any], name: str, kind: type) -> Any:
    if name not in obj:
        raise ChunkFormatError(f"chunk header lacks {name!r}")
    v = obj[name]
    if kind is bool:
        ok = isinstance(v, bool)
    elif isinstance(v, bool):  # bool is an int in Python, but not a valid number here
        ok = False
    elif kind is float:  # JSON writes 1.0 as 1.0 but a writer may send 1 (not one too large for a float)
        ok = isinstance(v, float) or (isinstance(v, int) and abs(v) < 2**1023)
    else:
        ok = isinstance(v, kind)
    if not ok:
        raise ChunkFormatError(f"chunk header field {name!r} is not {kind.__name__}: {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class Prelude:
    version: int
    header_length: int
    index_length: int
    data_length: int

    @property
    def head_size(self) -> int:
        """Bytes from the object's start through the index: what parse_head needs."""
        return PRELUDE_SIZE + self.header_length + self.index_length

    @property
    def object_size(self) -> int:
        return self.head_size + self.data_length


class Record(NamedTuple):
    start: int  # stream positions [start, end)
    end: int
    flags: int
    data: bytes


class RecordSpan(NamedTuple):
    number: int  # 0-based, in the chunk
    start: int
    end: int
    flags: int


@dataclass(frozen=True, slots=True)
class ChunkHead:
    """Everything but the data: enough to map stream positions to object byte ranges."""

    header: ChunkHeader
    ends: tuple[int, ...]  # ends[i]: stream position just after record i
    flags: bytes  # flags[i]: record i's flags
    data_offset: int  # object byte offset of the data (stream position header.start)
    object_size: int

    def _check(self, position: int) -> None:
        h = self.header
        if not h.start <= position <= h.end:
            raise ValueError(f"position {position} is outside chunk {h.chunk} [{h.start}, {h.end}]")

    def object_offset(self, position: int) -> int:
        """Object byte offset that holds stream position `position` (in [start, end])."""
        self._check(position)
        return self.data_offset + position - self.header.start

    def is_boundary(self, position: int) -> bool:
        """True at the chunk's start and at every record end."""
        if position == self.header.start:
            return True
        i = bisect_left(self.ends, position)
        return i < len(self.ends) and self.ends[i] == position

    def record_at(self, position: int) -> RecordSpan:
        """The record holding the byte at `position` (start <= position < end)."""
        h = self.header
        if not h.start <= position < h.end:
            raise ValueError(f"no record at {position} in chunk {h.chunk} [{h.start}, {h.end})")
        i = bisect_right(self.ends, position)
        return RecordSpan(i, self.ends[i - 1] if i else h.start, self.ends[i], self.flags[i])

    def slice_for(self, position: int, max_bytes: int) -> tuple[int, int, int]:
        """The range to serve from `position`: (object byte start, object byte end exclusive,
        stream position reached). It runs to the end of the record holding `position`, then
        takes whole records while the total stays within max_bytes; it always covers at
        least that first record, however large. Empty when position == end.

        `position` is normally start or a record end; any position inside a record is
        accepted too (byte streams may be read from anywhere)."""
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive: {max_bytes}")
        self._check(position)
        h = self.header
        if position == h.end:
            off = self.object_offset(position)
            return off, off, position
        first = bisect_right(self.ends, position)  # the record holding `position`
        last = bisect_right(self.ends, position + max_bytes) - 1  # last end within budget
        end = self.ends[max(first, last)]
        return self.object_offset(position), self.object_offset(end), end

    def spans(self) -> Iterator[RecordSpan]:
        prev = self.header.start
        for i, (end, flags) in enumerate(zip(self.ends, self.flags, strict=True)):
            yield RecordSpan(i, prev, end, flags)
            prev = end


def encode_chunk(header: ChunkHeader, records: Sequence[tuple[int, int, bytes]]) -> bytes:
    """The object for `records`, each (end position, flags, data), in stream order."""
    if not records:
        raise ChunkFormatError("a chunk holds at least one record")
    if header.records != len(records):
        raise ChunkFormatError(f"header says {header.records} records, {len(records)} given")
    if header.start < 0:
        raise ChunkFormatError(f"negative start position {header.start}")
    prev = header.start
    index = bytearray()
    for i, (end, flags, data) in enumerate(records):
        if end <= prev:
            raise ChunkFormatError(f"record {i}: end {end} does not follow {prev}")
        if len(data) != end - prev:
            raise ChunkFormatError(f"record {i}: {len(data)} bytes for positions [{prev}, {end})")
        if not 0 <= flags <= 0xFF:
            raise ChunkFormatError(f"record {i}: flags {flags} do not fit a byte")
        index += _ENTRY.pack(end, flags)
        prev = end
    if prev != header.end:
        raise ChunkFormatError(f"records end at {prev}, header says {header.end}")
    head = header.to_json()
    if len(head) > MAX_HEADER_LENGTH:
        raise ChunkFormatError(f"chunk header too large ({len(head)} bytes)")
    prelude = _PRELUDE.pack(MAGIC, VERSION, len(head), len(index), header.end - header.start)
    return b"".join([prelude, head, bytes(index), *(data for _, _, data in records)])


def parse_prelude(b: bytes | memoryview) -> Prelude:
    """The first PRELUDE_SIZE bytes of an object (more are ignored)."""
    if len(b) < PRELUDE_SIZE:
        raise ChunkFormatError(f"truncated prelude: {len(b)} of {PRELUDE_SIZE} bytes")
    magic, version, hlen, ilen, dlen = _PRELUDE.unpack_from(b)
    if magic != MAGIC:
        raise ChunkFormatError(f"not a ds3 chunk (magic {bytes(magic)!r})")
    if version != VERSION:
        raise ChunkFormatError(f"unsupported chunk format version {version}")
    if not 0 < hlen <= MAX_HEADER_LENGTH:
        raise ChunkFormatError(f"implausible header length {hlen}")
    if ilen == 0 or ilen % INDEX_ENTRY_SIZE:
        raise ChunkFormatError(f"index length {ilen} is not a positive multiple of {INDEX_ENTRY_SIZE}")
    if dlen == 0:
        raise ChunkFormatError("chunk has no data")
    return Prelude(version, hlen, ilen, dlen)


def parse_head(b: bytes | memoryview) -> ChunkHead:
    """Parse prelude, header and index from the object's first bytes: at least
    Prelude.head_size of them; any data bytes after that are ignored."""
    p = parse_prelude(b)
    hend = PRELUDE_SIZE + p.header_length
    if len(b) < hend:
        raise ChunkFormatError(f"truncated header: {len(b)} of {hend} bytes")
    if len(b) < p.head_size:
        raise ChunkFormatError(f"truncated index: {len(b)} of {p.head_size} bytes")
    header = ChunkHeader.from_json(bytes(b[PRELUDE_SIZE:hend]))
    n = p.index_length // INDEX_ENTRY_SIZE
    if header.records != n:
        raise ChunkFormatError(f"header says {header.records} records, index has {n}")
    if header.end - header.start != p.data_length or header.start < 0:
        raise ChunkFormatError(f"positions [{header.start}, {header.end}) do not match "
                               f"{p.data_length} data bytes")
    entries = list(_ENTRY.iter_unpack(b[hend : p.head_size]))
    ends = tuple(e for e, _ in entries)
    prev = header.start
    for i, end in enumerate(ends):
        if end <= prev:
            raise ChunkFormatError(f"index entry {i}: end {end} does not follow {prev}")
        prev = end
    if prev != header.end:
        raise ChunkFormatError(f"index ends at {prev}, header says {header.end}")
    return ChunkHead(header, ends, bytes(f for _, f in entries), p.head_size, p.object_size)


def iter_records(head: ChunkHead, data: bytes | memoryview) -> Iterator[Record]:
    """The records, given the data section (or the whole object)."""
    size = head.header.end - head.header.start
    view = memoryview(data)
    if len(view) == head.object_size:
        view = view[head.data_offset :]
    elif len(view) != size:
        raise ChunkFormatError(f"expected {size} data bytes (or the {head.object_size}-byte object), "
                               f"got {len(view)}")
    base = head.header.start
    for span in head.spans():
        yield Record(span.start, span.end, span.flags, bytes(view[span.start - base : span.end - base]))


def messages_in(head: ChunkHead, start: int, end: int, data: bytes | memoryview) -> Iterator[tuple[int, bytes]]:
    """(end position, bytes) of each message in `data`, the chunk's positions [start, end).
    `start` must be a message boundary; a message running past `end` is cut there (a fork
    position inside an append)."""
    view = memoryview(data)
    if len(view) != end - start:
        raise ValueError(f"expected {end - start} bytes for positions [{start}, {end}), got {len(view)}")
    if start >= end:
        return
    prev = start
    for i in range(bisect_right(head.ends, start), len(head.ends)):
        stop = min(head.ends[i], end)
        yield stop, bytes(view[prev - start : stop - start])
        prev = stop
        if stop >= end:
            break


def decode_chunk(b: bytes | memoryview) -> tuple[ChunkHead, list[Record]]:
    """A whole object: its head and every record."""
    head = parse_head(b)
    if len(b) < head.object_size:
        raise ChunkFormatError(f"truncated data: {len(b)} of {head.object_size} bytes")
    if len(b) > head.object_size:
        raise ChunkFormatError(f"{len(b) - head.object_size} bytes after the chunk's data")
    return head, list(iter_records(head, b))
