"""The LMDB write-ahead log: the environment, and the single writer thread that
group-commits every operation that arrived while the previous commit was syncing.

The event loop never runs a write transaction: it submits an operation (a callable taking
the write transaction) and awaits a future that resolves only after the transaction that
applied it is durable (LMDB `sync=True`: data pages, fdatasync, meta page, fdatasync).

With a log configured (`on_logged`), operations get a LoggedTxn (logged_txn.py) that records
every write; a commit that wrote anything gets the next commit seq, persisted in `sys` by
the same transaction, and its write-set goes to `on_logged` (a shipper: object store log
segments, shared/logsegment.py) after the LMDB commit and before any outcome is delivered.
A hook may also take the write-set just before LMDB commits it (`before_commit`, see
OnLogged): store mode uploads the segment while LMDB syncs, and the outcomes wait for both.
Without one, operations get the raw transaction and no seq is kept.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future as ConcurrentFuture
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Generic, TypeVar, cast

import lmdb
from prometheus_client import Histogram

from ingester.logged_txn import LoggedTxn
from shared.errors import Conflict, DS3Error, Gone, NotFound, StaleProducerEpoch, Superseded, Unavailable
from shared.logsegment import DB_IDS, Commit

log = logging.getLogger("ds3.wal")


def relies_on_state(outcome: object) -> bool:
    """A refusal that says what the streams are (gone, closed, a sequence conflict, a stale
    producer epoch), unlike one about the request itself (malformed, too large): true only if
    the commits it read are, so it waits for them as a success does, and becomes the same 503
    if they fail to reach the store (found by QA: a close answered 503 made appends answer
    409 "stream is closed", and the standby that took over had the stream open)."""
    return isinstance(outcome, NotFound | Gone | Conflict | StaleProducerEpoch)


def gate_refusal(why: BaseException | None, in_wal: bool = False) -> Unavailable:
    """The 503 for an outcome whose commit's gate failed: the shipper's reason when it gave one
    (fenced, a lapsed lease, a log too far behind); a new exception per outcome (each is raised
    on its own). `in_wal`: it replaces a success, whose commit is in the WAL and may ship yet."""
    if isinstance(why, Superseded):  # (it says so to readers: a header)
        e: Unavailable = Superseded(why.message, why.epoch)
    elif isinstance(why, Unavailable):
        e = Unavailable(why.message, why.retry_after)
    else:
        e = Unavailable(NOT_SHIPPED_MESSAGE, 5)
    e.in_wal = in_wal
    return e


T = TypeVar("T")
_A = TypeVar("_A")
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
MAP_FULL_LOG_SECONDS = 60.0
MAP_FULL_MESSAGE = ("the write-ahead log is full; nothing was stored. Retry later (the server's operator "
                    "must raise --wal-map-size / DS3_WAL_MAP_SIZE)")
COMMIT_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
COMMIT_SEQ: Final = b"commit_seq"  # in `sys`: the last logged commit's seq
SEQ: Final = struct.Struct(">Q")
NOT_SHIPPED_MESSAGE = ("the write is in the write-ahead log but did not reach the object store; "
                       "retry (an idempotent producer's retry is deduplicated)")


class WalEnv:
    """One LMDB environment with the named databases of records.py."""

    def __init__(self, path: Path, map_size: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(path), map_size=map_size, max_dbs=16, sync=True, metasync=True,
            max_readers=512, readahead=False, lock=True,
        )
        self.streams = self.env.open_db(b"streams")
        self.records = self.env.open_db(b"records")
        self.journal = self.env.open_db(b"journal")  # see journal.py
        self.jtail = self.env.open_db(b"jtail")
        self.producers = self.env.open_db(b"producers")
        self.chunks = self.env.open_db(b"chunks")
        self.sys = self.env.open_db(b"sys")
        self.buckets = self.env.open_db(b"buckets")
        # The handles by their ids in log segments (shared/logsegment.py), and back.
        self.log_dbs: dict[int, lmdb._Database] = {i: getattr(self, name) for name, i in DB_IDS.items()}
        self.log_ids: dict[lmdb._Database, int] = {db: i for i, db in self.log_dbs.items()}

    def close(self) -> None:
        self.env.close()

    def stats(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {
                "streams": int(txn.stat(self.streams)["entries"]),
                "records": int(txn.stat(self.records)["entries"]) + int(txn.stat(self.journal)["entries"]),
                "record_bytes": self.record_bytes(txn),
            }

    def record_bytes(self, txn: lmdb.Transaction) -> int:
        """Pages holding unsealed messages (records and the journal not yet folded into them)."""
        return self.db_bytes(txn, self.records) + self.db_bytes(txn, self.journal)

    def commit_seq(self, txn: lmdb.Transaction) -> int:
        """The seq of the last logged commit (0: none yet)."""
        raw = txn.get(COMMIT_SEQ, db=self.sys)
        return int(SEQ.unpack(raw)[0]) if raw is not None else 0

    def db_bytes(self, txn: lmdb.Transaction, db: lmdb._Database) -> int:
        """Pages a database occupies now (freed pages are reused, the file never shrinks)."""
        st = txn.stat(db)
        pages = int(st["branch_pages"]) + int(st["leaf_pages"]) + int(st["overflow_pages"])
        return pages * int(st["psize"])


Op = Callable[[lmdb.Transaction], Any]
# Called on the event loop with (result, True) or (exception, False) once the operation's
# transaction is durable (or has failed).
Delivery = Callable[[Any, bool], None]


# Called on the writer thread with each logged commit (its seq and write-set, which it may
# keep: the committer makes a new list per commit) right after LMDB committed it, before any
# of the commit's outcomes is delivered. It returns None (deliver now) or a gate: a future
# that this commit's deliveries, and those of every later commit, wait for (a store
# durability mode: done when the segment holding the commit is uploaded). A gate that fails
# or is cancelled turns the commit's successes into 503s (nothing is promised). Keep it
# quick: the next batch cannot start before it returns.
#
# Optionally, the hook object also has (looked up with getattr, so a plain function is a hook
# too):
# - before_commit(commit) -> bool: called with the final write-set (the seq write included)
#   just before LMDB commits it; True if the hook took it (the shipper in store mode starts
#   uploading it while LMDB syncs). From then on the log may hold a commit the WAL has not:
#   so if LMDB's commit then fails, the committer applies the very same write-set again in a
#   new transaction (the state it starts from is the one the write-set was made on: the
#   failed transaction left nothing), and the batch goes on as if the first commit had
#   worked. Only if that fails too does the WAL lack what the log may hold: then
# - commit_failed(commit, exc) is called, and the committer refuses every write from then on
#   (503): the WAL may never diverge from the log and carry on. A restart finds the store's
#   log ahead of the WAL and restores from the store (ingester/logstore.py drop_wal_behind_log).
# - caught_up(seq) -> gate or None: for a batch that committed nothing but has successes (a
#   producer's duplicate, an idempotent create or close) or refusals that say what the streams
#   are (relies_on_state: a 409 for a closed stream...), which rely on the last commit, `seq`:
#   the gate an outcome of that commit would wait for now (the store durability mode: until a
#   segment covers it; 503 while uploads fail or the local log lags too far).
OnLogged = Callable[[Commit], "ConcurrentFuture[None] | None"]
BeforeCommit = Callable[[Commit], bool]
CommitFailed = Callable[[Commit, BaseException], None]
CaughtUp = Callable[[int], "ConcurrentFuture[None] | None"]
WAL_BROKEN_MESSAGE: Final = ("the write-ahead log could not commit a write whose log segment was already on its way "
                             "to the object store; this ingester acknowledges nothing more (restart it: it restores "
                             "from the store)")


@dataclass(slots=True)
class _Pending(Generic[T]):
    op: Callable[[lmdb.Transaction], T]
    reply: asyncio.Future[T] | ConcurrentFuture[T] | Delivery  # how the outcome reaches the caller


class GroupCommitter:
    """Runs write operations on one thread, many per durable transaction.

    Operations must validate before they mutate: a DS3Error raised by an operation fails
    only that operation (it changed nothing). Any other exception aborts the batch, the
    caller's caches are reset through `on_abort`, the operation is failed and the rest of
    the batch runs again. `on_commit` writes what the caller deferred into the transaction
    and returns what changed; that value reaches `on_durable` on the event loop after the
    sync (or is dropped if the commit failed). `on_logged`: see OnLogged.
    """

    def __init__(
        self,
        wal: WalEnv,
        loop: asyncio.AbstractEventLoop,
        *,
        on_abort: Callable[[], None],
        on_commit: Callable[[lmdb.Transaction], Any],
        on_durable: Callable[[Any], None],
        on_logged: OnLogged | None = None,
        hold: Callable[[int, Any], Any] | None = None,
        max_batch: int = 4096,
    ) -> None:
        self.wal = wal
        # hold(seq, changed): what of a logged commit's `changed` to deliver now (None: nothing);
        # it delivers the rest itself once the store has the commit (--durability store:
        # ingester/visibility.py; local: ingester/store_effects.py).
        self._hold = hold
        self.loop = loop
        self._on_abort = on_abort
        self._on_commit = on_commit
        self._on_durable = on_durable
        self._max_batch = max_batch
        self._on_logged = on_logged
        self._before_commit: BeforeCommit | None = getattr(on_logged, "before_commit", None)
        self._commit_failed: CommitFailed | None = getattr(on_logged, "commit_failed", None)
        self._caught_up: CaughtUp | None = getattr(on_logged, "caught_up", None)
        self.recommits = 0  # commits that failed after before_commit and were applied again
        # The last logged commit's seq (read here, advanced by the writer thread only).
        with wal.env.begin() as txn:
            self.seq = wal.commit_seq(txn)
        # Set once the last gated commit's outcomes went out (None: nothing gated pending).
        self._delivered: ConcurrentFuture[None] | None = None
        # SimpleQueue: a C-level put, and the writer wakes only when it has nothing to do.
        self._queue: queue.SimpleQueue[_Pending[Any] | None] = queue.SimpleQueue()
        self._stopping = False
        # Set (from any thread) when this process may acknowledge nothing more (fenced by a new
        # owner of the store prefix): every operation submitted or queued from then on gets it.
        self.refusal: DS3Error | None = None
        # Set for good when a handed-over commit could not reach the WAL (see OnLogged); unlike
        # `refusal`, which a regained ownership clears, nothing clears it.
        self.broken: DS3Error | None = None
        self._thread = threading.Thread(target=self._run, name="ds3-wal-writer", daemon=True)
        self.batches = 0
        self.ops = 0
        self.last_batch_size = 0
        self.map_full_refusals = 0
        self._map_full_logged_at = -math.inf
        # Observed once per commit on the writer thread (not per operation); collected by
        # ingester.metrics at scrape time.
        self.batch_sizes = Histogram("ds3_wal_commit_batch_size", "Operations per group commit.",
                                     buckets=BATCH_SIZE_BUCKETS, registry=None)
        self.commit_seconds = Histogram("ds3_wal_commit_seconds", "Time to run a batch of operations and make "
                                        "it durable (transaction and fsyncs).", buckets=COMMIT_SECONDS_BUCKETS,
                                        registry=None)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The writer thread runs and takes new operations."""
        return self._thread.is_alive() and not self._stopping

    def stop(self) -> None:
        self._stopping = True
        self._queue.put(None)  # wakes the writer; everything queued before it still runs
        self._thread.join(timeout=30)

    def submit(self, op: Callable[[lmdb.Transaction], T]) -> asyncio.Future[T]:
        if self._stopping:
            raise Unavailable("the ingester is shutting down")
        if (refusal := self.broken or self.refusal) is not None:
            raise refusal.with_traceback(None)  # one object raised again and again: its traceback would grow
        fut: asyncio.Future[T] = self.loop.create_future()
        self._queue.put(_Pending(op, fut))
        return fut

    def submit_callback(self, op: Callable[[lmdb.Transaction], Any], deliver: Delivery) -> None:
        """Like submit, for the fast lane: `deliver` is called on the loop with the outcome
        (no future, no extra loop iteration before the answer is written)."""
        if self._stopping:
            raise Unavailable("the ingester is shutting down")
        if (refusal := self.broken or self.refusal) is not None:
            raise refusal.with_traceback(None)  # one object raised again and again: its traceback would grow
        self._queue.put(_Pending(op, deliver))

    def run_sync(self, op: Callable[[lmdb.Transaction], T]) -> T:
        """Run one operation from a non-loop thread (startup, tests) and wait for it."""
        fut: ConcurrentFuture[T] = ConcurrentFuture()
        self._queue.put(_Pending(op, fut))
        return fut.result()

    # --- writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch: list[_Pending[Any]] = []
            stop = first is None
            if first is not None:
                batch.append(first)
            while len(batch) < self._max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    continue
                batch.append(item)
            if batch and (refusal := self.broken or self.refusal) is not None:
                self._deliver_in_order(None, [(p, refusal, False) for p in batch], None)
            elif batch:
                self._run_batch(batch)
            if stop and self._queue.empty():
                return

    def _run_batch(self, batch: list[_Pending[Any]]) -> None:
        started = time.perf_counter()
        results: list[tuple[_Pending[Any], Any, bool]] = []
        todo = batch
        changed: Any = None
        logged: Commit | None = None
        reran = False
        while todo:
            failed_at: int | None = None
            outcome: list[tuple[_Pending[Any], Any, bool]] = []
            commit: Commit | None = None
            handed = False  # the write-set went to before_commit: it must reach the WAL now
            try:
                try:
                    with self.wal.env.begin(write=True) as raw:
                        # A new recorder per attempt: an aborted attempt's writes go with it.
                        recorder = LoggedTxn(raw, self.wal.log_ids) if self._on_logged is not None else None
                        txn = raw if recorder is None else cast(lmdb.Transaction, recorder)
                        for i, p in enumerate(todo):
                            try:
                                outcome.append((p, p.op(txn), True))
                            except DS3Error as e:
                                outcome.append((p, e, False))
                            except lmdb.MapFullError:
                                failed_at = i
                                raise _MapFull from None
                            except Exception as e:
                                log.exception("write operation failed; aborting its batch")
                                failed_at = i
                                outcome.append((p, e, False))
                                raise _AbortBatch from e
                        news = self._on_commit(txn)
                        if recorder is not None and recorder.writes:  # a commit that wrote nothing has no seq
                            commit = Commit(self.seq + 1, recorder.writes)
                            recorder.put(COMMIT_SEQ, SEQ.pack(commit.seq), db=self.wal.sys)
                            if self._before_commit is not None:
                                handed = True  # (even if it raises: it may have taken the commit)
                                handed = self._before_commit(commit)
                except Exception as e:
                    if not handed:
                        raise
                    assert commit is not None
                    if not self._recommit(commit, e):
                        raise _WalBroken from e
                # the `with` committed (or the write-set again): durable now. (Not before: what
                # a failed commit would have changed must not reach on_durable, e.g. objects of
                # a delete to remove.)
                changed = news
                if commit is not None:
                    self.seq, logged = commit.seq, commit
                    if self._hold is not None:  # the rest once the store has the commit
                        changed = self._hold(commit.seq, news)
                results.extend(outcome)
                todo = []
            except _WalBroken:
                self._on_abort()
                results.extend((p, Unavailable(WAL_BROKEN_MESSAGE, 30), False) for p in todo)
                todo = []
            except _AbortBatch:
                self._on_abort()
                assert failed_at is not None
                bad = todo[failed_at]
                results.append((bad, Unavailable("internal error while writing; nothing was stored"), False))
                todo, reran = todo[:failed_at] + todo[failed_at + 1 :], True
            except _MapFull:
                # The operations before the one that found no room run again (they fit); it
                # and the rest are refused: each would fill the map again.
                self._on_abort()
                assert failed_at is not None
                results.extend((p, self._map_full(), False) for p in todo[failed_at:])
                todo, reran = todo[:failed_at], True
            except lmdb.MapFullError:  # while committing
                self._on_abort()
                results.extend((p, self._map_full(), False) for p in todo)
                todo = []
            except lmdb.Error as e:
                self._on_abort()
                log.exception("write-ahead log commit failed (%d writes refused with 503)", len(todo))
                # (found by QA: a full disk read "commit failed", which said nothing of why)
                results.extend((p, Unavailable(f"write-ahead log commit failed ({e}: the data dir's disk may be full "
                                               "or failing); nothing was stored, retry", 5), False) for p in todo)
                todo = []
            except Exception:  # on_commit failed: nothing was committed; never let the writer die
                self._on_abort()
                log.exception("write-ahead log batch failed")
                results.extend(
                    (p, Unavailable("internal error while writing; nothing was stored"), False) for p in todo
                )
                todo = []
        if reran and len(results) > 1:  # refusals came before the rerun: answer in the order they came
            order = {id(p): i for i, p in enumerate(batch)}
            results.sort(key=lambda r: order[id(r[0])])
        self.batches += 1
        self.ops += len(batch)
        self.last_batch_size = len(batch)
        self.commit_seconds.observe(time.perf_counter() - started)
        self.batch_sizes.observe(len(batch))
        if logged is not None:
            assert self._on_logged is not None
            gate = self._gate(self._on_logged, logged, logged.seq)
        elif self._caught_up is not None and any(ok or relies_on_state(v) for _, v, ok in results):
            gate = self._gate(self._caught_up, self.seq, self.seq)  # (a batch that committed nothing)
        else:
            gate = None
        self._deliver_in_order(gate, results, changed)

    def _recommit(self, commit: Commit, exc: BaseException) -> bool:
        """LMDB failed to commit a write-set the log already took (before_commit): apply the
        same writes in a new transaction, so the WAL holds exactly what the log may. False if
        that fails too: the committer then refuses everything (see OnLogged)."""
        from ingester.replay import apply  # (replay imports this module)

        log.error("write-ahead log commit %d failed after its log segment was handed over (%r); applying its "
                  "writes again", commit.seq, exc)
        try:
            with self.wal.env.begin(write=True) as txn:
                apply(txn, self.wal, commit)
            self.recommits += 1
            return True
        except Exception as again:
            log.critical("write-ahead log commit %d failed again (%r): acknowledging nothing more", commit.seq, again)
            self.broken = Unavailable(WAL_BROKEN_MESSAGE, 30)
            if self._commit_failed is not None:
                try:
                    self._commit_failed(commit, again)
                except Exception:
                    log.exception("the commit log hook failed on commit %d", commit.seq)
            return False

    @staticmethod
    def _gate(hook: Callable[[_A], ConcurrentFuture[None] | None], arg: _A, seq: int) -> ConcurrentFuture[None] | None:
        """The log hook's gate for the outcomes relying on commit `seq` (`hook(arg)`: on_logged
        with the commit, or caught_up with its seq)."""
        try:
            return hook(arg)
        except Exception as e:  # the commit stands; what the hook failed to take is not promised
            log.exception("the commit log hook failed on commit %d", seq)
            failed: ConcurrentFuture[None] = ConcurrentFuture()
            failed.set_exception(e)
            return failed

    def _deliver_in_order(
        self, gate: ConcurrentFuture[None] | None, results: list[tuple[_Pending[Any], Any, bool]], changed: Any
    ) -> None:
        """Deliver now, unless this commit has a gate or an earlier gated commit's outcomes
        are not out yet: then once both are (so outcomes still go out in commit order, and
        a write that changed nothing, such as a duplicate, is not acknowledged before the
        commit it relies on)."""
        prev = self._delivered
        if gate is None and (prev is None or prev.done()):
            self._delivered = None
            self._deliver_threadsafe(results, changed)
            return
        done: ConcurrentFuture[None] = ConcurrentFuture()
        self._delivered = done

        def release(_: object = None) -> None:  # on whichever thread completed the gate
            try:
                out = results
                if gate is not None and (gate.cancelled() or gate.exception() is not None):
                    why = None if gate.cancelled() else gate.exception()
                    out = [(p, gate_refusal(why, in_wal=ok), False) if ok or relies_on_state(value) else (p, value, ok)
                           for p, value, ok in results]
                self._deliver_threadsafe(out, changed)
            finally:
                done.set_result(None)

        def after_prev(_: object = None) -> None:
            if gate is None:
                release()
            else:
                gate.add_done_callback(release)

        if prev is None:
            after_prev()
        else:
            prev.add_done_callback(after_prev)

    def _map_full(self) -> Unavailable:
        """The refusal of an operation that found the LMDB map full; the operator is told at
        most once per MAP_FULL_LOG_SECONDS (not once per operation, with no traceback)."""
        self.map_full_refusals += 1
        now = time.monotonic()
        if now - self._map_full_logged_at >= MAP_FULL_LOG_SECONDS:
            self._map_full_logged_at = now
            log.error("the write-ahead log's LMDB map is full: writes are refused with 503 (%d so far) until "
                      "sealing frees room; raise --wal-map-size (DS3_WAL_MAP_SIZE) and restart",
                      self.map_full_refusals)
        return Unavailable(MAP_FULL_MESSAGE, 30)

    def _deliver_threadsafe(self, results: Iterable[tuple[_Pending[Any], Any, bool]], changed: Any) -> None:
        loop_items: list[tuple[asyncio.Future[Any] | Delivery, Any, bool]] = []
        for p, value, ok in results:
            if isinstance(p.reply, ConcurrentFuture):
                if ok:
                    p.reply.set_result(value)
                else:
                    p.reply.set_exception(value)
            else:
                loop_items.append((p.reply, value, ok))
        if loop_items or changed:
            try:
                self.loop.call_soon_threadsafe(self._deliver, loop_items, changed)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _deliver(self, items: list[tuple[asyncio.Future[Any] | Delivery, Any, bool]], changed: Any) -> None:
        callbacks: list[tuple[Delivery, Any, bool]] = []
        for fut, value, ok in items:
            if not isinstance(fut, asyncio.Future):
                callbacks.append((fut, value, ok))
            elif fut.done():
                continue
            elif ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)
        if changed:
            self._on_durable(changed)
        # After on_durable, as a future's done-callbacks would run: readers are woken first.
        for deliver, value, ok in callbacks:
            try:
                deliver(value, ok)
            except Exception:  # one broken answer must not keep the others from going out
                log.exception("delivering a write's outcome failed")


class _AbortBatch(Exception):
    pass


class _MapFull(Exception):
    pass


class _WalBroken(Exception):
    """A handed-over commit could not be written to the WAL, even again."""
