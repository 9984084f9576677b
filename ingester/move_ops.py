"""Moving streams between ingesters: the writer operations (issue 15, item 4). They run on
the WAL writer thread, inside a group commit, like every other write (so `--durability store`
logs them and replay rebuilds them); ingester/moves.py drives them from the event loop.

- freeze_export: freeze a placement key's streams for their new owner (StreamMeta.moved_to;
  the cluster guard then refuses every later write) and read everything it needs
  (shared/moveformat.py), fork relationships included (remote_forks.py: a fork whose source
  stays gets a pin there and carries the source's chain; a source carries its pins and the
  forks staying here are rewired to a shadow of it).
- import_moved: write an export under new local sids, everything else as it was.
- drop_moved: forget the frozen copies once the new owner holds them (the store untouched).
"""

from __future__ import annotations

import heapq
from typing import Any

import lmdb
import orjson

from ingester import buckets as bucket_records
from ingester import remote_forks
from ingester.chain import stream_records
from ingester.records import (
    SEALED,
    SEALING,
    SID,
    ChunkInfo,
    ChunkRef,
    ProducerState,
    StreamMeta,
    chunk_key,
    encode_record,
    producer_key,
    record_key,
)
from ingester.store import Store
from shared.buckets import INTERNAL_PREFIX
from shared.errors import Conflict, Misdirected
from shared.moveformat import MovedStream, MoveExport
from shared.placement import Ingester


def bucket_of(key: str) -> str | None:
    """The bucket id of a bucket's placement key; None for a plain stream's."""
    if key.startswith(INTERNAL_PREFIX) and key.endswith("/"):
        return key[len(INTERNAL_PREFIX) : -1]
    return None


def frozen_error(meta: StreamMeta) -> Misdirected:
    assert meta.moved_to is not None
    to_id, to_url, generation = meta.moved_to
    return Misdirected(str(to_id), str(to_url), int(generation), "this ingester (it moved the stream out)")


# --- writer operations (on the writer thread, in the group commit) ------------------------------


def _paths(txn: lmdb.Transaction, store: Store, key: str) -> list[str]:
    """The stream paths a placement key covers that this WAL holds."""
    if bucket_of(key) is None:
        return [key] if txn.get(key.encode(), db=store.wal.streams) is not None else []
    prefix = key.encode()
    out: list[str] = []
    cur = txn.cursor(store.wal.streams)
    if cur.set_range(prefix):
        for k in cur.iternext(keys=True, values=False):
            if not bytes(k).startswith(prefix):
                break
            out.append(bytes(k).decode())
    return out


def freeze_export(store: Store, txn: lmdb.Transaction, key: str, to: Ingester, generation: int,
                  me: str) -> MoveExport | None:
    """Freeze the key's streams for `to` and read what it needs; None when nothing is held."""
    bucket_id = bucket_of(key)
    bucket = bucket_records.get(txn, store.wal, bucket_id) if bucket_id is not None else None
    metas = [m for m in (store._load(txn, p) for p in _paths(txn, store, key)) if m is not None]
    if not metas and bucket is None:
        return None
    for meta in metas:
        if meta.moved_to is not None and meta.moved_to[0] != to.id:
            raise Conflict(f"stream {meta.path!r} was moved to ingester {meta.moved_to[0]} (generation "
                           f"{meta.moved_to[2]}) and that move is not done; a second description change before "
                           "the moves of the first are done is not supported")
    export = MoveExport(key, generation, me, orjson.loads(bucket.encode()) if bucket is not None else None)
    for meta in metas:
        data = orjson.loads(meta.encode())
        data["moved_to"] = None
        touched = store.touches.get(meta.path)  # TTL renewals not folded into the metadata yet
        if touched is not None and touched > meta.last_access:
            data["last_access"] = touched
        written = store.last_writes.get(meta.path)
        if written is not None and written > (meta.last_write_at or 0.0):
            data["last_write_at"] = written
        prefix = SID.pack(meta.sid)
        moved = MovedStream(data, meta.sid)
        cur = txn.cursor(store.wal.chunks)
        if cur.set_range(prefix):
            for k, v in cur:
                if bytes(k[:8]) != prefix:
                    break
                moved.chunks.append((SID.unpack(k[8:16])[0], orjson.loads(v)))
        cur = txn.cursor(store.wal.producers)
        if cur.set_range(prefix):
            for k, v in cur:
                if bytes(k[:8]) != prefix:
                    break
                state = ProducerState.decode(v)
                moved.producers.append((bytes(k[8:]).decode(), state.epoch, state.last_seq, state.updated_at))
        # (records of sealed chunks still here, their drop not finished: the store has them)
        sealed = {chunk for chunk, info in moved.chunks if info.get("state") == SEALED}
        moved.records = [(r.end, r.chunk, r.flags, r.data) for r in stream_records(txn, store.wal, meta.sid, 0)
                         if r.chunk not in sealed]
        moving = {m.path for m in metas}
        moved.source = _source_chain(store, txn, meta, moving)
        moved.pins = _pins(store, txn, meta, moving)
        export.streams.append(moved)
        if meta.moved_to is None:
            meta.moved_to = [to.id, to.url, generation]
            store._save(meta)  # wakes its long-polls: they re-read and get 421
    return export


def _source_chain(store: Store, txn: lmdb.Transaction, meta: StreamMeta, moving: set[str]) -> list[Any] | None:
    """A fork whose source does not move with it (it stays here, or lives on another ingester
    already): the source's chain below the fork position, for the new owner's shadows
    (remote_forks.py). A source here gets a pin by the fork's uid, so the fork, wherever it
    goes, releases its share of the source's refcount like any fork of another ingester's
    stream. None: not a fork, or its source moves along (the fork stays a local one)."""
    if meta.fork_source is None or (meta.fork_source_key is None and meta.fork_source in moving):
        return None
    key = meta.source_key
    source = store._load(txn, key) if key is not None else None
    if source is None or source.sid != meta.fork_source_sid:
        return None  # a broken chain reads as it did here: nothing inherited
    if meta.fork_source_key is None:
        remote_forks.add_pin(store, txn, meta.uid, source)  # its refcount counts the fork already
    cap_chunk = remote_forks.chunk_naming(store, txn, source, meta.fork_position)
    return remote_forks.levels_to_json(remote_forks.export_levels(store, txn, source, meta.fork_position, cap_chunk))


def _pins(store: Store, txn: lmdb.Transaction, meta: StreamMeta, moving: set[str]) -> list[str]:
    """A stream forks read, moving: the forks that stay here now read a shadow of it (as if
    they had been forked from another ingester, with a pin each), and every pin of it moves
    with it (the new owner answers their releases). Returns the pinning fork uids."""
    if meta.refcount == 0:
        return []
    local = [f for f in _local_forks(store, txn, meta) if f.path not in moving]
    if local:
        levels = remote_forks.export_levels(store, txn, meta, meta.tail, meta.tail_chunk)
        for fork in local:
            shadow = remote_forks.install_shadows(store, txn, levels)
            fork.fork_source_key, fork.fork_source_sid = shadow.path, shadow.sid
            store._save(fork)
            remote_forks.add_pin(store, txn, fork.uid, meta)
    return remote_forks.pins_of(store, txn, meta.uid)


def _local_forks(store: Store, txn: lmdb.Transaction, meta: StreamMeta) -> list[StreamMeta]:
    """Streams here that fork `meta` directly, reading its records (a scan: moves only)."""
    out = []
    for k, raw in txn.cursor(db=store.wal.streams):
        fields = orjson.loads(raw)
        if (fields.get("fork_source") == meta.path and fields.get("fork_source_sid") == meta.sid
                and fields.get("fork_source_key") is None):
            found = store._load(txn, bytes(k).decode())
            if found is not None:
                out.append(found)
    return out


def _drop_stream(store: Store, txn: lmdb.Transaction, meta: StreamMeta) -> None:
    """Forget a stream held here without touching the store: its objects are the new owner's."""
    prefix = SID.pack(meta.sid)
    if meta.fork_source_key is not None:  # the shadows it read (forks here may still read them)
        remote_forks.unref_shadows(store, txn, meta.fork_source_key)
    remote_forks.drop_pins(store, txn, remote_forks.pins_of(store, txn, meta.uid))  # the new owner's now
    store._drop_prefix(txn, store.wal.records, prefix)
    store.journal.drop_stream(txn, meta.sid)
    store._drop_prefix(txn, store.wal.producers, prefix)
    store._drop_prefix(txn, store.wal.chunks, prefix)
    txn.delete(b"pub:" + meta.path.encode(), db=store.wal.sys)  # the new owner publishes it
    txn.delete(meta.path.encode(), db=store.wal.streams)
    store._metas[meta.path] = None
    store._dirty.pop(meta.path, None)
    store.last_writes.pop(meta.path, None)
    store._producers = {k: v for k, v in store._producers.items() if k[0] != meta.sid}
    store._news.changed.add(meta.path)


def drop_moved(store: Store, txn: lmdb.Transaction, key: str, owned_here: bool) -> int:
    """The new owner holds the key: drop the frozen copies (and the bucket record when this
    ingester does not own the key). Returns how many streams were dropped; idempotent."""
    dropped = 0
    for path in _paths(txn, store, key):
        meta = store._load(txn, path)
        if meta is not None and meta.moved_to is not None:
            _drop_stream(store, txn, meta)
            dropped += 1
    bucket_id = bucket_of(key)
    if bucket_id is not None and not owned_here and not _paths(txn, store, key):
        txn.delete(bucket_id.encode(), db=store.wal.buckets)
    return dropped


def import_moved(store: Store, txn: lmdb.Transaction, export: MoveExport) -> int:
    """Write an export in this (one) transaction; returns the streams imported."""
    bucket_id = bucket_of(export.key)
    if export.bucket is not None and bucket_id is not None:
        meta_b = bucket_records.BucketMeta(**export.bucket)
        txn.put(bucket_id.encode(), meta_b.encode(), db=store.wal.buckets)
    imported: dict[str, tuple[StreamMeta, MovedStream]] = {}
    for moved in export.streams:
        meta = StreamMeta(**moved.meta)
        existing = store._load(txn, meta.path)
        if existing is not None:
            if existing.moved_to is None:
                raise Conflict(f"this ingester already holds a stream at {meta.path!r}: not importing over it")
            _drop_stream(store, txn, existing)  # our own old frozen copy: the export is newer
        sid = store._next_sid(txn)
        meta.sid, meta.moved_to = sid, None
        for end, chunk, flags, data in moved.records:
            txn.put(record_key(sid, end), encode_record(chunk, flags, data), db=store.wal.records)
        for chunk, fields in moved.chunks:
            info = ChunkInfo(**fields)
            if info.header_sid is None:
                info.header_sid = moved.sid
            txn.put(chunk_key(sid, chunk), info.encode(), db=store.wal.chunks)
            if info.state == SEALING:
                store._news.rolled.append(ChunkRef(meta.path, sid, meta.uid, chunk))
        for pid, epoch, last_seq, updated_at in moved.producers:
            txn.put(producer_key(sid, pid), ProducerState(epoch, last_seq, updated_at).encode(),
                    db=store.wal.producers)
        store._save(meta)
        store._publish(txn, meta, meta.path)
        store._track_expiry(meta)
        if meta.chunk_opened_at is not None and store.seal is not None:
            heapq.heappush(store._aging, (meta.chunk_opened_at, meta.path))
        if meta.last_write_at is not None:
            store.last_writes[meta.path] = meta.last_write_at
        imported[meta.path] = (meta, moved)
    for meta, moved in imported.values():  # fork relationships, now that every sid is known
        if moved.source is not None:
            shadow = remote_forks.install_shadows(store, txn, remote_forks.levels_from_json(moved.source))
            meta.fork_source_key, meta.fork_source_sid = shadow.path, shadow.sid
            store._save(meta)
        elif meta.fork_source is not None and meta.fork_source_key is None and meta.fork_source in imported:
            meta.fork_source_sid = imported[meta.fork_source][0].sid
            store._save(meta)
        for fork_uid in moved.pins:
            remote_forks.add_pin(store, txn, fork_uid, meta)
    return len(export.streams)
