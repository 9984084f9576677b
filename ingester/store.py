"""Write operations on streams, run on the WAL writer thread (see wal.GroupCommitter).

Every operation validates first and mutates after, so a DS3Error leaves nothing behind.
Metadata is cached here (the writer is the only mutator); a stream's metadata is written
once per batch however many appends it took. A record and the producer state that
admitted it are written in the same transaction, so a crash can never keep one without
the other: an idempotent producer retrying after a restart is deduplicated exactly.
Chunk bookkeeping (store_sealing.py) and expiry (store_expiry.py) are mixins of Store, over
the state store_core.StoreCore names.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections.abc import Callable

import lmdb

from ingester import remote_forks
from ingester.buckets import Buckets
from ingester.chain import (
    refresh_tail,
)
from ingester.fork_source import fork_source
from ingester.journal import FOLD_RECORDS, JournalWriter
from ingester.records import (
    FLAG_END_OF_APPEND,
    SID,
    ProducerState,
    StreamMeta,
    new_first_chunk,
    producer_key,
)
from ingester.store_expiry import ExpiryBook
from ingester.store_sealing import SealingBook, descriptor_of
from ingester.visibility import Visibility
from ingester.wal import WalEnv
from ingester.writes import (  # the operations' vocabulary; imported from here by the callers too
    AppendRequest,
    AppendResult,
    Committed,
    CreateRequest,
    CreateResult,
    SealPolicy,
    Touches,
    _view,
)
from shared import jsonmode
from shared.errors import (
    BadRequest,
    Conflict,
    Gone,
    NotFound,
    ProducerSeqGap,
    StaleProducerEpoch,
    StreamClosed,
    Unavailable,
)
from shared.protocol import DEFAULT_CONTENT_TYPE, ProducerHeaders, is_json, media_type

PRODUCER_STATE_TTL_S = 7 * 24 * 3600


class Store(SealingBook, ExpiryBook):
    """Streams' writes: create, append, delete, producers, metadata cached for the batch;
    chunk bookkeeping in SealingBook (store_sealing.py), expiry in ExpiryBook (store_expiry.py)."""

    def __init__(
        self, wal: WalEnv, clock: Callable[[], float] = time.time, seal: SealPolicy | None = None
    ) -> None:
        self.wal = wal
        self.clock = clock
        self.seal = seal
        # Reads record TTL renewals here (from the event loop); the writer folds them in.
        self.touches = Touches()
        # Last append time per stream, newer than its stored metadata says (plain appends do
        # not rewrite it): read by bucket listings, persisted when the metadata is written.
        self.last_writes: dict[str, float] = {}
        self.buckets = Buckets(wal)
        self.journal = JournalWriter(wal)
        self._metas: dict[str, StreamMeta | None] = {}
        self._producers: dict[tuple[int, str], ProducerState | None] = {}
        self._dirty: dict[str, StreamMeta] = {}
        self._unpublished: dict[str, StreamMeta | None] = {}  # the batch's descriptor changes (see flush)
        self._news = Committed()
        self._expiry: list[tuple[float, str]] = []  # (deadline hint, path) min-heap
        self._aging: list[tuple[float, str]] = []  # (open chunk's first record time, path)
        # An open chunk's first record time is not in its stored metadata (plain appends do not
        # rewrite it): kept across reset(), or each aborted batch restarted every open chunk's
        # seal age, and a WAL full of unsealed data was never sealed while clients kept retrying
        # (found by QA: the map full, 503s every 2 s, the backlog never drained).
        self._opened: dict[str, tuple[int, float]] = {}  # path -> (chunk_start, first record time)
        self.releases_queued = False  # a fork of another ingester's stream was removed (remote_forks)
        # In a cluster, run by every write on the writer thread: Misdirected unless `path` is
        # ours now and not frozen for a move (ingester/moves.py, "Why nothing is lost").
        self.guard: Callable[[str, StreamMeta | None], None] | None = None
        # --durability store: commits hidden from readers until the store has them
        # (ingester/visibility.py); flush stages each, reset forgets an aborted one.
        self.visibility: Visibility | None = None

    # --- committer hooks -------------------------------------------------------------

    def flush(self, txn: lmdb.Transaction) -> Committed:
        """Write dirty metadata into the batch's transaction; return what the batch changed."""
        for path, meta in self._dirty.items():
            txn.put(path.encode(), meta.encode(), db=self.wal.streams)
        self._dirty.clear()
        if self.journal.entries(txn) >= FOLD_RECORDS:
            self.journal.fold(txn)
        news, self._news = self._news, Committed()
        # Descriptors as this commit leaves the streams, taken here, on the writer thread: the
        # metadata objects go on changing with later batches while the publisher writes.
        news.descriptors = {p: None if m is None else descriptor_of(m) for p, m in self._unpublished.items()}
        self._unpublished.clear()
        if self.visibility is not None and news.changed:
            self.visibility.stage(txn, news.changed)
        return news

    def reset(self) -> None:
        """A batch aborted: forget everything cached, reload from the WAL on demand (an open
        chunk keeps its age: _opened)."""
        for path, meta in self._metas.items():
            if meta is not None and meta.chunk_opened_at is not None:
                self._opened[path] = (meta.chunk_start, meta.chunk_opened_at)
        self._metas.clear()
        self._producers.clear()
        self._dirty.clear()
        self._unpublished.clear()
        self.journal.reset()
        self._news = Committed()
        if self.visibility is not None:
            self.visibility.unstage()

    # --- metadata --------------------------------------------------------------------

    def _load(self, txn: lmdb.Transaction, path: str) -> StreamMeta | None:
        if path in self._metas:
            return self._metas[path]
        raw = txn.get(path.encode(), db=self.wal.streams)
        meta = refresh_tail(txn, self.wal, StreamMeta.decode(raw), self.clock()) if raw is not None else None
        opened = self._opened.pop(path, None) if self._opened else None
        if meta is not None and meta.chunk_opened_at is not None and opened is not None and opened[0] == meta.chunk_start:
            meta.chunk_opened_at = min(meta.chunk_opened_at, opened[1])
        self._metas[path] = meta
        return meta

    def _save(self, meta: StreamMeta) -> None:
        self._metas[meta.path] = meta
        self._dirty[meta.path] = meta
        self._news.changed.add(meta.path)

    def _advanced(self, meta: StreamMeta) -> None:
        """Only the tail moved: the records say so (see chain.refresh_tail); skip the rewrite."""
        self._metas[meta.path] = meta
        self._news.changed.add(meta.path)

    def _publish(self, txn: lmdb.Transaction, meta: StreamMeta | None, path: str) -> None:
        """The stream's descriptor object must be (re)written: created, closed, deleted. The
        need is recorded with the change, so a crash before the publish cannot lose it."""
        if self.seal is not None:
            txn.put(b"pub:" + path.encode(), b"", db=self.wal.sys)
            self._unpublished[path] = meta

    def _live(self, txn: lmdb.Transaction, path: str, now: float, own: bool = True) -> StreamMeta | None:
        """The stream at `path`, expiring it first if its time is up (soft-deleted included).
        `own`: the stream is written (the cluster guard runs), not a fork's source."""
        meta = self._load(txn, path)
        if own and self.guard is not None:
            self.guard(path, meta)
        if meta is None or meta.soft_deleted:
            return meta
        if meta.expired(now, self.touches.get(path)):
            self._remove(txn, meta)
            return self._load(txn, path)
        return meta

    def _next_sid(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(b"next_sid", db=self.wal.sys)
        sid = SID.unpack(raw)[0] if raw else 1
        txn.put(b"next_sid", SID.pack(sid + 1), db=self.wal.sys)
        return sid

    def _lookup(self, txn: lmdb.Transaction) -> Callable[[str], StreamMeta | None]:
        return lambda path: self._load(txn, path)

    # --- removal ---------------------------------------------------------------------

    def _remove(self, txn: lmdb.Transaction, meta: StreamMeta) -> None:
        """Delete a stream; if forks still read it, keep its data (soft delete, 410)."""
        if meta.refcount > 0:
            self.buckets.stream_soft_deleted(txn, meta.path)
            meta.soft_deleted = True
            self._save(meta)
            self._publish(txn, meta, meta.path)
            return
        self._drop_prefix(txn, self.wal.records, SID.pack(meta.sid))
        self.journal.drop_stream(txn, meta.sid)
        self._drop_prefix(txn, self.wal.producers, SID.pack(meta.sid))
        self._drop_prefix(txn, self.wal.chunks, SID.pack(meta.sid))
        if self.seal is not None:
            # Recorded with the removal itself, so a crash cannot leak the stream's objects.
            txn.put(b"gc:" + meta.uid.encode(), meta.path.encode(), db=self.wal.sys)
            self._news.removed.append((meta.uid, meta.path))
        self._publish(txn, None, meta.path)
        self.buckets.stream_removed(txn, meta.path, meta.soft_deleted)
        self.last_writes.pop(meta.path, None)
        self._producers = {k: v for k, v in self._producers.items() if k[0] != meta.sid}
        txn.delete(meta.path.encode(), db=self.wal.streams)
        self._metas[meta.path] = None
        self._dirty.pop(meta.path, None)
        self._news.changed.add(meta.path)
        if meta.fork_source_key is not None:  # its source lives on another ingester
            remote_forks.forget(self, txn, meta)
        elif meta.fork_source is not None:
            source = self._load(txn, meta.fork_source)
            if source is not None and source.sid == meta.fork_source_sid:
                source.refcount = max(0, source.refcount - 1)
                self._save(source)
                if source.refcount == 0 and source.soft_deleted:
                    self._remove(txn, source)
                elif source.refcount == 0:
                    self.release_retained(txn, source)  # history a snapshot gave up while forks read it

    @staticmethod
    def _drop_prefix(txn: lmdb.Transaction, db: lmdb._Database, prefix: bytes) -> None:
        cur = txn.cursor(db)
        if not cur.set_range(prefix):
            return
        while cur.key()[: len(prefix)] == prefix:
            if not cur.delete():
                break

    # --- operations ------------------------------------------------------------------

    def create(self, txn: lmdb.Transaction, req: CreateRequest) -> CreateResult:
        now = self.clock()
        self.buckets.require(txn, req.path)
        existing = self._live(txn, req.path, now)
        if existing is not None:
            if existing.soft_deleted:
                raise Conflict(
                    "stream was deleted but forks still read it: the path cannot be reused "
                    "until every fork is deleted"
                )
            if self._same_config(existing, req):
                return CreateResult(False, _view(existing))
            raise Conflict("stream already exists with a different configuration")

        meta = StreamMeta(
            path=req.path, sid=0, content_type=req.content_type or DEFAULT_CONTENT_TYPE,
            created_at=now, last_access=now, ttl=req.ttl, expires_at=req.expires_at,
            expires_at_text=req.expires_at_text,
        )
        meta.first_chunk = meta.chunk = meta.tail_chunk = new_first_chunk()
        source: StreamMeta | None = None
        meta.uid = req.uid or secrets.token_hex(16)
        if req.remote_source is not None:
            remote_forks.install(self, txn, meta, req.remote_source)
            meta.fork_offset, meta.fork_sub_offset = req.fork_offset, req.fork_sub_offset or 0
            meta.first_chunk = meta.chunk = new_first_chunk(after=meta.tail_chunk)
        elif req.fork_from is not None:
            source = self._fork_source(txn, req, meta, now)
        messages = self._messages(meta.content_type, req.body, None, create=True)
        meta.sid = self._next_sid(txn)
        if source is not None:
            source.refcount += 1
            self._save(source)
        self._write_messages(txn, meta, messages, now)
        meta.closed = req.closed
        if meta.closed:
            self._roll(txn, meta, now)
        else:
            self._maybe_roll(txn, meta, now)
        self._save(meta)
        self.buckets.stream_added(txn, meta.path)
        self._publish(txn, meta, meta.path)
        self._track_expiry(meta)
        return CreateResult(True, _view(meta))

    def _fork_source(self, txn: lmdb.Transaction, req: CreateRequest, meta: StreamMeta, now: float) -> StreamMeta:
        return fork_source(self, txn, req, meta, now)

    @staticmethod
    def _same_config(meta: StreamMeta, req: CreateRequest) -> bool:
        if req.content_type is not None or req.fork_from is None:
            wanted = media_type(req.content_type or DEFAULT_CONTENT_TYPE)
            if wanted != media_type(meta.content_type):
                return False
        if req.fork_from is None:
            ttl_ok = req.ttl == meta.ttl and req.expires_at == meta.expires_at
        else:  # a fork without expiry headers inherited its source's
            ttl_ok = (req.ttl is None and req.expires_at is None) or (
                req.ttl == meta.ttl and req.expires_at == meta.expires_at
            )
        return (
            ttl_ok
            and req.closed == meta.closed
            and req.fork_from == meta.fork_source
            and (req.fork_offset is None or req.fork_offset == meta.fork_offset)
            and (req.fork_sub_offset or 0) == meta.fork_sub_offset
        )

    def append(self, txn: lmdb.Transaction, req: AppendRequest) -> AppendResult:
        now = self.clock()
        meta = self._live(txn, req.path, now)
        if meta is None:
            raise NotFound("stream not found")
        if meta.soft_deleted:
            raise Gone("stream was deleted")
        p = req.producer
        if meta.closed:
            if p is not None and meta.closed_by == [p.producer_id, p.epoch, p.seq]:
                return AppendResult(_view(meta), True, p.epoch, p.seq)
            if req.close and not req.body and p is None:
                return AppendResult(_view(meta), True)
            raise StreamClosed(meta.tail_offset)
        if req.body and media_type(req.content_type) != media_type(meta.content_type):
            raise Conflict(
                f"content type {media_type(req.content_type)!r} does not match the stream's "
                f"{media_type(meta.content_type)!r}"
            )
        state: ProducerState | None = None
        if p is not None:
            state = self._check_producer(txn, meta, p)
            if state is None:  # duplicate
                last = self._producer(txn, meta.sid, p.producer_id)
                return AppendResult(_view(meta), True, p.epoch, last.last_seq if last else p.seq)
        if req.stream_seq is not None and meta.stream_seq is not None and req.stream_seq <= meta.stream_seq:
            raise Conflict(f"Stream-Seq {req.stream_seq!r} is not greater than {meta.stream_seq!r}")
        messages = self._messages(meta.content_type, req.body, req.messages, create=False)
        if messages and self.seal is not None and self._unsealed_bytes(txn) > self.seal.wal_max_bytes:
            raise Unavailable("the write-ahead log is full until the object store takes uploads", 5)
        # --- validated: mutate ---
        self._write_messages(txn, meta, messages, now)
        if p is not None and state is not None:
            self._producers[(meta.sid, p.producer_id)] = state
            txn.put(producer_key(meta.sid, p.producer_id), state.encode(), db=self.wal.producers)
        structural = req.stream_seq is not None or req.close or meta.ttl is not None
        if req.stream_seq is not None:
            meta.stream_seq = req.stream_seq
        chunk = meta.chunk
        if req.close:
            meta.closed = True
            meta.closed_by = [p.producer_id, p.epoch, p.seq] if p is not None else None
            self._roll(txn, meta, now)
            self._publish(txn, meta, meta.path)
        else:
            self._maybe_roll(txn, meta, now)
        meta.last_access = now
        if structural or meta.chunk != chunk:
            self._save(meta)
        else:
            self._advanced(meta)
        return AppendResult(_view(meta), False, p.epoch if p else None, p.seq if p else None)

    def _messages(self, content_type: str, body: bytes, split: list[bytes] | None, *, create: bool) -> list[bytes]:
        if not is_json(content_type):
            return [body] if body else []
        if split is None:
            split = jsonmode.split_messages(body, allow_empty_array=create) if body else []
        return [jsonmode.frame(m) for m in split]

    def _write_messages(self, txn: lmdb.Transaction, meta: StreamMeta, messages: list[bytes], now: float) -> None:
        last = len(messages) - 1
        for i, data in enumerate(messages):
            meta.tail += len(data)
            flags = FLAG_END_OF_APPEND if i == last else 0
            self.journal.append(txn, meta.sid, meta.tail, meta.chunk, flags, data)
        if messages:
            meta.tail_chunk = meta.chunk
            meta.last_write_at = self.last_writes[meta.path] = now
            if meta.chunk_opened_at is None:
                meta.chunk_opened_at = now
                if self.seal is not None:
                    heapq.heappush(self._aging, (now, meta.path))

    def _producer(self, txn: lmdb.Transaction, sid: int, producer_id: str) -> ProducerState | None:
        key = (sid, producer_id)
        if key not in self._producers:
            raw = txn.get(producer_key(sid, producer_id), db=self.wal.producers)
            self._producers[key] = ProducerState.decode(raw) if raw is not None else None
        return self._producers[key]

    def _check_producer(self, txn: lmdb.Transaction, meta: StreamMeta, p: ProducerHeaders) -> ProducerState | None:
        """The producer's next state if the append is accepted; None for a duplicate."""
        now = self.clock()
        state = self._producer(txn, meta.sid, p.producer_id)
        if state is not None and now - state.updated_at > PRODUCER_STATE_TTL_S and p.epoch >= state.epoch:
            state = None  # forgotten after a week of silence, as the protocol allows
        if state is None or p.epoch > state.epoch:
            if p.seq != 0:
                if state is None:
                    raise ProducerSeqGap(0, p.seq)
                raise BadRequest("a new producer epoch must start at Producer-Seq 0")
            return ProducerState(p.epoch, 0, now)
        if p.epoch < state.epoch:
            raise StaleProducerEpoch(state.epoch)
        if p.seq <= state.last_seq:
            return None
        if p.seq != state.last_seq + 1:
            raise ProducerSeqGap(state.last_seq + 1, p.seq)
        return ProducerState(p.epoch, p.seq, now)

    def delete(self, txn: lmdb.Transaction, path: str) -> None:
        meta = self._live(txn, path, self.clock())
        if meta is None:
            raise NotFound("stream not found")
        if meta.soft_deleted:
            raise Gone("stream was already deleted")
        self._remove(txn, meta)

