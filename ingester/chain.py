"""Reading a stream's messages from the WAL, across fork boundaries and sealed chunks.

A fork reads positions below its fork position from its source (recursively, the source
may itself be a fork), capped at the fork position, and its own records above it. Records
of sealed chunks are no longer in the WAL: where a read reaches one, it yields a `Sealed`
marker naming the chunk object and stops, and the caller fetches that range from the
object store. A stream's newest messages may still be in the journal (journal.py): they
follow its `records` entries. Used by read transactions and by the writer (fork sub-offsets,
chunk uploads)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import lmdb

from ingester import journal
from ingester.records import (
    KEY,
    SEALED,
    SID,
    ChunkInfo,
    Record,
    StreamMeta,
    chunk_key,
    decode_record,
    record_key,
)

MetaLookup = Callable[[str], StreamMeta | None]


class Dbs(Protocol):
    records: lmdb._Database
    chunks: lmdb._Database
    journal: lmdb._Database
    jtail: lmdb._Database


@dataclass(frozen=True, slots=True)
class Sealed:
    """Positions [start, end) of `uid`'s chunk `chunk` live only in the object store."""

    uid: str
    chunk: int
    start: int
    end: int
    info: ChunkInfo


def refresh_tail(txn: lmdb.Transaction, dbs: Dbs, meta: StreamMeta, now: float) -> StreamMeta:
    """Bring a stored StreamMeta up to date with its records.

    Plain appends do not rewrite the stream's metadata (a record put is the whole write):
    the tail is where the stream's last record ends, when that is past the stored tail.
    """
    last = journal.newest(txn, dbs, meta.sid) or _last_record(txn, dbs, meta.sid)
    if last is not None and last.end > meta.tail:
        meta.tail = last.end
        meta.tail_chunk = last.chunk
    if meta.chunk_opened_at is None and meta.tail > meta.chunk_start:
        meta.chunk_opened_at = now  # the open chunk has data; its age counts from now
    return meta


def _last_record(txn: lmdb.Transaction, dbs: Dbs, sid: int) -> Record | None:
    cur = txn.cursor(dbs.records)
    found = cur.prev() if cur.set_range(record_key(sid + 1, 0)) else cur.last()
    if found and cur.key()[:8] == SID.pack(sid):
        return decode_record(cur.key(), cur.value())
    return None


def stream_records(txn: lmdb.Transaction, dbs: Dbs, sid: int, position: int) -> Iterator[Record]:
    """The WAL's records of one stream ending after `position`, in order: `records` entries,
    then the journal's. Sealed chunks leave gaps (a record starting past the previous end)."""
    prefix = SID.pack(sid)
    cur = txn.cursor(dbs.records)
    if cur.set_range(record_key(sid, position + 1)):
        for key, value in cur:
            if key[:8] != prefix:
                break
            rec = decode_record(key, value)
            yield rec
            position = rec.end
    yield from journal.records_after(txn, dbs, sid, position)


def sealed_chunk_at(txn: lmdb.Transaction, dbs: Dbs, meta: StreamMeta, position: int) -> tuple[int, ChunkInfo] | None:
    """The sealed chunk holding `position`. Chunk ids and positions rise together, so this is
    a binary search over the manifest's ids: O(log chunks) seeks, not a walk from the first
    chunk on every sealed read (ids may have gaps where retention dropped old chunks)."""
    prefix = SID.pack(meta.sid)
    cur = txn.cursor(dbs.chunks)

    def first_from(chunk: int) -> tuple[int, ChunkInfo] | None:
        """The manifest's first chunk with an id >= `chunk`."""
        if not cur.set_range(chunk_key(meta.sid, chunk)) or cur.key()[:8] != prefix:
            return None
        return KEY.unpack(cur.key())[1], ChunkInfo.decode(cur.value())

    found = first_from(0)
    if found is None or found[1].start > position:
        return None
    lo, hi = found[0] + 1, _last_chunk_id(cur, meta.sid)  # the answer is `found` or an id in [lo, hi]
    while lo <= hi:
        probe = first_from((lo + hi) // 2)
        if probe is None or probe[1].start > position:
            hi = (lo + hi) // 2 - 1
        else:
            found, lo = probe, probe[0] + 1
    chunk, info = found
    return (chunk, info) if info.start <= position < info.end and info.state == SEALED else None


def _last_chunk_id(cur: lmdb.Cursor, sid: int) -> int:
    """The highest chunk id in `sid`'s manifest (which holds at least one)."""
    found = cur.prev() if cur.set_range(chunk_key(sid + 1, 0)) else cur.last()
    assert found and cur.key()[:8] == SID.pack(sid)
    return int(KEY.unpack(cur.key())[1])


def _sealed(txn: lmdb.Transaction, dbs: Dbs, meta: StreamMeta, position: int, end: int) -> Sealed:
    found = sealed_chunk_at(txn, dbs, meta, position)
    if found is None:
        raise LookupError(f"position {position} of {meta.path!r} is neither in the WAL nor sealed")
    chunk, info = found
    return Sealed(meta.uid, chunk, position, min(end, info.end), info)


def own_records(
    txn: lmdb.Transaction, dbs: Dbs, meta: StreamMeta, start: int, end: int
) -> Iterator[Record | Sealed]:
    """Records of one stream overlapping [start, end), the first sliced to begin at start."""
    if start >= end:
        return
    pos = start
    for rec in stream_records(txn, dbs, meta.sid, start):
        if rec.start > pos:
            yield _sealed(txn, dbs, meta, pos, end)
            return
        if rec.start < pos:
            rec = Record(rec.end, rec.chunk, rec.flags, rec.data[pos - rec.start :])
        if rec.end > end:
            rec = Record(end, rec.chunk, rec.flags, rec.data[: len(rec.data) - (rec.end - end)])
        yield rec
        pos = rec.end
        if pos >= end:
            return
    if pos < end:
        yield _sealed(txn, dbs, meta, pos, end)


def chain_records(
    txn: lmdb.Transaction, dbs: Dbs, meta: StreamMeta, lookup: MetaLookup, start: int, end: int
) -> Iterator[Record | Sealed]:
    """Messages of `meta`'s stream in [start, end), inherited ones included."""
    if meta.fork_source is not None and start < meta.fork_position:
        source = lookup(meta.fork_source_key or meta.fork_source)
        if source is not None and source.sid == meta.fork_source_sid:
            for item in chain_records(txn, dbs, source, lookup, start, min(end, meta.fork_position)):
                yield item
                if isinstance(item, Sealed):
                    return
        start = meta.fork_position
    yield from own_records(txn, dbs, meta, start, end)


def fork_points(meta: StreamMeta, lookup: MetaLookup) -> tuple[int, ...]:
    """The fork positions of `meta`'s chain (its own first, then its source's below it...):
    where a read passes from one stream's data to another's."""
    points: list[int] = []
    for _ in range(64):  # fork chains are short; the bound only guards against cycles
        if meta.fork_source is None:
            break
        if not points or meta.fork_position < points[-1]:  # (a source's later fork point is not read)
            points.append(meta.fork_position)
        source = lookup(meta.fork_source_key or meta.fork_source)
        if source is None or source.sid != meta.fork_source_sid:
            break
        meta = source
    return tuple(points)


def record_at(
    txn: lmdb.Transaction, dbs: Dbs, meta: StreamMeta, lookup: MetaLookup, position: int
) -> Record | Sealed | None:
    """The whole message holding the byte at `position`, as `meta`'s stream sees it."""
    if meta.fork_source is not None and position < meta.fork_position:
        source = lookup(meta.fork_source_key or meta.fork_source)
        if source is None or source.sid != meta.fork_source_sid:
            return None
        rec = record_at(txn, dbs, source, lookup, position)
        if isinstance(rec, Record) and rec.end > meta.fork_position:
            cut = rec.end - meta.fork_position
            rec = Record(meta.fork_position, rec.chunk, rec.flags, rec.data[: len(rec.data) - cut])
        return rec
    rec = next(stream_records(txn, dbs, meta.sid, position), None)  # the first ending after it
    if rec is not None and rec.start <= position:
        return rec
    found = sealed_chunk_at(txn, dbs, meta, position)
    if found is not None:
        return Sealed(meta.uid, found[0], position, found[1].end, found[1])
    return None


def at_position(
    txn: lmdb.Transaction, dbs: Dbs, meta: StreamMeta, lookup: MetaLookup, position: int
) -> tuple[int, bool | None, Record | Sealed | None]:
    """What names and bounds `position`, from one lookup of the message before it: the chunk
    id that names it (chunk_at), whether a message ends there (None when only the sealed
    chunk's index knows), and that message (None at 0 and at the tail, which need no lookup)."""
    if position == meta.tail:
        return meta.tail_chunk, True, None
    if position <= 0:
        root = meta
        for _ in range(64):
            source = lookup(root.source_key) if root.source_key is not None else None
            if source is None:
                break
            root = source
        return root.first_chunk, True, None
    rec = record_at(txn, dbs, meta, lookup, position - 1)
    chunk = rec.chunk if rec is not None else meta.first_chunk
    boundary: bool | None
    if meta.fork_source is not None and position == meta.fork_position:
        boundary = True
    elif isinstance(rec, Sealed):
        boundary = True if position in (rec.info.start, rec.info.end) else None
    else:
        boundary = rec is not None and rec.end == position
    return chunk, boundary, rec


def chunk_at(txn: lmdb.Transaction, dbs: Dbs, meta: StreamMeta, lookup: MetaLookup, position: int) -> int:
    """The chunk id that names `position` (the chunk holding the byte before it); position 0
    is named by the first chunk of the stream at the root of the fork chain."""
    return at_position(txn, dbs, meta, lookup, position)[0]

