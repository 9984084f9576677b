"""LMDB layout of the write-ahead log, and the encodings of what it stores.

Named databases in one environment (`<data-dir>/wal`):

    streams    key: stream path (UTF-8)                 value: StreamMeta as JSON
    records    key: sid u64 BE | end position u64 BE    value: RecordHeader | message bytes
    journal    key: serial u64 BE                       value: see journal.py (appends land there first)
    jtail      key: sid u64 BE                          value: serial of the stream's newest journal record
    producers  key: sid u64 BE | producer id (UTF-8)    value: [epoch, last_seq, updated_at] JSON
    chunks     key: sid u64 BE | chunk id u64 BE        value: ChunkInfo as JSON (the manifest)
    sys        key: b"next_sid"                         value: u64 BE (the next stream's sid)
               key: b"gc:" uid                          value: path (a removed stream's objects to delete)
               key: b"pub:" path                        value: b"" (a descriptor to publish again)
               key: b"del:" object key                  value: b"" (an unreachable object to delete, retention.py)
               key: b"cursor_secret"                    value: 32 random bytes (sealed listing cursors, listing.py)
               key: b"commit_seq"                       value: u64 BE, the last logged commit's seq (wal.py)
               key: b"store"                            value: the store this WAL logs to (wal_binding.py)
    buckets    key: bucket id (ASCII)                   value: BucketMeta as JSON (ingester/buckets.py)

One record is one message: one append of a byte stream, or one element of a JSON append.
Its key holds the stream position just after its last byte, so `set_range(sid, p + 1)`
finds the record that contains position p. The record value starts with a 9-byte header:

    0        8   9
    +--------+---+---------------------+
    | chunk  | f | message bytes ...   |
    +--------+---+---------------------+
    chunk: u64 BE id of the chunk the record belongs to (offsets name it)
    f:     flags; bit 0 = last message of its append (JSON batch boundary)

`sid` is the stream's internal id in this WAL: never reused, so a deleted and re-created
path never sees old records. `uid` (128 random bits, hex) names the stream in the object
store, where several ingesters share one bucket.

A chunk is open while records are appended to it; rolling it (size, age, or close) marks it
`sealing` in the manifest and starts the next chunk. Once its object is uploaded and
confirmed it is `sealed` and its records are dropped from `records`. This module is pure (no lmdb import): it only encodes and decodes.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass, field
from typing import Final

import orjson

from shared import offsets

RECORD_HEADER: Final = struct.Struct(">QB")
KEY: Final = struct.Struct(">QQ")
SID: Final = struct.Struct(">Q")
FLAG_END_OF_APPEND: Final = 1


FIRST_CHUNK_SPREAD: Final = 10**12


def new_first_chunk(after: int = -1) -> int:
    """A stream's first chunk id: random, so that a path deleted and created again issues
    offsets its earlier incarnation never did, and no cache (CDN, browser) can answer an
    offset URL of the new stream with the old stream's bytes. Chunk ids only need to rise
    within a stream; a fork's start after the chunk that names its fork position."""
    return after + 1 + secrets.randbelow(FIRST_CHUNK_SPREAD)


@dataclass(slots=True)
class StreamMeta:
    path: str
    sid: int
    content_type: str
    created_at: float
    last_access: float
    uid: str = ""
    tail: int = 0  # committed end position
    tail_chunk: int = 0  # chunk id that names the tail offset
    first_chunk: int = 0  # this incarnation's first chunk id (random: see new_first_chunk)
    chunk: int = 0  # chunk that new records go to
    chunk_start: int = 0  # position where that chunk begins
    chunk_opened_at: float | None = None  # when its first record arrived (age-based sealing)
    ttl: int | None = None
    expires_at: float | None = None
    expires_at_text: str | None = None
    closed: bool = False
    closed_by: list[str | int] | None = None  # [producer id, epoch, seq] of the closing append
    stream_seq: str | None = None
    fork_source: str | None = None
    fork_source_sid: int | None = None
    fork_source_uid: str | None = None
    # Where this WAL holds the source when it lives on another ingester: a read-only shadow
    # of its sealed chain (ingester/remote_forks.py). None: at `fork_source`, in this WAL.
    fork_source_key: str | None = None
    fork_position: int = 0
    fork_offset: str | None = None  # as the client asked for it (idempotent re-create)
    fork_sub_offset: int = 0
    refcount: int = 0  # forks reading this stream's data
    soft_deleted: bool = False
    # The latest visible snapshot (extensions §2): its offset is the earliest retained one.
    snapshot_offset: str | None = None
    snapshot_type: str = ""
    snapshot_size: int = 0
    snapshot_key: str | None = None  # its object (a fork's may be its source's)
    released: int = 0  # sealed chunks ending at or before this position were deleted (retention)
    # its own superseded snapshot blobs, kept while forks read the stream (deleted once none does)
    retired_snapshots: list[str] | None = None
    # Last append with data, as of the last metadata write (plain appends do not rewrite the
    # metadata: the writer keeps newer times in memory, see Store.last_writes). None: never.
    last_write_at: float | None = None
    # Frozen: [ingester id, url, cluster generation] this stream was exported to (ingester/moves.py).
    # Nothing writes it any more; the new owner's move-done (or the move sweep) drops it.
    moved_to: list[str | int] | None = None

    @property
    def source_key(self) -> str | None:
        """The `streams` key of the stream this one forks (a shadow for a remote source)."""
        return self.fork_source_key or self.fork_source

    @property
    def tail_offset(self) -> str:
        return offsets.encode(self.tail_chunk, self.tail)

    @property
    def earliest(self) -> int:
        """The earliest retained position: reads before it answer 410."""
        return offsets.parse(self.snapshot_offset).position if self.snapshot_offset else 0

    def deadline(self, touched: float | None = None) -> float | None:
        """When the stream expires (TTL slides with reads and writes), or None."""
        candidates: list[float] = []
        if self.expires_at is not None:
            candidates.append(self.expires_at)
        if self.ttl is not None:
            candidates.append(max(self.last_access, touched or 0.0) + self.ttl)
        return min(candidates) if candidates else None

    def expired(self, now: float, touched: float | None = None) -> bool:
        d = self.deadline(touched)
        return d is not None and now >= d

    def encode(self) -> bytes:
        return orjson.dumps(self)

    @staticmethod
    def decode(raw: bytes | memoryview) -> StreamMeta:
        fields = orjson.loads(raw)
        fields.pop("messages", None)  # written by earlier versions
        fields.pop("chunk_records", None)
        return StreamMeta(**fields)


SEALING: Final = "sealing"
SEALED: Final = "sealed"


@dataclass(slots=True)
class ChunkInfo:
    """One rolled chunk of a stream: [start, end) in stream positions."""

    start: int
    end: int
    records: int  # 0 until known (the uploader counts them)
    closed: bool  # the stream was closed at `end` (the stream's final chunk)
    sealed_at: float
    state: str = SEALING
    # The sid the chunk object's header names when the chunk was rolled on another ingester
    # (a moved stream's `sealing` chunk): its re-upload must be byte-identical (readers cache
    # object heads). None: this WAL's sid.
    header_sid: int | None = None

    def encode(self) -> bytes:
        return orjson.dumps(self)

    @staticmethod
    def decode(raw: bytes | memoryview) -> ChunkInfo:
        return ChunkInfo(**orjson.loads(raw))


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """A chunk to upload: enough to find its records and name its object."""

    path: str
    sid: int
    uid: str
    chunk: int


@dataclass(slots=True)
class ProducerState:
    epoch: int
    last_seq: int
    updated_at: float

    def encode(self) -> bytes:
        return orjson.dumps([self.epoch, self.last_seq, self.updated_at])

    @staticmethod
    def decode(raw: bytes | memoryview) -> ProducerState:
        epoch, last_seq, updated_at = orjson.loads(raw)
        return ProducerState(int(epoch), int(last_seq), float(updated_at))


@dataclass(slots=True)
class Record:
    """A message as read back: [start, end) in stream positions."""

    end: int
    chunk: int
    flags: int
    data: bytes = field(repr=False)

    @property
    def start(self) -> int:
        return self.end - len(self.data)


def record_key(sid: int, end: int) -> bytes:
    return KEY.pack(sid, end)


def chunk_key(sid: int, chunk: int) -> bytes:
    return KEY.pack(sid, chunk)


def producer_key(sid: int, producer_id: str) -> bytes:
    return SID.pack(sid) + producer_id.encode("utf-8")


def encode_record(chunk: int, flags: int, data: bytes) -> bytes:
    return RECORD_HEADER.pack(chunk, flags) + data


def decode_record(key: bytes | memoryview, value: bytes | memoryview) -> Record:
    _sid, end = KEY.unpack(key)
    chunk, flags = RECORD_HEADER.unpack_from(value)
    return Record(end, chunk, flags, bytes(value[RECORD_HEADER.size :]))
