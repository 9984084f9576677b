"""A chunk object as Arrow columns without a Python step per message (issue 16).

The chunk format (shared/chunks.py) already holds what rows need in bulk: the record index is
an array of (end u64 BE, flags u8), and every record's bytes lie in the data section in order.
So boundaries, positions and offsets are numpy arithmetic over the index, and the message
column is the data section itself with an offsets buffer: zero-copy for byte streams (messages
are contiguous), one copy for JSON streams (pyarrow's binary_slice drops the ',' each stored
message ends with, which rows do not carry). Offsets (`<chunk:016d>_<position:016d>`) are
spelled digit by digit in a (rows + 1) x 33 byte matrix, which `offset` and `next_offset`
share (each row's next offset is the next row's offset). Only the columns asked for are built.

`chunk_columns` answers None where this path does not apply (text that is not valid UTF-8,
whose `value` the row path decodes with replacement; an object whose index disagrees with its
header; more than 2 GiB of messages; offsets wider than 16 digits): the caller then takes the row path, which also raises
the format errors. Pure: numpy and pyarrow only.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from shared import chunks

_INDEX: Final = np.dtype([("end", ">u8"), ("flags", "u1")])
_POW10: Final = 10 ** np.arange(15, -1, -1, dtype=np.uint64)
_OFFSET_WIDTH: Final = 33  # 16 digits, '_', 16 digits
_COMMA: Final = ord(",")
_MAX_BINARY: Final = 2**31 - 1
_MAX_SPELLED: Final = 10**16  # offsets spell positions and chunk ids in 16 digits


def offset_strings(chunk: int, position: np.ndarray, first: str | None = None) -> pa.StringArray:
    """Offsets `chunk_position` for every position, both fields zero-padded to 16 digits (each
    below 10**16); `first`, when given, spells the first one instead (a chunk's first offset
    names the chunk before it)."""
    n = len(position)
    out = np.empty((n, _OFFSET_WIDTH), dtype=np.uint8)
    out[:, :16] = (np.uint64(chunk) // _POW10) % 10 + 48
    out[:, 16] = ord("_")
    out[:, 17:] = (position.astype(np.uint64)[:, None] // _POW10) % 10 + 48
    offsets = np.arange(0, _OFFSET_WIDTH * (n + 1), _OFFSET_WIDTH, dtype=np.int32)
    if first is not None and n:
        spelled = first.encode("ascii")
        if len(spelled) != _OFFSET_WIDTH:  # (offsets are always 33 characters below 10**16)
            rest = pa.StringArray.from_buffers(n - 1, pa.py_buffer(offsets[:n]), pa.py_buffer(out[1:]))
            return pa.concat_arrays([pa.array([first], pa.string()), rest])
        out[0] = np.frombuffer(spelled, dtype=np.uint8)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(out))


class ChunkColumns:
    """The wanted messages of one chunk: their positions, offsets and bytes, as arrays
    (offsets and bytes only where asked for: None otherwise)."""

    __slots__ = ("message", "next_offset", "offset", "position", "value")

    def __init__(self, position: np.ndarray, offset: pa.StringArray | None, next_offset: pa.StringArray | None,
                 message: pa.BinaryArray | None, value: pa.StringArray | None) -> None:
        self.position = position
        self.offset = offset
        self.next_offset = next_offset
        self.message = message
        self.value = value

    def __len__(self) -> int:
        return len(self.position)


def chunk_columns(obj: bytes, *, chunk: int, start_offset: str, cap: int, lo: int, hi: int | None,
                  json_mode: bool, text: bool, offsets: bool = True, data: bool = True) -> ChunkColumns | None:
    """Messages of the chunk object `obj` (whole) that start at or after `lo` and end at or
    before `hi`, cut at `cap` (a fork position: later records are the fork's own); `start_offset`
    is the offset of the chunk's first position. `offsets` / `data`: whether to build the
    offset columns / the message (and, for text, value) columns. None: take the row path (see
    the module doc)."""
    p = chunks.parse_prelude(obj)
    hend = chunks.PRELUDE_SIZE + p.header_length
    header = chunks.ChunkHeader.from_json(bytes(obj[chunks.PRELUDE_SIZE:hend]))
    n = p.index_length // chunks.INDEX_ENTRY_SIZE
    if header.records != n or len(obj) < p.object_size or header.end - header.start != p.data_length:
        return None
    if header.end >= _MAX_SPELLED or chunk >= _MAX_SPELLED:
        return None  # offsets wider than 16 digits: the row path spells them
    ends = np.frombuffer(obj, dtype=_INDEX, count=n, offset=hend)["end"].astype(np.int64)
    starts = np.empty(n, dtype=np.int64)
    starts[0] = header.start
    starts[1:] = ends[:-1]
    if not (np.all(ends > starts) and ends[-1] == header.end):
        return None
    cut = np.minimum(ends, cap)
    keep = (starts < cap) & (starts >= lo)
    if hi is not None:
        keep &= cut <= hi
    # Records are in stream order and the bounds are positions, so the wanted ones are one run
    # [first, first + count): their stored bytes are contiguous, each starting where the one
    # before it ends.
    wanted = np.flatnonzero(keep)
    count = len(wanted)
    first = int(wanted[0]) if count else 0
    s = starts[first:first + count]
    e = cut[first:first + count]
    message = value = None
    if data:
        got = _messages(obj, s, e, p.head_size - header.start, json_mode, text)
        if got is None:
            return None
        message, value = got
    offset = next_offset = None
    if offsets:
        # offset i is the position before record i, next_offset i the one after it: the
        # same spellings shifted by one (records are contiguous), so one array of count + 1
        # strings serves both as two zero-copy slices
        bounds = np.empty(count + 1, dtype=np.int64)
        bounds[:count] = s
        bounds[count:] = e[-1] if count else lo
        spelled = offset_strings(chunk, bounds, start_offset if count and first == 0 else None)
        offset, next_offset = spelled.slice(0, count), spelled.slice(1, count)
    return ChunkColumns(s, offset, next_offset, message, value)


def _messages(obj: bytes, s: np.ndarray, e: np.ndarray, data_at: int, json_mode: bool,
              text: bool) -> tuple[pa.BinaryArray, pa.StringArray | None] | None:
    """The `message` and `value` columns of the consecutive records [s, e) (stream positions;
    `data_at`: the object byte offset of stream position 0). None: take the row path."""
    count = len(s)
    lo_byte, hi_byte = s + data_at, e + data_at
    if count and int(hi_byte[-1] - lo_byte[0]) > _MAX_BINARY:
        return None
    bounds = np.empty(count + 1, dtype=np.int32)
    if count:
        bounds[:count] = lo_byte - lo_byte[0]
        bounds[count] = hi_byte[-1] - lo_byte[0]
        stored = pa.py_buffer(memoryview(obj)[int(lo_byte[0]):int(hi_byte[-1])])
    else:
        bounds[0] = 0
        stored = pa.py_buffer(b"")
    # the stored records, zero-copy: a byte stream's messages as they are
    message = pa.BinaryArray.from_buffers(pa.binary(), count, [None, pa.py_buffer(bounds), stored])
    if json_mode and count:
        # a stored JSON message ends with ',' (a fork cut at a message boundary keeps it), which
        # rows do not carry: one copy of the messages without it
        raw = np.frombuffer(obj, dtype=np.uint8)
        if not np.all(raw[hi_byte - 1] == _COMMA):
            return None  # (a record without its ',': not written by ds3) the row path decides
        message = pc.binary_slice(message, 0, -1)
    value = None
    if text:
        value = pa.StringArray.from_buffers(count, message.buffers()[1], message.buffers()[2])
        try:
            value.validate(full=True)
        except pa.ArrowInvalid:  # not UTF-8: the row path decodes with replacement
            return None
    return message, value
