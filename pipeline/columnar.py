"""A chunk object as Arrow columns without a Python step per message (issue 16).

The chunk format (shared/chunks.py) already holds what rows need in bulk: the record index is
an array of (end u64 BE, flags u8), and every record's bytes lie in the data section in order.
So boundaries, positions and offsets are numpy arithmetic over the index, and the message
column is the data section itself with an offsets buffer: zero-copy for byte streams (messages
are contiguous), one vectorised gather for JSON streams (each stored message ends with a ','
that rows do not carry). Offsets (`<chunk:016d>_<position:016d>`) are spelled digit by digit
in a (rows x 33) byte matrix.

`chunk_columns` answers None where this path does not apply (text that is not valid UTF-8,
whose `value` the row path decodes with replacement; an object whose index disagrees with its
header; more than 2 GiB of messages): the caller then takes the row path, which also raises
the format errors. Pure: numpy and pyarrow only.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]

from shared import chunks

_INDEX: Final = np.dtype([("end", ">u8"), ("flags", "u1")])
_POW10: Final = 10 ** np.arange(15, -1, -1, dtype=np.uint64)
_OFFSET_WIDTH: Final = 33  # 16 digits, '_', 16 digits
_COMMA: Final = ord(",")
_MAX_BINARY: Final = 2**31 - 1


def offset_strings(chunk: np.ndarray, position: np.ndarray) -> pa.StringArray:
    """Offsets `chunk_position` for every row, both fields zero-padded to 16 digits."""
    n = len(position)
    out = np.empty((n, _OFFSET_WIDTH), dtype=np.uint8)
    out[:, :16] = (chunk.astype(np.uint64)[:, None] // _POW10) % 10 + 48
    out[:, 16] = ord("_")
    out[:, 17:] = (position.astype(np.uint64)[:, None] // _POW10) % 10 + 48
    offsets = np.arange(0, _OFFSET_WIDTH * (n + 1), _OFFSET_WIDTH, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(out))


class ChunkColumns:
    """The wanted messages of one chunk: their positions, offsets and bytes, as arrays."""

    __slots__ = ("message", "next_offset", "offset", "position", "value")

    def __init__(self, position: np.ndarray, offset: pa.StringArray, next_offset: pa.StringArray,
                 message: pa.BinaryArray, value: pa.StringArray | None) -> None:
        self.position = position
        self.offset = offset
        self.next_offset = next_offset
        self.message = message
        self.value = value

    def __len__(self) -> int:
        return len(self.position)


def chunk_columns(obj: bytes, *, chunk: int, start_offset: str, cap: int, lo: int, hi: int | None,
                  json_mode: bool, text: bool) -> ChunkColumns | None:
    """Messages of the chunk object `obj` (whole) that start at or after `lo` and end at or
    before `hi`, cut at `cap` (a fork position: later records are the fork's own); `start_offset`
    is the offset of the chunk's first position. None: take the row path (see the module doc)."""
    p = chunks.parse_prelude(obj)
    hend = chunks.PRELUDE_SIZE + p.header_length
    header = chunks.ChunkHeader.from_json(bytes(obj[chunks.PRELUDE_SIZE:hend]))
    n = p.index_length // chunks.INDEX_ENTRY_SIZE
    if header.records != n or len(obj) < p.object_size or header.end - header.start != p.data_length:
        return None
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
    # the offset before each record: the chunk's start offset, then the previous record's end
    before = np.nonzero(keep)[0]
    s, e = starts[before], cut[before]
    data_at = p.head_size - header.start  # object byte offset of stream position 0 of this chunk
    lo_byte, hi_byte = s + data_at, e + data_at
    raw = np.frombuffer(obj, dtype=np.uint8)
    if json_mode:  # a stored JSON message ends with ',': rows carry the message alone
        hi_byte = hi_byte - (raw[hi_byte - 1] == _COMMA)
    lengths = hi_byte - lo_byte
    total = int(lengths.sum())
    if total > _MAX_BINARY:
        return None
    bounds = np.zeros(len(before) + 1, dtype=np.int32)
    np.cumsum(lengths, out=bounds[1:])
    if len(before) and np.all(lo_byte[1:] == hi_byte[:-1]):  # contiguous: the object's own bytes
        data = pa.py_buffer(memoryview(obj)[int(lo_byte[0]):int(hi_byte[-1])])
    elif len(before):  # JSON: the stored run of messages without the ',' after each (one copy)
        first, last = int(lo_byte[0]), int(e[-1] + data_at)
        stored_contiguous = np.all(s[1:] == e[:-1])
        if stored_contiguous:
            keep_byte = np.ones(last - first, dtype=bool)
            keep_byte[hi_byte[hi_byte < e + data_at] - first] = False
            data = pa.py_buffer(raw[first:last][keep_byte])
        else:  # (cannot happen: the wanted records are consecutive) a gather of every message
            take = np.repeat(lo_byte - bounds[:-1], lengths) + np.arange(total, dtype=np.int64)
            data = pa.py_buffer(raw[take])
    else:
        data = pa.py_buffer(b"")
    offsets_buf = pa.py_buffer(bounds)
    message = pa.BinaryArray.from_buffers(pa.binary(), len(before), [None, offsets_buf, data])
    value: Any = None
    if text:
        value = pa.StringArray.from_buffers(len(before), offsets_buf, data)
        try:
            value.validate(full=True)
        except pa.ArrowInvalid:  # not UTF-8: the row path decodes with replacement
            return None
    prev = np.empty(len(before), dtype=np.int64)
    prev[:] = s
    chunk_ids = np.full(len(before), chunk, dtype=np.int64)
    offset = offset_strings(chunk_ids, prev)
    if len(before) and before[0] == 0:  # the chunk's first record: its offset may name the previous chunk
        offset = pa.concat_arrays([pa.array([start_offset], pa.string()), offset[1:]])
    return ChunkColumns(s, offset, offset_strings(chunk_ids, e), message, value)
