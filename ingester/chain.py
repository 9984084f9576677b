"""Reading a stream's messages from the WAL, across fork boundaries.

A fork reads positions below its fork position from its source (recursively, the source
may itself be a fork), capped at the fork position, and its own records above it. Used by
read transactions (catch-up, live) and by the writer (fork sub-offset resolution)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import lmdb

from ingester.records import SID, Record, StreamMeta, decode_record, record_key

MetaLookup = Callable[[str], StreamMeta | None]


def own_records(txn: lmdb.Transaction, db: lmdb._Database, sid: int, start: int, end: int) -> Iterator[Record]:
    """Records of one stream overlapping [start, end), the first sliced to begin at start."""
    if start >= end:
        return
    prefix = SID.pack(sid)
    cur = txn.cursor(db)
    if not cur.set_range(record_key(sid, start + 1)):
        return
    for key, value in cur:
        if key[:8] != prefix:
            return
        rec = decode_record(key, value)
        if rec.start >= end:
            return
        if rec.start < start:
            rec = Record(rec.end, rec.chunk, rec.flags, rec.data[start - rec.start :])
        if rec.end > end:
            rec = Record(end, rec.chunk, rec.flags, rec.data[: len(rec.data) - (rec.end - end)])
        yield rec


def chain_records(
    txn: lmdb.Transaction, db: lmdb._Database, meta: StreamMeta, lookup: MetaLookup, start: int, end: int
) -> Iterator[Record]:
    """Messages of `meta`'s stream in [start, end), inherited ones included."""
    if meta.fork_source is not None and start < meta.fork_position:
        source = lookup(meta.fork_source)
        if source is not None and source.sid == meta.fork_source_sid:
            yield from chain_records(txn, db, source, lookup, start, min(end, meta.fork_position))
        start = meta.fork_position
    yield from own_records(txn, db, meta.sid, start, end)


def record_at(
    txn: lmdb.Transaction, db: lmdb._Database, meta: StreamMeta, lookup: MetaLookup, position: int
) -> Record | None:
    """The whole message holding the byte at `position`, as `meta`'s stream sees it."""
    if meta.fork_source is not None and position < meta.fork_position:
        source = lookup(meta.fork_source)
        if source is None or source.sid != meta.fork_source_sid:
            return None
        rec = record_at(txn, db, source, lookup, position)
        if rec is not None and rec.end > meta.fork_position:
            cut = rec.end - meta.fork_position
            rec = Record(meta.fork_position, rec.chunk, rec.flags, rec.data[: len(rec.data) - cut])
        return rec
    cur = txn.cursor(db)
    if not cur.set_range(record_key(meta.sid, position + 1)):
        return None
    key, value = cur.item()
    if key[:8] != SID.pack(meta.sid):
        return None
    rec = decode_record(key, value)
    return rec if rec.start <= position else None


def chunk_at(txn: lmdb.Transaction, db: lmdb._Database, meta: StreamMeta, lookup: MetaLookup, position: int) -> int:
    """The chunk id that names `position` (the chunk holding the byte before it)."""
    if position <= 0:
        return 0
    if position == meta.tail:
        return meta.tail_chunk
    rec = record_at(txn, db, meta, lookup, position - 1)
    return rec.chunk if rec is not None else 0


def is_message_boundary(
    txn: lmdb.Transaction, db: lmdb._Database, meta: StreamMeta, lookup: MetaLookup, position: int
) -> bool:
    if position in (0, meta.tail) or (meta.fork_source is not None and position == meta.fork_position):
        return True
    rec = record_at(txn, db, meta, lookup, position - 1)
    return rec is not None and rec.end == position
