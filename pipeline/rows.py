"""Rows of the `ds3` data source: one per message, decoded from a chunk object with the same
pure chunk-format code the reader serves from (shared/chunks.py), or parsed from a tail page.

A message is one record of a chunk: one append of a byte stream, or one JSON value of a JSON
stream (stored with a trailing ',', which rows do not carry). `value` is the message as text
for text/* and JSON streams (invalid UTF-8 replaced), else null. Rows are built as Arrow
record batches: Spark takes them without a per-row Python conversion.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]

from pipeline import columnar
from pipeline.catalog import ChunkRef
from shared import chunks, jsonmode, offsets, protocol

SCHEMA_DDL = (
    "stream string, offset string, next_offset string, message binary, value string, "
    "content_type string, chunk long, position long, bucket string, sealed_at timestamp"
)
ARROW_SCHEMA = pa.schema([
    ("stream", pa.string()), ("offset", pa.string()), ("next_offset", pa.string()),
    ("message", pa.binary()), ("value", pa.string()), ("content_type", pa.string()),
    ("chunk", pa.int64()), ("position", pa.int64()), ("bucket", pa.string()),
    ("sealed_at", pa.timestamp("us", tz="UTC")),
])
COLUMNS: Final = tuple(ARROW_SCHEMA.names)
SPARK_TYPES: Final = dict(column.split(" ") for column in SCHEMA_DDL.split(", "))


def has_text(content_type: str) -> bool:
    mt = protocol.media_type(content_type)
    return mt.startswith("text/") or protocol.is_json(content_type)


@dataclass(frozen=True, slots=True)
class Target:
    """Which stream rows belong to, and the positions wanted: messages that start at or after
    `lo` and end at or before `hi` (None: no bound)."""

    stream: str
    bucket: str | None
    content_type: str
    lo: int = 0
    hi: int | None = None


class _Columns:
    def __init__(self, target: Target) -> None:
        self.t = target
        self.json = protocol.is_json(target.content_type)
        self.text = has_text(target.content_type)
        self.offset: list[str] = []
        self.next_offset: list[str] = []
        self.message: list[bytes] = []
        self.value: list[str | None] = []
        self.chunk: list[int | None] = []
        self.position: list[int] = []
        self.sealed_at: list[int | None] = []

    def add(self, message: bytes, offset: str, next_offset: str, position: int,
            chunk: int | None, sealed_at_us: int | None) -> None:
        self.offset.append(offset)
        self.next_offset.append(next_offset)
        self.message.append(message)
        self.value.append(message.decode("utf-8", "replace") if self.text else None)
        self.chunk.append(chunk)
        self.position.append(position)
        self.sealed_at.append(sealed_at_us)

    def batch(self) -> pa.RecordBatch:
        n = len(self.offset)
        const: dict[str, Any] = {"stream": self.t.stream, "content_type": self.t.content_type,
                                 "bucket": self.t.bucket}
        arrays = [
            pa.array([const["stream"]] * n, pa.string()), pa.array(self.offset, pa.string()),
            pa.array(self.next_offset, pa.string()), pa.array(self.message, pa.binary()),
            pa.array(self.value, pa.string()), pa.array([const["content_type"]] * n, pa.string()),
            pa.array(self.chunk, pa.int64()), pa.array(self.position, pa.int64()),
            pa.array([const["bucket"]] * n, pa.string()),
            pa.array(self.sealed_at, pa.timestamp("us", tz="UTC")),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


def chunk_batch(target: Target, ref: ChunkRef, obj: bytes, columns: Sequence[str] = COLUMNS) -> pa.RecordBatch:
    """The wanted messages of one chunk object (`obj`: the whole object), with `columns` (a
    projection of the schema, in that order): columnar (pipeline/columnar.py) where it applies,
    building only those columns, else message by message (chunk_batch_rows)."""
    wanted = frozenset(columns)
    text = has_text(target.content_type) and "value" in wanted
    cols = columnar.chunk_columns(
        obj, chunk=ref.chunk, start_offset=ref.start_offset, cap=ref.end, lo=target.lo, hi=target.hi,
        json_mode=protocol.is_json(target.content_type), text=text,
        offsets=not wanted.isdisjoint(("offset", "next_offset")), data=not wanted.isdisjoint(("message", "value")))
    if cols is None:
        return project(chunk_batch_rows(target, ref, obj), columns)
    head = chunks.parse_prelude(obj)
    header = chunks.ChunkHeader.from_json(bytes(obj[chunks.PRELUDE_SIZE:chunks.PRELUDE_SIZE + head.header_length]))
    if header.chunk != ref.chunk or header.start != ref.start:
        raise chunks.ChunkFormatError(f"{ref.key}: header names chunk {header.chunk} at "
                                      f"{header.start}, expected {ref.chunk} at {ref.start}")
    n = len(cols)
    build: dict[str, Callable[[], pa.Array]] = {
        "stream": lambda: pa.repeat(pa.scalar(target.stream, pa.string()), n),
        "offset": lambda: cols.offset,
        "next_offset": lambda: cols.next_offset,
        "message": lambda: cols.message,
        "value": lambda: cols.value if text else pa.nulls(n, pa.string()),
        "content_type": lambda: pa.repeat(pa.scalar(target.content_type, pa.string()), n),
        "chunk": lambda: pa.array(np.full(n, ref.chunk, dtype=np.int64)),
        "position": lambda: pa.array(cols.position),
        "bucket": lambda: pa.repeat(pa.scalar(target.bucket, pa.string()), n),
        "sealed_at": lambda: pa.array(np.full(n, int(header.created_at * 1_000_000), dtype=np.int64))
        .cast(pa.timestamp("us", tz="UTC")),
    }
    return pa.RecordBatch.from_arrays([build[c]() for c in columns], schema=schema_of(columns))


def project(batch: pa.RecordBatch, columns: Sequence[str]) -> pa.RecordBatch:
    """`batch` (every column) with only `columns`, in that order."""
    return batch if tuple(columns) == COLUMNS else batch.select(list(columns))


def schema_of(columns: Sequence[str]) -> pa.Schema:
    return ARROW_SCHEMA if tuple(columns) == COLUMNS else pa.schema([ARROW_SCHEMA.field(c) for c in columns])


def chunk_batch_rows(target: Target, ref: ChunkRef, obj: bytes) -> pa.RecordBatch:
    """chunk_batch message by message (the reference the columnar path is tested against)."""
    head, records = chunks.decode_chunk(obj)
    if head.header.chunk != ref.chunk or head.header.start != ref.start:
        raise chunks.ChunkFormatError(f"{ref.key}: header names chunk {head.header.chunk} at "
                                      f"{head.header.start}, expected {ref.chunk} at {ref.start}")
    cols = _Columns(target)
    sealed_us = int(head.header.created_at * 1_000_000)
    prev_offset = ref.start_offset
    for rec in records:
        if rec.start >= ref.end:
            break  # past a fork position: the fork's own chunks hold what follows
        data, end = rec.data, rec.end
        if end > ref.end:  # a fork position inside a message (byte streams: sub-offsets)
            data, end = data[: ref.end - rec.start], ref.end
        next_offset = offsets.encode(ref.chunk, end)
        if rec.start >= target.lo and (target.hi is None or end <= target.hi):
            cols.add(jsonmode.unframe(data) if cols.json else data, prev_offset, next_offset,
                     rec.start, ref.chunk, sealed_us)
        prev_offset = next_offset
    return cols.batch()


@dataclass(frozen=True, slots=True)
class Page:
    """One catch-up response of the tail: body, the offset asked for and Stream-Next-Offset."""

    offset: str
    next_offset: str
    body: bytes


def tail_batch(target: Target, pages: list[Page],
               inherited: Sequence[tuple[int, int, int]] = ()) -> pa.RecordBatch:
    """Rows of tail pages read over HTTP. JSON pages split into their messages; a byte
    stream's page is one row (HTTP does not mark where its appends began), cut at `hi`.

    The offsets of messages inside a JSON page name the page's chunk; only when a page spans
    a chunk roll (rare: a rolled chunk not uploaded yet) do they name its last chunk, which
    the server reads the same way. A fork's page that spans an ancestor's unsealed part
    (`inherited`: StreamPlan.inherited_tail) names that ancestor's chunk for positions in it."""
    cols = _Columns(target)
    for page in pages:
        start = offsets.ZERO if page.offset == offsets.START else offsets.parse(page.offset)
        end = offsets.parse(page.next_offset)
        if cols.json:
            pieces = jsonmode.split_messages(page.body, allow_empty_array=True)
        else:
            pieces = [page.body] if page.body else []
        chunk_id = end.chunk
        pos, prev = start.position, page.offset
        for i, m in enumerate(pieces):
            stop = pos + len(m) + (1 if cols.json else 0)
            if target.hi is not None and stop > target.hi:
                if cols.json or pos >= target.hi:
                    return cols.batch()
                m, stop = m[: target.hi - pos], target.hi
            chunk = next((c for lo, hi, c in inherited if lo < stop <= hi), chunk_id) if inherited else chunk_id
            nxt = page.next_offset if i == len(pieces) - 1 and stop == end.position else offsets.encode(chunk, stop)
            if pos >= target.lo:
                cols.add(m, prev, nxt, pos, None, None)
            pos, prev = stop, nxt
    return cols.batch()


def iter_batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Drop empty batches (Spark needs none of them)."""
    for b in batches:
        if b.num_rows:
            yield b
