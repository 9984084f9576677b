"""Read side of the WAL: short read transactions on a small thread pool, so the event loop
does not wait on LMDB for a read of any size; the fast lane runs the small ones (read_small: a
few KiB at a stream's tail, in the page cache) on the loop itself, where a hand-off to the pool
would cost more than the read. A read sees one committed snapshot: metadata and records agree."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import lmdb

from ingester.chain import (
    MetaLookup,
    Sealed,
    at_position,
    chain_records,
    fork_points,
    record_at,
    refresh_tail,
)
from ingester.records import Record, StreamMeta
from ingester.visibility import HIDDEN_CHANGING, Visibility
from ingester.wal import WalEnv
from shared import offsets
from shared.config import LMDB_MAX_KEY
from shared.errors import BadRequest, Gone, Misdirected, NotFound, Retained, Unavailable
from shared.protocol import is_json

T = TypeVar("T")
NOT_ISSUED = "offset is not one this stream issued (its chunk id does not match its position)"
INLINE_READ_BYTES = 64 * 1024  # Reads.read_small: what the event loop reads itself


@dataclass(slots=True)
class ReadResult:
    meta: StreamMeta
    start: int
    messages: list[bytes] = field(default_factory=list)
    end: int = 0
    next_offset: str = ""
    sealed: Sealed | None = None  # the read starts in a sealed chunk: fetch it from the store
    fork_points: tuple[int, ...] = ()  # where the data of one stream of its fork chain begins

    @property
    def continues(self) -> bool:
        """The read stopped where a fork's own data begins, short of the tail: a page goes on
        into it (sealed_reads.complete_read), as a client reading a fork with one GET expects."""
        return self.sealed is None and self.end < self.meta.tail and self.end in self.fork_points

    @property
    def up_to_date(self) -> bool:
        return self.end >= self.meta.tail

    @property
    def closed_at_end(self) -> bool:
        return self.meta.closed and self.end >= self.meta.tail


@dataclass(slots=True)
class MessagesPage:
    """Whole messages from a boundary, each with the position it ends at."""

    meta: StreamMeta
    messages: list[tuple[int, bytes]] = field(default_factory=list)
    sealed: Sealed | None = None  # the next message is in a sealed chunk: read it from the store


@dataclass(frozen=True, slots=True)
class Position:
    """Where a position falls in a stream, for snapshot publishing (extensions §2.2)."""

    meta: StreamMeta
    chunk: int  # the chunk id its canonical offset names
    boundary: bool | None  # whether a message ends there; None: ask the sealed chunk's index
    sealed: Sealed | None  # the sealed message ending at or spanning it (when boundary is None)


class Reads:
    def __init__(self, wal: WalEnv, touches: dict[str, float], threads: int = 4) -> None:
        self.wal = wal
        self.touches = touches
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ds3-wal-read")
        self.visibility: Visibility | None = None  # --durability store (ingester/visibility.py)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _meta(self, txn: lmdb.Transaction, path: str) -> StreamMeta | None:
        key = path.encode("utf-8", "surrogatepass")  # (a lone surrogate names no stream)
        if not 0 < len(key) <= LMDB_MAX_KEY:  # no such key (LMDB refuses to look: a 500, not a 404)
            return None
        raw = txn.get(key, db=self.wal.streams)
        if self.visibility is not None:
            hidden, seen = self.visibility.hidden(path)
            if hidden:  # a commit the store lacks changed it: what readers saw before it
                if seen is None:
                    return None
                if seen.expired(time.time(), self.touches.get(path)):
                    return copy.copy(seen)  # gone whatever the store holds: its expiry is already decided
                if raw is None or StreamMeta.decode(raw).sid != seen.sid:  # deleted or recreated meanwhile
                    raise Unavailable(HIDDEN_CHANGING, 1)
                return copy.copy(seen)
        return refresh_tail(txn, self.wal, StreamMeta.decode(raw), time.time()) if raw is not None else None

    def _visible(self, txn: lmdb.Transaction, path: str) -> StreamMeta:
        meta = self._meta(txn, path)
        if meta is None:
            raise NotFound("stream not found")
        if meta.soft_deleted:
            raise Gone("stream was deleted")
        if meta.moved_to is not None:  # frozen: moved to another ingester (ingester/moves.py)
            to_id, to_url, generation = meta.moved_to
            raise Misdirected(str(to_id), str(to_url), int(generation), "this ingester (it moved the stream out)")
        if meta.expired(time.time(), self.touches.get(path)):
            if meta.refcount > 0:
                raise Gone("stream expired")
            raise NotFound("stream not found")
        return meta

    # --- synchronous bodies (pool threads) ---------------------------------------------

    def sealed_at(self, path: str, position: int) -> tuple[Sealed, bool] | None:
        """The sealed chunk holding `position` of `path`'s stream (and whether it is JSON)."""
        with self.wal.env.begin(buffers=False) as txn:
            meta = self._meta(txn, path)
            if meta is None or position >= meta.tail:
                return None
            rec = record_at(txn, self.wal, meta, lambda p: self._meta(txn, p), position)
            return (rec, is_json(meta.content_type)) if isinstance(rec, Sealed) else None

    def position_sync(self, path: str, position: int) -> Position | None:
        """None when `position` is past the tail."""
        with self.wal.env.begin(buffers=False) as txn:
            meta = self._visible(txn, path)
            if position > meta.tail:
                return None

            def lookup(p: str) -> StreamMeta | None:
                return self._meta(txn, p)

            chunk, boundary, rec = at_position(txn, self.wal, meta, lookup, position)
            return Position(meta, chunk, boundary, rec if boundary is None and isinstance(rec, Sealed) else None)

    def messages_sync(self, path: str, start: int, until: int, max_bytes: int) -> MessagesPage:
        """Messages in [start, until) from the WAL, up to about max_bytes (at least one)."""
        with self.wal.env.begin(buffers=False) as txn:
            meta = self._visible(txn, path)
            page = MessagesPage(meta)
            records, page.sealed = self._page(txn, meta, lambda p: self._meta(txn, p), start, until, max_bytes)
            page.messages = [(rec.end, rec.data) for rec in records]
            return page

    def head_sync(self, path: str) -> StreamMeta:
        with self.wal.env.begin(buffers=False) as txn:
            return self._visible(txn, path)

    def read_sync(self, path: str, start: offsets.Offset | str, max_bytes: int) -> ReadResult:
        res = self.read_small(path, start, max_bytes, None)
        assert res is not None
        return res

    def read_small(self, path: str, start: offsets.Offset | str, max_bytes: int,
                   limit: int | None = INLINE_READ_BYTES) -> ReadResult | None:
        """read_sync's read if it has at most `limit` bytes to look at, else None (having read
        only the stream's metadata). The event loop may run such a read itself: what lies
        between an offset near the tail and the tail is what the last commits wrote, in the
        page cache, and a hand-off to the pool (two thread switches and the GIL passed back and
        forth) costs more than the read."""
        with self.wal.env.begin(buffers=False) as txn:
            meta = self._visible(txn, path)

            def lookup(p: str) -> StreamMeta | None:
                return self._meta(txn, p)

            if meta.snapshot_offset is not None and (
                start == offsets.START or (isinstance(start, offsets.Offset) and start.position < meta.earliest)
            ):
                raise Retained(meta.snapshot_offset)
            if start == offsets.START:
                pos = 0
            elif start == offsets.NOW:
                pos = meta.tail
            else:
                assert isinstance(start, offsets.Offset)
                pos = start.position
                if pos > meta.tail:
                    raise BadRequest("offset is beyond the end of the stream")
                named, boundary, _ = at_position(txn, self.wal, meta, lookup, pos)
                if is_json(meta.content_type) and boundary is False:
                    raise BadRequest("offset is not at a message boundary of this JSON stream")
                # An offset names the chunk holding the byte before its position: one that names
                # another is not this stream's (another stream's, a deleted incarnation's, made
                # up), and reading from its position alone would skip or repeat data unseen.
                # (Position 0 is the start whatever it names: nothing can be skipped from there.)
                if pos and start.chunk != named:
                    raise BadRequest(NOT_ISSUED)
            if limit is not None and meta.tail - pos > limit:
                return None
            return self._collect(txn, meta, lookup, pos, max_bytes)

    def continue_sync(self, path: str, position: int, max_bytes: int) -> ReadResult:
        """More of a read that reached a fork point at `position` (sealed_reads.complete_read):
        no offset to check, the position is one this read reached."""
        with self.wal.env.begin(buffers=False) as txn:
            meta = self._visible(txn, path)
            return self._collect(txn, meta, lambda p: self._meta(txn, p), min(position, meta.tail), max_bytes)

    def _collect(self, txn: lmdb.Transaction, meta: StreamMeta, lookup: MetaLookup, pos: int,
                 max_bytes: int) -> ReadResult:
        """Records from `pos` up to about max_bytes (at least one), until a sealed chunk."""
        result = ReadResult(meta=meta, start=pos, end=pos, fork_points=fork_points(meta, lookup))
        records, result.sealed = self._page(txn, meta, lookup, pos, meta.tail, max_bytes)
        result.messages = [rec.data for rec in records]
        if records:
            result.end = records[-1].end
        if result.end >= meta.tail:
            result.next_offset = meta.tail_offset
        elif records:
            result.next_offset = offsets.encode(records[-1].chunk, result.end)
        elif result.sealed is None:  # nothing read and not at the tail: a broken chain
            raise LookupError(f"stream {meta.path!r} has no data at position {pos}")
        return result

    def _page(self, txn: lmdb.Transaction, meta: StreamMeta, lookup: MetaLookup, pos: int, until: int,
              max_bytes: int) -> tuple[list[Record], Sealed | None]:
        """The WAL's records of the chain in [pos, until), up to about max_bytes (at least one),
        as far as the first sealed chunk: (records, that chunk if it comes first)."""
        records: list[Record] = []
        size = 0
        for rec in chain_records(txn, self.wal, meta, lookup, pos, until):
            if isinstance(rec, Sealed):
                return records, None if records else rec
            if records and size + len(rec.data) > max_bytes:
                break
            records.append(rec)
            size += len(rec.data)
        return records, None

    # --- async wrappers ------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a read-only function on the read pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run a read-only function on the read pool: its future, done on the loop (the fast
        lane answers from its callback, with no task)."""
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def head(self, path: str) -> StreamMeta:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.head_sync, path)

    async def read(self, path: str, start: offsets.Offset | str, max_bytes: int) -> ReadResult:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.read_sync, path, start, max_bytes
        )
