"""Buckets in the WAL (extensions §1): their records, their stream counters, the listing.

    buckets    key: bucket id (ASCII)    value: BucketMeta as JSON

A bucket's streams are ordinary streams under internal paths `\\x00b/{bucket}/{stream id}`
(shared/buckets.py), so they are one contiguous key range of the `streams` database.

The counters move in the write transaction that creates or removes the stream they count
(Store calls the hooks below), so they can never disagree with the `streams` database.
`streams` counts every stream that holds a name in the bucket, soft-deleted ones included
(deleted, but forks still read their data: the id cannot be reused yet and reads answer 410);
`soft_deleted` says how many of them are such. A bucket can be deleted only when `streams`
is 0. A stream whose TTL ran out still counts until the writer removes it (the housekeeping
sweep, every second, or a bucket delete, which expires them first); the listing
leaves it out at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lmdb
import orjson

from ingester.chain import refresh_tail
from ingester.records import StreamMeta
from ingester.wal import WalEnv
from shared import buckets as B
from shared.errors import Conflict, NotFound

# A bucket delete first expires the streams whose time is up, when it has at most this many.
EXPIRE_SCAN_LIMIT = 1000
MAX_SEEK_BYTES = 480


@dataclass(slots=True)
class BucketMeta:
    created_at: float
    streams: int = 0  # streams holding a name in the bucket, soft-deleted ones included
    soft_deleted: int = 0

    def encode(self) -> bytes:
        return orjson.dumps(self)

    @staticmethod
    def decode(raw: bytes | memoryview) -> BucketMeta:
        return BucketMeta(**orjson.loads(raw))

    def describe(self, bucket_id: str) -> dict[str, Any]:
        return {
            "bucket_id": bucket_id, "streams": self.streams, "soft_deleted_streams": self.soft_deleted,
            "created_at_ms": int(self.created_at * 1000),
        }


def get(txn: lmdb.Transaction, wal: WalEnv, bucket_id: str) -> BucketMeta | None:
    raw = txn.get(bucket_id.encode(), db=wal.buckets)
    return BucketMeta.decode(raw) if raw is not None else None


class Buckets:
    """Write operations on buckets, run on the WAL writer thread (see store.Store)."""

    def __init__(self, wal: WalEnv) -> None:
        self.wal = wal

    def _put(self, txn: lmdb.Transaction, bucket_id: str, meta: BucketMeta) -> None:
        txn.put(bucket_id.encode(), meta.encode(), db=self.wal.buckets)

    def create(self, txn: lmdb.Transaction, bucket_id: str, now: float) -> BucketMeta:
        if get(txn, self.wal, bucket_id) is not None:
            raise Conflict(f"bucket {bucket_id!r} already exists")
        meta = BucketMeta(created_at=now)
        self._put(txn, bucket_id, meta)
        return meta

    def delete(self, txn: lmdb.Transaction, bucket_id: str, expire: Callable[[str], object]) -> None:
        """Delete an empty bucket. `expire(path)` removes the stream at path if its time is up."""
        meta = get(txn, self.wal, bucket_id)
        if meta is None:
            raise NotFound(f"bucket {bucket_id!r} not found")
        if 0 < meta.streams <= EXPIRE_SCAN_LIMIT:
            for path in self._paths(txn, bucket_id, EXPIRE_SCAN_LIMIT):
                expire(path)
            meta = get(txn, self.wal, bucket_id)
            assert meta is not None
        if meta.streams:
            soft = f" ({meta.soft_deleted} deleted but still read by forks)" if meta.soft_deleted else ""
            raise Conflict(f"bucket is not empty: it holds {meta.streams} stream(s){soft}")
        txn.delete(bucket_id.encode(), db=self.wal.buckets)

    def _paths(self, txn: lmdb.Transaction, bucket_id: str, limit: int) -> list[str]:
        prefix = B.bucket_key_prefix(bucket_id).encode()
        cur = txn.cursor(self.wal.streams)
        out: list[str] = []
        if cur.set_range(prefix):
            for key in cur.iternext(keys=True, values=False):
                if not bytes(key).startswith(prefix) or len(out) >= limit:
                    break
                out.append(bytes(key).decode())
        return out

    # --- hooks: called by Store in the transaction that changes the stream ---------------

    def require(self, txn: lmdb.Transaction, path: str) -> None:
        """A stream may be created under a bucket only if the bucket exists (never implicitly)."""
        parts = B.split_internal(path)
        if parts is not None and get(txn, self.wal, parts[0]) is None:
            raise NotFound(f"bucket {parts[0]!r} not found (create it first: PUT {B.BUCKETS_PREFIX}{parts[0]})")

    def _count(self, txn: lmdb.Transaction, path: str, streams: int, soft_deleted: int) -> None:
        parts = B.split_internal(path)
        if parts is None:
            return
        meta = get(txn, self.wal, parts[0])
        if meta is None:  # cannot happen: a bucket with streams is never deleted
            return
        meta.streams = max(0, meta.streams + streams)
        meta.soft_deleted = max(0, meta.soft_deleted + soft_deleted)
        self._put(txn, parts[0], meta)

    def stream_added(self, txn: lmdb.Transaction, path: str) -> None:
        self._count(txn, path, +1, 0)

    def stream_soft_deleted(self, txn: lmdb.Transaction, path: str) -> None:
        self._count(txn, path, 0, +1)

    def stream_removed(self, txn: lmdb.Transaction, path: str, was_soft_deleted: bool) -> None:
        self._count(txn, path, -1, -1 if was_soft_deleted else 0)


# --- reads (read transactions on the read pool) ---------------------------------------------


def status(meta: StreamMeta) -> str:
    if meta.soft_deleted:
        return "Deleted"
    return "Closed" if meta.closed else "Open"


def list_streams(
    txn: lmdb.Transaction, wal: WalEnv, bucket_id: str, *, prefix: str | None, after: str | None, limit: int,
    now: float, touches: dict[str, float], last_writes: dict[str, float],
) -> dict[str, Any]:
    """One page of the listing: at most `limit` streams whose id starts with `prefix`, after
    `after` (exclusive), in id order (UTF-8 byte order is code point order). A range scan
    over the bucket's keys that reads limit + 1 entries at most (plus expired ones it skips)."""
    if get(txn, wal, bucket_id) is None:
        raise NotFound(f"bucket {bucket_id!r} not found")
    base = B.bucket_key_prefix(bucket_id).encode()
    low = base + (prefix or "").encode()
    start, skip = low, None
    if after is not None and base + after.encode() >= low:
        start = skip = base + after.encode()
    streams: list[dict[str, Any]] = []
    has_more = False
    for key, raw in scan_range(txn.cursor(wal.streams), low, start, skip):
        meta = StreamMeta.decode(raw)
        if not meta.soft_deleted and meta.expired(now, touches.get(meta.path)):
            if meta.refcount == 0:
                continue  # gone: reads answer 404, and the writer removes it shortly
            meta.soft_deleted = True  # expired, but forks read it: the writer soft-deletes it
        if len(streams) == limit:
            has_more = True
            break
        streams.append(stream_entry(txn, wal, meta, key[len(base) :].decode(), now, last_writes))
    return {
        "bucket_id": bucket_id,
        "prefix": prefix,
        "stream_count": len(streams),
        "streams": streams,
        "next_cursor": streams[-1]["stream_id"] if has_more else None,
        "has_more": has_more,
    }


def scan_range(cur: lmdb.Cursor, low: bytes, start: bytes, skip: bytes | None) -> Iterator[tuple[bytes, Any]]:
    """(key, value) pairs of `cur`'s database from `start` (b"": the first key) while keys begin
    with `low`, leaving out keys <= `skip`: the range scan of every listing.
    LMDB keys are at most 511 bytes and stream keys at most 125: a longer start (a long prefix
    or cursor) is cut; no key lies between the cut and the whole, so the scan is the same."""
    if not (cur.set_range(start[:MAX_SEEK_BYTES]) if start else cur.first()):
        return
    for k, raw in cur:
        key = bytes(k)
        if not key.startswith(low):
            return
        if skip is not None and key <= skip:
            continue
        yield key, raw


def stream_entry(
    txn: lmdb.Transaction, wal: WalEnv, meta: StreamMeta, stream_id: str, now: float, last_writes: dict[str, float]
) -> dict[str, Any]:
    meta = refresh_tail(txn, wal, meta, now)
    last = max(meta.last_write_at or meta.created_at, last_writes.get(meta.path, 0.0))
    return {
        "stream_id": stream_id,
        "status": status(meta),
        "content_type": meta.content_type,
        "tail_offset": meta.tail,  # the tail's byte position; next_offset is the protocol's offset
        "next_offset": meta.tail_offset,
        "created_at_ms": int(meta.created_at * 1000),
        "last_write_at_ms": int(last * 1000),
    }
