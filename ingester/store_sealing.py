"""The WAL store's chunk bookkeeping, a mixin of ingester/store.py's Store: open chunks roll
(by size as records arrive, by age on the sealing loop's tick) into rolled chunks to upload; a
chunk confirmed in the object store drops its records from the WAL, in steps
(drop_sealed_records); removed streams' objects and changed descriptors wait in `sys` (gc:,
pub:) until the sealing loop has dealt with them, so a crash between the commit and the store
cannot lose that work (reloaded at start)."""

from __future__ import annotations

import heapq
from typing import Final, cast

import lmdb

from ingester.chain import stream_records
from ingester.records import (
    RECORD_HEADER,
    SEALED,
    SEALING,
    SID,
    ChunkInfo,
    ChunkRef,
    StreamMeta,
    chunk_key,
    record_key,
)
from ingester.store_core import StoreCore
from shared import keys
from shared.descriptor import Descriptor

# Records of sealed chunks one step of drop_sealed_records deletes (a commit has one step at
# most: Sealer.drop_records). A chunk of 100-byte messages holds tens of thousands: dropped in
# the commit that marked it sealed, with every stream sealing at once under 32 writers, they
# held the appends batched alongside for 0.1-0.5 s. A step of 1,024 costs its commit about
# 1.5 ms (with the commit log on: ~2 us a record); 256 cost half again as much per record.
DROP_RECORDS: Final = 1024


def descriptor_of(meta: StreamMeta) -> Descriptor:
    """What readers are told of a stream (the object at shared.keys.descriptor_key)."""
    return Descriptor(
        path=meta.path, uid=meta.uid, content_type=meta.content_type, created_at=meta.created_at,
        ttl=meta.ttl, expires_at=meta.expires_at, closed=meta.closed,
        final_offset=meta.tail_offset if meta.closed else None, soft_deleted=meta.soft_deleted,
        fork_source=meta.fork_source, fork_source_uid=meta.fork_source_uid,
        fork_position=meta.fork_position, first_chunk=meta.first_chunk,
        snapshot_offset=meta.snapshot_offset, snapshot_type=meta.snapshot_type, snapshot_key=meta.snapshot_key,
    )


DELETE_PREFIX: Final = b"del:"  # in `sys`: an unreachable object to delete (ingester/reaper.py)


class SealingBook:
    def release_retained(self: StoreCore, txn: lmdb.Transaction, meta: StreamMeta) -> list[str]:
        """Queue for deletion what the stream's snapshots gave up, once no fork reads the
        stream: the sealed chunks wholly before its earliest retained position, and its
        superseded snapshot blobs kept for forks; their keys, also in this commit's news (the
        reaper's). Called when a snapshot is published, when a chunk is sealed, and when the
        stream's last fork goes: a chunk still in the WAL when its history was given up used to
        wait for the next publish, however long, and what forks kept stayed for good (found by
        QA)."""
        if meta.refcount > 0 or (meta.earliest <= meta.released and not meta.retired_snapshots):
            return []
        earliest, released, out = meta.earliest, meta.released, list(meta.retired_snapshots or ())
        meta.retired_snapshots = None
        prefix = SID.pack(meta.sid)
        cur = txn.cursor(self.wal.chunks)
        if earliest > meta.released and cur.set_range(chunk_key(meta.sid, 0)):
            for key, raw in cur:
                if key[:8] != prefix:
                    break
                info = ChunkInfo.decode(raw)
                if info.end > earliest or info.state != SEALED:
                    break  # chunks rise with positions; an unsealed one is released once sealed
                if info.start >= meta.released:
                    out.append(keys.chunk_key(meta.uid, SID.unpack(key[8:16])[0]))
                meta.released = info.end
        # (the manifest entries stay: they still name the chunk of positions at their edges)
        if out or meta.released != released:
            self._save(meta)
        for k in out:
            txn.put(DELETE_PREFIX + k.encode(), b"", db=self.wal.sys)
        self._news.released += out
        return out

    def _maybe_roll(self: StoreCore, txn: lmdb.Transaction, meta: StreamMeta, now: float) -> None:
        if self.seal is not None and meta.tail - meta.chunk_start >= self.seal.seal_bytes:
            self._roll(txn, meta, now)

    def _roll(self: StoreCore, txn: lmdb.Transaction, meta: StreamMeta, now: float) -> None:
        """Close the open chunk (if it holds anything) and queue it for upload."""
        if self.seal is None or meta.tail == meta.chunk_start:
            return
        info = ChunkInfo(meta.chunk_start, meta.tail, 0, meta.closed, now)
        txn.put(chunk_key(meta.sid, meta.chunk), info.encode(), db=self.wal.chunks)
        self._news.rolled.append(ChunkRef(meta.path, meta.sid, meta.uid, meta.chunk))
        meta.chunk += 1
        meta.chunk_start = meta.tail
        meta.chunk_opened_at = None

    def _unsealed_bytes(self: StoreCore, txn: lmdb.Transaction) -> int:
        return self.wal.record_bytes(txn)

    def seal_aged(self: StoreCore, txn: lmdb.Transaction) -> int:
        """Roll open chunks older than the seal age."""
        if self.seal is None:
            return 0
        now = self.clock()
        rolled = 0
        while self._aging and self._aging[0][0] + self.seal.seal_age <= now:
            _, path = heapq.heappop(self._aging)
            meta = self._load(txn, path)
            if meta is None or meta.chunk_opened_at is None or meta.moved_to is not None:
                continue  # rolled or deleted since, or frozen for a move (its new owner seals it)
            if meta.chunk_opened_at + self.seal.seal_age > now:  # a younger chunk opened since
                heapq.heappush(self._aging, (meta.chunk_opened_at, path))
                continue
            self._roll(txn, meta, now)
            self._save(meta)
            rolled += 1
        return rolled

    def mark_sealed(self: StoreCore, txn: lmdb.Transaction, ref: ChunkRef) -> bool:
        """The chunk's object is confirmed in the store: reads of its positions may go there
        from now on. Its records leave the WAL afterwards, a step per commit
        (drop_sealed_records). False if the stream was deleted meanwhile."""
        raw = txn.get(chunk_key(ref.sid, ref.chunk), db=self.wal.chunks)
        if raw is None:
            return False  # the stream was deleted meanwhile
        info = ChunkInfo.decode(raw)
        if info.state == SEALED:
            return True
        info.state = SEALED
        txn.put(chunk_key(ref.sid, ref.chunk), info.encode(), db=self.wal.chunks)
        # The chunk's newest records may be journaled: in `records` they can be dropped in order.
        self.journal.fold_stream(txn, ref.sid)
        self._news.changed.add(ref.path)
        meta = self._load(txn, ref.path)
        if meta is not None and meta.sid == ref.sid and info.end <= meta.earliest:
            self.release_retained(txn, meta)  # history a snapshot gave up while it was in the WAL
        return True

    def drop_sealed_records(self: StoreCore, txn: lmdb.Transaction, sid: int, limit: int = DROP_RECORDS) -> bool:
        """Delete up to `limit` of stream `sid`'s first records, as long as their chunk is
        sealed; True if more may be left (the next step goes on). A step stops at the first
        record of a chunk not sealed yet: chunks may be confirmed out of order, and that one's
        records are still its only copy. Until the last step, reads of a sealed chunk find
        part of its records still here (served from the WAL, the same bytes) and a gap where
        the rest were (served from the store): chain.own_records."""
        prefix = SID.pack(sid)
        cur = txn.cursor(self.wal.records)
        if not cur.set_range(prefix):
            return False
        key = cast(bytes, cur.key())  # (write transactions hand out bytes, not buffers)
        left = limit
        while left > 0:
            if key[:8] != prefix:  # (b"" past the last record)
                return False
            info = _sealed_chunk_of(self, txn, sid, cur.value())
            if info is None:
                return False
            last = record_key(sid, info.end)  # keys sort by position: the chunk's records end here
            if key > last:
                return False  # (a record past its chunk's end: never written so; stop rather than spin)
            while left > 0 and key[:8] == prefix and key <= last:
                if not cur.delete():
                    return False
                left -= 1
                key = cast(bytes, cur.key())  # the next record (the cursor moved on)
        return key[:8] == prefix

    def chunk_records(
        self: StoreCore, txn: lmdb.Transaction, ref: ChunkRef
    ) -> tuple[ChunkInfo, list[tuple[int, int, bytes]]] | None:
        """A rolled chunk's manifest entry and records (end, flags, data), for its upload."""
        raw = txn.get(chunk_key(ref.sid, ref.chunk), db=self.wal.chunks)
        if raw is None:
            return None
        info = ChunkInfo.decode(raw)
        out: list[tuple[int, int, bytes]] = []
        if info.state == SEALED:  # its records may be dropped already, some or all
            return info, out
        for rec in stream_records(txn, self.wal, ref.sid, info.start):
            if rec.end > info.end:
                break
            out.append((rec.end, rec.flags, rec.data))
        return info, out

    def gc_done(self: StoreCore, txn: lmdb.Transaction, uid: str) -> None:
        txn.delete(b"gc:" + uid.encode(), db=self.wal.sys)

    def load_gc(self: StoreCore, txn: lmdb.Transaction) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        cur = txn.cursor(self.wal.sys)
        if cur.set_range(b"gc:"):
            for key, value in cur:
                if not bytes(key).startswith(b"gc:"):
                    break
                out.append((bytes(key[3:]).decode(), bytes(value).decode()))
        return out

    def published(self: StoreCore, txn: lmdb.Transaction, path: str, written: Descriptor | None) -> bool:
        """The store has `written` for the path (None: no object): drop the path's mark,
        unless the stream is no longer that (a change since is still to publish, and its mark
        must survive a crash until it is). Whether the mark went."""
        current = self._load(txn, path)
        if (None if current is None else descriptor_of(current)) != written:
            return False
        txn.delete(b"pub:" + path.encode(), db=self.wal.sys)
        return True

    def load_unpublished(self: StoreCore, txn: lmdb.Transaction) -> dict[str, Descriptor | None]:
        """At start: descriptors whose change was committed but maybe not published (a crash
        came between the two); publishing again is idempotent."""
        out: dict[str, Descriptor | None] = {}
        cur = txn.cursor(self.wal.sys)
        if cur.set_range(b"pub:"):
            for key, _value in cur:
                if not bytes(key).startswith(b"pub:"):
                    break
                path = bytes(key[4:]).decode()
                meta = self._load(txn, path)
                out[path] = None if meta is None else descriptor_of(meta)
        return out

    def load_sealing_index(self: StoreCore, txn: lmdb.Transaction) -> list[ChunkRef]:
        """At start: chunks rolled but not confirmed (to upload again); open chunks' ages."""
        refs: list[ChunkRef] = []
        owners: dict[int, StreamMeta] = {}
        for key, _raw in txn.cursor(db=self.wal.streams):
            meta = self._load(txn, bytes(key).decode())
            assert meta is not None
            owners[meta.sid] = meta
            if meta.chunk_opened_at is not None and self.seal is not None:
                heapq.heappush(self._aging, (meta.chunk_opened_at, meta.path))
        for key, raw in txn.cursor(db=self.wal.chunks):
            if ChunkInfo.decode(raw).state == SEALING:
                sid, chunk = SID.unpack(key[:8])[0], SID.unpack(key[8:16])[0]
                owner = owners.get(sid)
                if owner is not None:
                    refs.append(ChunkRef(owner.path, sid, owner.uid, chunk))
        return refs

    def load_drops(self: StoreCore, txn: lmdb.Transaction) -> list[int]:
        """At start: streams whose first record is in a sealed chunk (a drop interrupted by
        a restart), to finish dropping. One seek per stream that has records."""
        out: list[int] = []
        cur = txn.cursor(db=self.wal.records)
        found = cur.first()
        while found:
            sid = SID.unpack(cur.key()[:8])[0]
            if _sealed_chunk_of(self, txn, sid, cur.value()) is not None:
                out.append(sid)
            found = cur.set_range(SID.pack(sid + 1))
        return out


def _sealed_chunk_of(store: StoreCore, txn: lmdb.Transaction, sid: int, record: bytes | memoryview) -> ChunkInfo | None:
    """The chunk of stream `sid` that holds a `records` value, if it is sealed."""
    raw = txn.get(chunk_key(sid, RECORD_HEADER.unpack_from(record)[0]), db=store.wal.chunks)
    if raw is None:
        return None
    info = ChunkInfo.decode(raw)
    return info if info.state == SEALED else None
