"""The WAL store's expiry and renewal bookkeeping, a mixin of ingester/store.py's Store:
streams with a TTL or an expiry time in a deadline heap swept by the housekeeping loop, TTL
renewals that reads recorded folded into the metadata, and last-append times persisted at
shutdown."""

from __future__ import annotations

import heapq
from typing import Final

import lmdb

from ingester.records import StreamMeta
from ingester.store_core import StoreCore

# In `sys` while an ingester runs on the WAL (load_expiry_index), deleted by a clean shutdown.
RUNNING: Final = b"running"


class ExpiryBook:
    def expire_due(self: StoreCore, txn: lmdb.Transaction, path: str) -> StreamMeta | None:
        """The stream at `path` after removing it if its time is up (a bucket delete)."""
        return self._live(txn, path, self.clock())

    def fold_last_writes(self: StoreCore, txn: lmdb.Transaction) -> int:
        """At shutdown: persist the last-append times plain appends kept in memory only."""
        n = 0
        for path, t in list(self.last_writes.items()):
            meta = self._load(txn, path)  # the cached meta has the time; the stored one may not
            if meta is not None:
                meta.last_write_at = max(meta.last_write_at or 0.0, t)
                self._dirty[path] = meta
                n += 1
        return n

    def fold_touches(self: StoreCore, txn: lmdb.Transaction) -> int:
        """Persist TTL renewals that reads recorded, so they survive a restart. An entry is
        forgotten by a later fold, once a commit holds it (reads need it until then, and an
        aborted batch must not lose it), and only if no read renewed it since."""
        n = 0
        for path, t in list(self.touches.items()):
            meta = self._load(txn, path)
            if meta is not None and not meta.soft_deleted and t > meta.last_access:
                meta.last_access = t
                self._dirty[path] = meta
                n += 1
            elif self._stored_covers(txn, path, t):
                self.touches.forget(path, t)
        return n

    def _stored_covers(self: StoreCore, txn: lmdb.Transaction, path: str, touched: float) -> bool:
        """The last commit renewed the stream at `touched` or later, or holds no live stream
        (metadata reaches the transaction only in flush: txn.get sees the last commit's)."""
        raw = txn.get(path.encode(), db=self.wal.streams)
        stored = StreamMeta.decode(raw) if raw is not None else None
        return stored is None or stored.soft_deleted or stored.last_access >= touched

    def sweep_expired(self: StoreCore, txn: lmdb.Transaction, limit: int = 1000) -> int:
        """Delete streams whose time is up (soft-delete those that forks still read)."""
        now = self.clock()
        removed = 0
        while self._expiry and self._expiry[0][0] <= now and removed < limit:
            _, path = heapq.heappop(self._expiry)
            meta = self._load(txn, path)
            if meta is None or meta.soft_deleted or meta.moved_to is not None:  # moved: the new owner expires it
                continue
            if meta.expired(now, self.touches.get(path)):
                self._remove(txn, meta)
                removed += 1
            else:
                d = meta.deadline(self.touches.get(path))
                if d is not None:
                    heapq.heappush(self._expiry, (d, path))
        return removed

    def load_expiry_index(self: StoreCore, txn: lmdb.Transaction) -> int:
        """At start: find every stream with a TTL or expiry time. After a run that did not end
        with mark_clean (a crash, a SIGKILL, a standby's takeover), the renewals reads made
        since the last fold_touches are lost (reads renew in memory; a fold persists them
        every few seconds): every stream with a TTL counts as renewed now, so none expires
        before its time (found by QA: a read renewed a stream, a SIGKILL half a second later,
        and the restarted ingester deleted it at its old deadline). Such a stream may live up
        to one TTL longer than it would have; never shorter."""
        unclean = txn.get(RUNNING, db=self.wal.sys) is not None
        txn.put(RUNNING, b"1", db=self.wal.sys)
        now = self.clock()
        n = 0
        for _key, raw in txn.cursor(db=self.wal.streams):
            meta = StreamMeta.decode(raw)
            if not meta.soft_deleted and meta.moved_to is None and meta.deadline() is not None:
                if unclean and meta.ttl is not None:
                    self.touches[meta.path] = now
                self._track_expiry(meta)
                n += 1
        return n

    def mark_clean(self: StoreCore, txn: lmdb.Transaction) -> int:
        """At shutdown, after fold_touches: every renewal is in the WAL."""
        return int(txn.delete(RUNNING, db=self.wal.sys))


    def _track_expiry(self: StoreCore, meta: StreamMeta) -> None:
        d = meta.deadline()
        if d is not None:
            heapq.heappush(self._expiry, (d, meta.path))
