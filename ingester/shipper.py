"""The log shipper: every logged group commit goes to the object store, in commit order (issue 14).

The GroupCommitter calls `on_logged` on its writer thread with each commit's write-set; the
hook only queues it (under a lock) and, when there is something to do, wakes the shipping
task on the event loop, which encodes segments (shared/logsegment.py, stamped with our
ownership epoch) and uploads them one at a time under `log/` with if_absent.

Two modes (--durability):
- store: the hook returns a gate, shared by every commit gathered until the shipper next
  takes the queue; it is completed once a segment holding those commits is in the store
  (and our lease still holds), so an append is acknowledged only then. One PUT per group
  commit, or per batch of commits gathered while the previous PUT was in flight. If the
  upload keeps failing (GATE_ATTEMPTS attempts or GATE_SECONDS), the waiting gates fail:
  those writes answer 503 (they are in the local WAL but nothing is promised); the commits
  stay queued and are shipped once the store answers again.
  The segment's upload starts before LMDB commits (the committer's before_commit hook,
  ingester/wal.py OnLogged): the PUT and LMDB's fsyncs run at the same time, and the
  outcomes wait for both. Why this is safe: the write-set handed over is final (it is what
  the transaction holds, the seq write included), commits are handed over in seq order on
  the one writer thread, and nothing is acknowledged before both the LMDB commit and the
  segment (and every one before it) are durable. What remains is a segment in the store
  whose commit the WAL lacks: (1) LMDB's commit failed: the committer applies the same
  write-set again; if that fails too it acknowledges nothing more and commit_failed() fences
  the shipper, so the WAL never carries on from a different commit of that seq; (2) the
  process died between the PUT and the fsync: the commit was never acknowledged, and it is
  exactly the one that follows the WAL's last commit; a restart on that data dir finds the
  log ahead of the WAL and restores from the store (logstore.drop_wal_behind_log), which holds
  every acknowledged commit (in store mode nothing is acknowledged before it is there).
  Either way the commit's effect is one a client was never promised and may see: as with a
  503 from a failed gate, a retry of an idempotent producer is deduplicated.
- local: no gate (acknowledged after the local fsync) while our lease holds (a failed gate,
  503, once it does not: ownership.valid() is checked after every commit, before its
  outcomes go out); the queue is shipped at most about --ship-interval after its oldest
  commit.

A segment is cut from whatever is queued at each attempt, so a retry after an upload whose
answer was lost may write a longer segment that overlaps the first: harmless (replay skips
what it applied; ingester/logstore.py). An if_absent PUT refused on a key whose content is
ours counts as done.

Checkpoints: a compacted copy of the LMDB env (env.copy, in a thread) uploaded as
`checkpoint/<seq>-<epoch>.mdb`; then segments entirely at or below its seq and older
checkpoints are deleted. Taken every --checkpoint-interval (if anything was shipped since),
at start when the store does not cover the local WAL (write-sets live only in memory: after
a crash the local seq can be ahead of the shipped log), and when the queue outgrows
MAX_QUEUED_BYTES while the store is down (the queue is then dropped: the checkpoint covers
it). The copy is read into memory for the upload (ObjectStore.put takes bytes).

Fencing: before every upload the shipper checks the ownership (shared/ownership.py); fenced,
it uploads nothing more and fails every gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future as ConcurrentFuture
from pathlib import Path
from typing import Final, Literal

import lmdb

from ingester.logstore import (
    CHECKPOINT_DIR,
    ORPHANS_MAX,
    StartRefused,
    checkpoint_key,
    list_log,
    parse_checkpoint_key,
)
from ingester.wal import WalEnv
from shared.errors import ObjectNotFound, ObjectStoreError, PreconditionFailed, Superseded, Unavailable
from shared.logsegment import LOG_DIR, Commit, encode, parse_segment_key, segment_key
from shared.objectstore import ObjectStore
from shared.ownership import Ownership

log = logging.getLogger("ds3.shipper")

Durability = Literal["local", "store"]
MAX_SEGMENT_BYTES: Final = 16 * 1024 * 1024  # a segment is cut at about this many bytes of writes
MAX_QUEUED_BYTES: Final = 256 * 1024 * 1024  # past this, the queue is dropped for a checkpoint
GATE_ATTEMPTS: Final = 3  # store mode: failed uploads in a row before waiting writes get 503
GATE_SECONDS: Final = 5.0  # ... or this long since the first failure
BACKOFF_FIRST: Final = 0.05
BACKOFF_CAP: Final = 5.0
# store mode: segment PUTs in flight at once (acknowledged in commit order); a recovery tells
# the orphans they may leave beyond a failed one from a gap by this bound
UPLOADS_IN_FLIGHT: Final = ORPHANS_MAX + 1
CHECKPOINT_SEGMENTS: Final = 5000  # segments since the last checkpoint that call for one early ...
CHECKPOINT_MIN_SECONDS: Final = 30.0  # ... but no more often than this
ENCODE_INLINE_BYTES: Final = 256 * 1024  # larger segments are encoded on a worker thread
NOT_SHIPPED: Final = ("the write is in the write-ahead log but its log segment did not reach the object store; "
                      "retry (an idempotent producer's retry is deduplicated)")


def _size(commit: Commit) -> int:
    return 12 + sum(10 + len(k) + len(v) for _, _, k, v in commit.writes)


class Shipper:
    def __init__(
        self,
        wal: WalEnv,
        objects: ObjectStore,
        loop: asyncio.AbstractEventLoop,
        *,
        durability: Durability = "local",
        interval: float = 1.0,
        checkpoint_interval: float = 300.0,
        ownership: Ownership | None = None,
        shipped_seq: int = 0,
        uploads: int = UPLOADS_IN_FLIGHT,
        early: bool = True,
    ) -> None:
        self.wal = wal
        self.objects = objects
        self.loop = loop
        self.durability = durability
        self.interval = interval
        self.checkpoint_interval = checkpoint_interval
        self.ownership = ownership
        self.uploads = min(max(1, uploads), UPLOADS_IN_FLIGHT)  # store mode: segment uploads in flight
        self.early = early  # store mode: upload a commit's segment while LMDB syncs it (before_commit)
        self._lock = threading.Lock()
        # Guarded by the lock (the writer thread appends, the loop takes):
        self._queue: deque[Commit] = deque()
        self._queued_bytes = 0
        self._oldest_at: float | None = None  # monotonic time the oldest queued commit arrived
        self._gates: deque[list[object]] = deque()  # [last seq, gate], in seq order
        self._open_gate: list[object] | None = None  # the entry commits join until the next take
        self._taken_upto = 0  # queued commits up to this seq are in an upload in flight
        self._early_seq = 0  # commits up to this seq were queued before their LMDB commit
        self._landed_seq = 0  # commits up to this seq are in the store (_advance)
        self._need_checkpoint = False
        # Loop side:
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failures = 0
        self._failing_since: float | None = None
        self._fenced: str | None = None
        self._checkpoint_lock = asyncio.Lock()
        self._last_checkpoint_at = time.monotonic()
        self._shipped_since_checkpoint = 0
        self._segments_since_checkpoint = 0
        self.shipped_seq = shipped_seq  # the highest commit seq known to be in the store
        self.shipped_at = time.time()  # when the commit at shipped_seq ... was shipped (wall)
        # metrics
        self.segments_uploaded = 0
        self.segment_bytes = 0
        self.upload_failures = 0
        self.checkpoints_uploaded = 0
        self.checkpoint_bytes = 0
        self.objects_deleted = 0
        self.last_checkpoint_seq = 0
        self.early_commits = 0  # commits whose upload started before LMDB committed them
        # The committer's hook (wal.OnLogged): a callable with before_commit and commit_failed.
        self.on_logged = LogHook(self)

    # --- writer thread ---------------------------------------------------------------------

    def before_commit(self, commit: Commit) -> bool:
        """Store mode: queue the commit (and wake the uploads) before LMDB commits it, so the
        PUT runs while LMDB syncs. False (on_logged queues it after the commit) in local mode,
        fenced, or while the store keeps failing (on_logged answers 503 at once then)."""
        if self.durability != "store" or not self.early:
            return False
        with self._lock:
            if self._fenced is not None or self._failures >= GATE_ATTEMPTS:
                return False
            self._enqueue(commit)
            self._early_seq = commit.seq
            self.early_commits += 1
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self.loop.call_soon_threadsafe(self._wake.set)
        return True

    def commit_failed(self, commit: Commit, exc: BaseException) -> None:
        """LMDB could not commit what before_commit queued (not even a second time): the log
        may hold a commit the WAL lacks, so ship nothing more (see the module docstring)."""
        why = f"the write-ahead log could not commit {commit.seq}, whose log segment may be in the store: {exc!r}"
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.fence, why)

    def _enqueue(self, commit: Commit) -> bool:
        """Under the lock: append to the queue; whether it was empty."""
        first = not self._queue
        self._queue.append(commit)
        self._queued_bytes += _size(commit)
        if first:
            self._oldest_at = time.monotonic()
        return first

    def _logged(self, commit: Commit) -> ConcurrentFuture[None] | None:
        """After LMDB committed: queue the commit (unless before_commit did); in store mode,
        its gate."""
        gate: ConcurrentFuture[None] | None = None
        with self._lock:
            if self._fenced is not None:
                failed: ConcurrentFuture[None] = ConcurrentFuture()
                failed.set_exception(Superseded(self._fenced, self._epoch()))
                return failed
            early = commit.seq <= self._early_seq
            first = False if early else self._enqueue(commit)
            if early and commit.seq <= self._landed_seq:
                # Its segment landed (our lease held then) while LMDB synced. Our lease must
                # still hold now (a process frozen during the fsync: as in local mode below).
                if self.ownership is None or self.ownership.valid():
                    return None
                lapsed: ConcurrentFuture[None] = ConcurrentFuture()
                lapsed.set_exception(Superseded("the lease on the store prefix ran out", self._epoch()))
                return lapsed
            if self.durability == "store" and self._failures >= GATE_ATTEMPTS:
                # The store is failing: answer 503 now rather than after the next attempt (the
                # commit is queued all the same, and shipped once the store answers).
                gate = ConcurrentFuture()
                gate.set_exception(Unavailable(NOT_SHIPPED, 5))
            elif self.durability == "local" and self.ownership is not None and not self.ownership.valid():
                # Local mode acknowledges after the fsync, but not once our lease is over (a
                # process frozen past it, then resumed, before the keeper noticed): another
                # ingester may own the prefix by now. 503 (the commit is in this WAL only).
                gate = ConcurrentFuture()
                gate.set_exception(Superseded("the lease on the store prefix ran out", self._epoch()))
            elif self.durability == "store" and early:
                # A gate of its own: its segment may be cut already (the next commit's may not).
                own: list[object] = [commit.seq, ConcurrentFuture()]
                self._gates.append(own)
                self._open_gate = None
                gate = own[1]  # type: ignore[assignment]
            elif self.durability == "store":
                entry = self._open_gate
                if entry is None:
                    entry = self._open_gate = [commit.seq, ConcurrentFuture()]
                    self._gates.append(entry)
                entry[0] = commit.seq
                gate = entry[1]  # type: ignore[assignment]
            wake = not early and (first or self.durability == "store" or self._queued_bytes >= MAX_SEGMENT_BYTES)
        if wake:
            with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
                self.loop.call_soon_threadsafe(self._wake.set)
        return gate

    # --- state ---------------------------------------------------------------------------

    def _epoch(self) -> int:
        return self.ownership.epoch if self.ownership is not None else 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def lag_seconds(self) -> float:
        """How long the oldest commit not yet in the store has waited (0: nothing waits)."""
        oldest = self._oldest_at
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    def fence(self, why: str) -> None:
        """Upload nothing more; every waiting and future gate fails."""
        if self._fenced is not None:
            return
        self._fenced = why
        log.error("log shipping stopped: %s", why)
        with self._lock:
            gates = [g for _, g in self._gates]
            self._gates.clear()
            self._open_gate = None
        for g in gates:
            _fail(g, Superseded(why, self._epoch()))  # type: ignore[arg-type]
        self._wake.set()

    async def resume(self, local_seq: int) -> None:
        """After fence(): ownership was taken back (a new epoch, nobody else owned the prefix
        meanwhile). What the log missed (commits dropped while fenced) is covered by a
        checkpoint first (prepare); then the loop runs again."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fenced = None
        self._failures = 0
        self._failing_since = None
        await self.prepare(local_seq)
        self.start()

    # --- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ds3-log-shipper")

    async def stop(self, flush_timeout: float = 5.0) -> None:
        """Stop the loop; then one last attempt (within flush_timeout) to ship what is queued."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._queue and self._fenced is None:
            try:
                async with asyncio.timeout(flush_timeout):
                    while self._queue:
                        if await self.ship_once() == 0:
                            break
            except (ObjectStoreError, TimeoutError, Superseded) as e:
                log.warning("could not ship the last %d commits before stopping: %s", len(self._queue), e)
        with self._lock:
            gates = [g for _, g in self._gates]
            self._gates.clear()
            self._open_gate = None
        for g in gates:
            _fail(g, Unavailable("the ingester is shutting down"))  # type: ignore[arg-type]

    async def _run(self) -> None:
        delay = BACKOFF_FIRST
        while not self._stopping and self._fenced is None:
            try:
                if self._need_checkpoint:
                    await self.checkpoint()
                elif self._queue:
                    if self.durability == "local":
                        # Gather about half an interval's commits into one segment.
                        oldest = self._oldest_at
                        wait = 0.0 if oldest is None else oldest + self.interval / 2 - time.monotonic()
                        if wait > 0 and self._queued_bytes < MAX_SEGMENT_BYTES:
                            self._wake.clear()
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(self._wake.wait(), wait)
                            continue
                    if self.durability == "store" and self.uploads > 1 and self._failures == 0:
                        await self._ship_pipelined()
                    else:  # local mode; and after a failure, one at a time until one lands
                        await self.ship_once()
                elif self.checkpoint_due():
                    await self.checkpoint()
                else:
                    self._wake.clear()
                    if self._queue or self._need_checkpoint:
                        continue
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.interval)
                    continue
                delay = BACKOFF_FIRST
            except Superseded as e:
                self.fence(str(e))
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not isinstance(e, ObjectStoreError):
                    log.exception("log shipping failed")
                await asyncio.sleep(delay)
                delay = min(BACKOFF_CAP, delay * 2)

    def checkpoint_due(self) -> bool:
        """Every checkpoint_interval if anything was shipped since; sooner (but at most every
        CHECKPOINT_MIN_SECONDS) once CHECKPOINT_SEGMENTS segments accumulated: they bound what
        a recovery fetches."""
        if self._shipped_since_checkpoint == 0:
            return False
        since = time.monotonic() - self._last_checkpoint_at
        return since >= self.checkpoint_interval or (
            self._segments_since_checkpoint >= CHECKPOINT_SEGMENTS and since >= CHECKPOINT_MIN_SECONDS)

    # --- one step ----------------------------------------------------------------------------

    def _take(self) -> list[Commit]:
        """The queued commits for one segment (at most about MAX_SEGMENT_BYTES) that no upload
        in flight holds; the open gate closes: commits from now on get a new one."""
        with self._lock:
            self._open_gate = None
            out: list[Commit] = []
            size = 0
            for c in self._queue:
                if c.seq <= self._taken_upto:
                    continue
                out.append(c)
                size += _size(c)
                if size >= MAX_SEGMENT_BYTES:
                    break
            return out

    def _untaken(self) -> bool:
        with self._lock:
            return bool(self._queue) and self._queue[-1].seq > self._taken_upto

    def _check_owner(self) -> int:
        if self._fenced is not None:
            raise Superseded(self._fenced, self._epoch())
        return self.ownership.check() if self.ownership is not None else 0

    async def ship_once(self) -> int:
        """Upload one segment of what is queued; returns how many commits it held (0: nothing
        queued). Store errors propagate (the commits stay queued); after GATE_ATTEMPTS of them
        in a row (or GATE_SECONDS) the gates of the commits taken fail."""
        commits = self._take()
        if not commits:
            return 0
        epoch = self._check_owner()
        try:
            size = await self._upload(commits, epoch)
        except ObjectStoreError:
            self._upload_failed(commits[-1].seq)
            raise
        self._uploaded(commits, size, epoch)
        return len(commits)

    async def _upload(self, commits: list[Commit], epoch: int) -> int:
        """Encode and PUT one segment; its size."""
        size = sum(_size(c) for c in commits)
        if size > ENCODE_INLINE_BYTES:
            body = await asyncio.to_thread(encode, commits, epoch)
        else:
            body = encode(commits, epoch)
        await self._put_segment(segment_key(commits[0].seq, commits[-1].seq), body)
        return len(body)

    def _upload_failed(self, last: int) -> None:
        self.upload_failures += 1
        self._failures += 1
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if self._failures >= GATE_ATTEMPTS or now - self._failing_since >= GATE_SECONDS:
            self._fail_gates(last, Unavailable(NOT_SHIPPED, 5))
        if self._queued_bytes > MAX_QUEUED_BYTES:
            log.warning("the store is unreachable and %d bytes of commits are queued: dropping them, a "
                        "checkpoint will cover them", self._queued_bytes)
            self._need_checkpoint = True

    def _uploaded(self, commits: list[Commit], size: int, epoch: int) -> None:
        self._failures = 0
        self._failing_since = None
        if self.ownership is not None and not self.ownership.valid():
            # Uploaded, but our lease ran out meanwhile: a new owner may not have seen it.
            # Promise nothing (it is only ever replayed if no newer epoch holds these seqs).
            self.fence("the lease ran out while a log segment was uploading")
            raise Superseded("ownership lost", epoch)
        self.segments_uploaded += 1
        self.segment_bytes += size
        self._shipped_since_checkpoint += size
        self._segments_since_checkpoint += 1
        self._advance(commits[-1].seq)

    async def _ship_pipelined(self) -> None:
        """Store mode: keep up to `uploads` segment uploads in flight (each commit waits for
        the PUT before it, not for every PUT before it), confirming them in commit order: a
        segment counts (its gates open) only once every segment before it has landed. When one
        fails, the rest are waited for and everything from the failed one on is cut again; a
        later segment that landed meanwhile is an orphan beyond a hole (its commits were never
        acknowledged), which the next upload overlaps, or a recovery drops (logstore.restore).
        Returns once nothing is queued or in flight."""
        inflight: deque[tuple[list[Commit], int, asyncio.Task[int]]] = deque()
        try:
            while True:
                while len(inflight) < self.uploads and self._untaken():
                    commits = self._take()
                    if not commits:
                        break
                    epoch = self._check_owner()
                    self._taken_upto = commits[-1].seq
                    inflight.append((commits, epoch, asyncio.create_task(self._upload(commits, epoch))))
                if not inflight:
                    return
                commits, epoch, head = inflight[0]
                if not head.done():
                    self._wake.clear()
                    waiter = asyncio.ensure_future(self._wake.wait())
                    try:
                        await asyncio.wait({head, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    continue
                inflight.popleft()
                try:
                    size = head.result()
                except ObjectStoreError:
                    if inflight:  # let them land or fail; their commits are cut again from here
                        await asyncio.wait([t for _, _, t in inflight])
                    self._upload_failed(commits[-1].seq)
                    raise
                self._uploaded(commits, size, epoch)
        finally:
            for _, _, t in inflight:
                t.cancel()
            self._taken_upto = 0  # whatever is still queued is cut again

    async def _put_segment(self, key: str, body: bytes) -> None:
        try:
            await self.objects.put(key, body, content_type="application/octet-stream", if_absent=True)
        except PreconditionFailed:
            try:
                there = await self.objects.get(key)
            except ObjectNotFound:
                raise PreconditionFailed(f"{key}: refused, then not found") from None
            if there != body:
                # Only another owner writes different bytes under our key: we are superseded.
                raise Superseded(f"log segment {key} in the store is not ours (another owner wrote it)",
                                 self._epoch()) from None

    def _advance(self, seq: int) -> None:
        """Everything up to `seq` is in the store: drop it from the queue, open its gates."""
        done: list[ConcurrentFuture[None]] = []
        with self._lock:
            while self._queue and self._queue[0].seq <= seq:
                c = self._queue.popleft()
                self._queued_bytes -= _size(c)
            if not self._queue:
                self._queued_bytes = 0
                self._oldest_at = None
            else:
                self._oldest_at = time.monotonic()  # approximate: when the rest started waiting
            self._landed_seq = max(self._landed_seq, seq)
            while self._gates and self._gates[0][0] <= seq:  # type: ignore[operator]
                entry = self._gates.popleft()
                if entry is self._open_gate:
                    self._open_gate = None
                done.append(entry[1])  # type: ignore[arg-type]
        if seq > self.shipped_seq:
            self.shipped_seq = seq
            self.shipped_at = time.time()
        for g in done:
            if not g.done():
                g.set_result(None)

    def _fail_gates(self, upto: int, exc: BaseException) -> None:
        with self._lock:
            failing = [entry[1] for entry in self._gates if entry[0] <= upto]  # type: ignore[operator]
            self._gates = deque(e for e in self._gates if e[0] > upto)  # type: ignore[operator]
            if self._open_gate is not None and self._open_gate not in self._gates:
                self._open_gate = None
        for g in failing:
            _fail(g, exc)  # type: ignore[arg-type]

    # --- checkpoints -----------------------------------------------------------------------

    async def checkpoint(self) -> int:
        """Copy the whole env, upload it, delete what it covers; returns its commit seq."""
        async with self._checkpoint_lock:
            if self._need_checkpoint:
                with self._lock:  # the queue was dropped for this checkpoint: it covers them
                    self._queue.clear()
                    # ... but not a commit handed over before LMDB commits it, if that happens
                    # after the copy below: its on_logged must queue it again.
                    self._early_seq = 0
                    self._queued_bytes = 0
                    self._oldest_at = None
                    gates = [entry[1] for entry in self._gates]
                    self._gates.clear()
                    self._open_gate = None
                for g in gates:
                    _fail(g, Unavailable(NOT_SHIPPED, 5))  # type: ignore[arg-type]
            epoch = self._check_owner()
            started = time.monotonic()
            seq, body = await asyncio.to_thread(self._copy_env)
            self._check_owner()
            key = checkpoint_key(seq, epoch)
            try:
                await self.objects.put(key, body, content_type="application/octet-stream", if_absent=True)
            except PreconditionFailed:
                pass  # the same commit seq and epoch: the same state (a retry whose answer was lost)
            self._need_checkpoint = False
            self._last_checkpoint_at = time.monotonic()
            self._shipped_since_checkpoint = 0
            self._segments_since_checkpoint = 0
            self.checkpoints_uploaded += 1
            self.checkpoint_bytes += len(body)
            self.last_checkpoint_seq = seq
            log.info("checkpoint of the WAL at commit %d uploaded (%d bytes, %.2f s)", seq, len(body),
                     time.monotonic() - started)
            self._advance(seq)
            await self._delete_covered(seq, key)
            return seq

    def _copy_env(self) -> tuple[int, bytes]:
        """A compacted copy of the env (one read transaction: consistent) and its commit seq."""
        with tempfile.TemporaryDirectory(prefix="ds3-checkpoint-", dir=self.wal_dir_parent()) as tmp:
            self.wal.env.copy(tmp, compact=True)
            copy = lmdb.open(tmp, readonly=True, lock=False, max_dbs=16, subdir=True)
            try:
                sys_db = copy.open_db(b"sys", create=False)
                with copy.begin() as txn:
                    raw = txn.get(b"commit_seq", db=sys_db)
            finally:
                copy.close()
            seq = int.from_bytes(raw, "big") if raw is not None else 0
            return seq, (Path(tmp) / "data.mdb").read_bytes()

    def wal_dir_parent(self) -> str:
        return str(Path(self.wal.env.path()).parent)

    async def _delete_covered(self, seq: int, keep: str) -> None:
        """Segments entirely at or below `seq` and older checkpoints than `keep`."""
        doomed: list[str] = []
        async for info in self.objects.list(LOG_DIR):
            rng = parse_segment_key(info.key)
            if rng is not None and rng[1] <= seq:
                doomed.append(info.key)
        async for info in self.objects.list(CHECKPOINT_DIR):
            parsed = parse_checkpoint_key(info.key)
            if parsed is not None and info.key != keep and parsed[0] <= seq:
                doomed.append(info.key)
        for key in doomed:
            try:
                await self.objects.delete(key)
                self.objects_deleted += 1
            except ObjectStoreError as e:  # the next checkpoint deletes it
                log.warning("could not delete %s: %s", key, e)
                return

    async def prepare(self, local_seq: int) -> None:
        """At start: a checkpoint first if the store does not cover the local WAL (commits
        shipped nowhere: the write-sets of a crashed process were only in memory), or holds
        no checkpoint yet (the log needs a base)."""
        listing = await list_log(self.objects)
        self.shipped_seq = listing.shipped_seq
        cp = listing.latest_checkpoint
        self.last_checkpoint_seq = cp[0] if cp is not None else 0
        if local_seq < listing.shipped_seq:
            raise StoreAhead(local_seq, listing.shipped_seq)
        if cp is None or local_seq > listing.shipped_seq:
            log.info("the store's log ends at commit %d, the local WAL at %d: checkpointing first",
                     listing.shipped_seq, local_seq)
            await self.checkpoint()


class LogHook:
    """What the committer calls (wal.OnLogged): the shipper's hooks on the writer thread."""

    __slots__ = ("before_commit", "commit_failed", "logged")

    def __init__(self, shipper: Shipper) -> None:
        self.logged = shipper._logged
        self.before_commit = shipper.before_commit
        self.commit_failed = shipper.commit_failed

    def __call__(self, commit: Commit) -> ConcurrentFuture[None] | None:
        return self.logged(commit)


class StoreAhead(StartRefused):
    def __init__(self, local: int, shipped: int) -> None:
        super().__init__(
            f"the store's log reaches commit {shipped} but this data dir's WAL only {local}: another ingester "
            "wrote to this store since; start with an empty --data-dir to restore from the store")


def _fail(gate: ConcurrentFuture[None], exc: BaseException) -> None:
    if not gate.done():
        gate.set_exception(exc)
