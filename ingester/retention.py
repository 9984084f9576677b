"""Snapshots and retention in the WAL (extensions §2): writer-thread operations.

Publishing a snapshot is two steps: the service uploads the blob (off the writer, so
appends never wait for it), then `publish` commits it as the stream's latest snapshot.
From that commit on, the snapshot's offset is the earliest retained one: reads before it
answer 410, and what it makes unreachable is queued for deletion in the same transaction
(`del:<key>` entries in the sys database), so a crash cannot leak it:

- the superseded snapshot's blob;
- sealed chunks that end at or before the new earliest position (Store.release_retained; a
  chunk still in the WAL then is released when it is sealed, and all of them when the
  stream's last fork goes).

Nothing is queued while forks read the stream (its refcount is positive): a fork may still
need both. The stream's objects all go when the stream itself is removed (sealing GC).
"""

from __future__ import annotations

from dataclasses import dataclass

import lmdb

from ingester.records import StreamMeta
from ingester.store import Store
from ingester.store_sealing import DELETE_PREFIX
from shared import keys
from shared.errors import Conflict, Gone, NotFound, Retained


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    path: str
    sid: int  # the stream incarnation validated before the upload
    offset: str  # canonical spelling
    position: int
    content_type: str
    size: int
    key: str  # where the blob was uploaded


def publish(store: Store, txn: lmdb.Transaction, req: SnapshotRequest) -> list[str]:
    """Make the uploaded blob the stream's latest snapshot; return object keys to delete."""
    meta = store._live(txn, req.path, store.clock())
    if meta is None or meta.sid != req.sid:
        raise NotFound("stream not found (deleted while the snapshot was uploaded)")
    if meta.soft_deleted:
        raise Gone("stream was deleted")
    if req.position < meta.earliest:
        assert meta.snapshot_offset is not None
        raise Retained(meta.snapshot_offset, "a newer snapshot was published meanwhile: this offset is no longer retained")
    old_key = meta.snapshot_key
    meta.snapshot_offset, meta.snapshot_type, meta.snapshot_size = req.offset, req.content_type, req.size
    meta.snapshot_key = req.key
    garbage: list[str] = []
    if old_key is not None and old_key != req.key and old_key.startswith(keys.snapshot_prefix(meta.uid)):
        if meta.refcount == 0:
            garbage.append(old_key)
        else:  # forks may still read it: kept until the last one goes (Store.release_retained)
            meta.retired_snapshots = [*(meta.retired_snapshots or []), old_key]
    store._save(meta)
    store._publish(txn, meta, meta.path)
    for key in garbage:
        txn.put(DELETE_PREFIX + key.encode(), b"", db=store.wal.sys)
    store.release_retained(txn, meta)  # (the chunks it gave up: the commit's news hands them to the reaper)
    return garbage


def check_delete(meta: StreamMeta, offset: str) -> None:
    """DELETE {stream}/snapshot/{offset}: only one snapshot is visible, and /bootstrap needs it."""
    if meta.snapshot_offset is None or meta.snapshot_offset != offset:
        raise NotFound("no snapshot at that offset (it never existed or was superseded)")
    raise Conflict("this is the latest snapshot: /bootstrap needs it, so it cannot be deleted")


def deleted(store: Store, txn: lmdb.Transaction, object_keys: list[str]) -> None:
    for key in object_keys:
        txn.delete(DELETE_PREFIX + key.encode(), db=store.wal.sys)


def pending(store: Store, txn: lmdb.Transaction) -> list[str]:
    """At start: objects queued for deletion and not yet deleted."""
    out: list[str] = []
    cur = txn.cursor(store.wal.sys)
    if cur.set_range(DELETE_PREFIX):
        for key, _value in cur:
            if not bytes(key).startswith(DELETE_PREFIX):
                break
            out.append(bytes(key[len(DELETE_PREFIX) :]).decode())
    return out
