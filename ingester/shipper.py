"""The log shipper: every logged group commit goes to the object store, in commit order (issue 14).

The GroupCommitter calls `on_logged` on its writer thread with each commit's write-set; the
hook (ingester/log_hook.py) only queues it (ingester/ship_queue.py, under a lock) and, when
there is something to do, wakes the shipping task on the event loop, which encodes segments
(shared/logsegment.py, stamped with our ownership epoch) and uploads them under `log/` with
if_absent (ingester/segment_uploads.py); checkpoints are ingester/checkpoints.py.

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
  commit. While the store fails, the log falls behind: once the oldest commit it lacks is
  --max-ship-lag old, a commit gets a failed gate too (503: in the WAL, promised nothing),
  so what a lost disk loses stays bounded by that, and so does what a standby taking over
  from an owner cut off from the store does not find (it waits the lease out first).

Fencing: before every upload the shipper checks the ownership (shared/ownership.py); fenced,
it uploads nothing more and fails every gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from typing import Final, Literal

from ingester.checkpoints import Checkpoints
from ingester.log_hook import GATE_ATTEMPTS, NOT_SHIPPED, LogHook
from ingester.logstore import StartRefused, drop_dead_beyond, list_log
from ingester.segment_uploads import UPLOADS_IN_FLIGHT, SegmentUploads
from ingester.ship_queue import MAX_SEGMENT_BYTES, ShipQueue
from ingester.wal import WalEnv
from shared.errors import ObjectStoreError, Superseded, Unavailable
from shared.http.metrics import LoopHistogram
from shared.logsegment import Commit
from shared.objectstore import ObjectStore
from shared.ownership import Ownership

log = logging.getLogger("ds3.shipper")

Durability = Literal["local", "store"]
MAX_QUEUED_BYTES: Final = 256 * 1024 * 1024  # past this, the queue is dropped for a checkpoint
GATE_SECONDS: Final = 5.0  # store mode: ... or this long since the first failure (GATE_ATTEMPTS)
BACKOFF_FIRST: Final = 0.05
BACKOFF_CAP: Final = 5.0
# ... while writes are refused for the log's sake (refusing()): each second of backoff after the
# store is back is a second more of 503s, and a retry a second costs a failing store nothing.
REFUSING_BACKOFF_CAP: Final = 1.0


class Shipper:
    def __init__(
        self,
        wal: WalEnv,
        objects: ObjectStore,
        loop: asyncio.AbstractEventLoop,
        *,
        durability: Durability = "local",
        interval: float = 1.0,
        max_lag: float = 0.0,
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
        self.max_lag = max_lag  # local mode: past this lag, writes answer 503 (0: never)
        self.ownership = ownership
        self.uploads = min(max(1, uploads), UPLOADS_IN_FLIGHT)  # store mode: segment uploads in flight
        self.early = early  # store mode: upload a commit's segment while LMDB syncs it (before_commit)
        self.queue = ShipQueue()  # what the writer thread handed over, and its gates
        # Loop side (the writer thread reads fence_reason and failures_in_a_row):
        self.wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.failures_in_a_row = 0  # failed uploads since the last one that landed
        self._failing_since: float | None = None
        self.fence_reason: str | None = None  # fenced: why
        # Epochs this process uploaded under: a segment found under our key stamped with one
        # of them is ours (an epoch has one owner), e.g. an upload that landed after the fence
        # that a lease taken back then cuts again (ingester/segment_uploads.py).
        self.epochs_held: set[int] = set()
        self.checkpoints = Checkpoints(self, checkpoint_interval)
        self._segments = SegmentUploads(self)
        self.shipped_seq = shipped_seq  # the highest commit seq known to be in the store
        # Told every seq the store holds everything up to (ingester/visibility.py's release).
        self.on_stored: Callable[[int], None] | None = None
        # local durability: whether something waits for the log (ingester/store_effects.py):
        # ship at once then, not half an interval later
        self.urgent: Callable[[], bool] = lambda: False
        self.shipped_at = time.time()  # when the commit at shipped_seq ... was shipped (wall)
        # metrics
        self.segments_uploaded = 0
        self.segment_bytes = 0
        self.upload_failures = 0
        self.early_commits = 0  # commits whose upload started before LMDB committed them
        # The committer's hook (wal.OnLogged): a callable with before_commit and commit_failed.
        self.on_logged = LogHook(self)

    # --- writer thread (ingester/log_hook.py) ------------------------------------------------

    def before_commit(self, commit: Commit) -> bool:
        return self.on_logged.before_commit(commit)

    def commit_failed(self, commit: Commit, exc: BaseException) -> None:
        self.on_logged.commit_failed(commit, exc)

    # --- state ---------------------------------------------------------------------------

    def epoch(self) -> int:
        return self.ownership.epoch if self.ownership is not None else 0

    @property
    def queued(self) -> int:
        return len(self.queue)

    @property
    def queued_bytes(self) -> int:
        return self.queue.bytes

    def lag_seconds(self) -> float:
        """How long the oldest commit not yet in the store has waited (0: nothing waits)."""
        return self.queue.lag_seconds()

    def lagging(self) -> float | None:
        """Local mode: the log's lag, when it is past --max-ship-lag (writes answer 503); else None."""
        lag = self.lag_seconds()
        return lag if self.durability == "local" and self.max_lag and lag > self.max_lag else None

    def refusing(self) -> str | None:
        """Why writes answer 503 now because of the log (for /readyz), or None."""
        if self.fence_reason is not None:
            return f"log shipping stopped: {self.fence_reason}"
        if self.durability == "store" and self.failures_in_a_row >= GATE_ATTEMPTS:
            return (f"log segment uploads are failing ({self.failures_in_a_row} in a row): writes answer 503 "
                    "until one lands")
        lag = self.lagging()
        if lag is not None:
            return (f"the store's copy of the log is {lag:.1f} s behind (--max-ship-lag {self.max_lag:g} s): "
                    "writes answer 503 until it catches up")
        return None

    @property
    def segment_put_seconds(self) -> LoopHistogram:
        return self._segments.put_histogram

    @property
    def checkpoints_uploaded(self) -> int:
        return self.checkpoints.uploaded

    @property
    def checkpoint_bytes(self) -> int:
        return self.checkpoints.bytes

    @property
    def objects_deleted(self) -> int:
        return self.checkpoints.objects_deleted

    @property
    def last_checkpoint_seq(self) -> int:
        return self.checkpoints.last_seq

    @property
    def fenced(self) -> bool:
        return self.fence_reason is not None

    def fence(self, why: str) -> None:
        """Upload nothing more; every waiting and future gate fails."""
        if self.fence_reason is not None:
            return
        self.fence_reason = why
        log.error("log shipping stopped: %s", why)
        self.queue.fail_all(lambda: Superseded(why, self.epoch()))
        self.wake.set()

    def check_owner(self) -> int:
        """Before an upload: our epoch; Superseded if fenced or the ownership is lost."""
        if self.fence_reason is not None:
            raise Superseded(self.fence_reason, self.epoch())
        epoch = self.ownership.check() if self.ownership is not None else 0
        self.epochs_held.add(epoch)
        return epoch

    async def resume(self, local_seq: int) -> None:
        """After fence(): ownership was taken back (a new epoch, nobody else owned the prefix
        meanwhile). What the log missed (commits dropped while fenced) is covered by a
        checkpoint first (prepare); then the loop runs again."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.fence_reason = None
        self.failures_in_a_row = 0
        self._failing_since = None
        await self.prepare(local_seq)
        self.start()

    async def prepare(self, local_seq: int) -> None:
        """At start: a checkpoint first if the store does not cover the local WAL (commits
        shipped nowhere: the write-sets of a crashed process were only in memory), or holds
        no checkpoint yet (the log needs a base)."""
        listing = await drop_dead_beyond(self.objects, await list_log(self.objects), local_seq)
        # Where a restore's replay ends, not the highest seq the store holds: past a hole (an
        # upload in flight when the last process died, while a later one landed) the log must
        # not carry on, or no restore could ever get past the hole again.
        end = listing.chain_end
        self.shipped_seq = end
        self.queue.landed(end)
        cp = listing.latest_checkpoint
        self.checkpoints.last_seq = cp[0] if cp is not None else 0
        if local_seq < end:
            raise StoreAhead(local_seq, end)
        if cp is None or local_seq > end:
            log.info("the store's log ends at commit %d, the local WAL at %d: checkpointing first",
                     end, local_seq)
            await self.checkpoint()
        for ref in listing.beyond_chain():  # (covered by that checkpoint, or never acknowledged)
            log.warning("deleting %s: past a hole in the store's log at commit %d (covered by a checkpoint now)",
                        ref.key, end + 1)
            await self.objects.delete(ref.key)

    # --- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ds3-log-shipper")

    def wake_soon(self) -> None:
        """Wake the shipping loop, from any thread."""
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self.loop.call_soon_threadsafe(self.wake.set)

    async def stop(self, flush_timeout: float = 5.0) -> None:
        """Stop the loop; then one last attempt (within flush_timeout) to ship what is queued."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.queue.commits and self.fence_reason is None:
            try:
                async with asyncio.timeout(flush_timeout):
                    while self.queue.commits:
                        if await self.ship_once() == 0:
                            break
            except (ObjectStoreError, TimeoutError, Superseded) as e:
                log.warning("could not ship the last %d commits before stopping: %s", len(self.queue), e)
        self.queue.fail_all(lambda: Unavailable("the ingester is shutting down"))

    async def _run(self) -> None:
        delay = BACKOFF_FIRST
        queue = self.queue
        while not self._stopping and self.fence_reason is None:
            try:
                if self.checkpoints.needed:
                    await self.checkpoint()
                elif queue.commits:
                    if self.durability == "local":
                        # Gather about half an interval's commits into one segment.
                        oldest = queue.oldest_at
                        wait = 0.0 if oldest is None else oldest + self.interval / 2 - time.monotonic()
                        if wait > 0 and queue.bytes < MAX_SEGMENT_BYTES and not self.urgent():
                            self.wake.clear()
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(self.wake.wait(), wait)
                            continue
                    if self.durability == "store" and self.uploads > 1 and self.failures_in_a_row == 0:
                        await self._segments.ship_pipelined()
                    else:  # local mode; and after a failure, one at a time until one lands
                        await self.ship_once()
                elif self.checkpoint_due():
                    await self.checkpoint()
                else:
                    self.wake.clear()
                    if queue.commits or self.checkpoints.needed:
                        continue
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), self.interval)
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
                refusing = self.refusing() is not None and not self.checkpoints.needed  # (a big copy each)
                delay = min(REFUSING_BACKOFF_CAP if refusing else BACKOFF_CAP, delay * 2)

    def checkpoint_due(self) -> bool:
        return self.checkpoints.due()

    async def checkpoint(self) -> int:
        """Copy the whole env, upload it, delete what it covers; returns its commit seq."""
        return await self.checkpoints.take()

    # --- one step, and what an upload means (ingester/segment_uploads.py uploads) ---------------

    async def ship_once(self) -> int:
        """Upload one segment of what is queued; returns how many commits it held (0: nothing
        queued). Store errors propagate (the commits stay queued); after GATE_ATTEMPTS of them
        in a row (or GATE_SECONDS) the gates of the commits taken fail."""
        return await self._segments.ship_once()

    def upload_failed(self, last: int) -> None:
        """The upload of a segment ending at commit `last` failed (a store error)."""
        self.upload_failures += 1
        self.failures_in_a_row += 1
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if self.failures_in_a_row >= GATE_ATTEMPTS or now - self._failing_since >= GATE_SECONDS:
            self.queue.fail_upto(last, Unavailable(NOT_SHIPPED, 5))
        if self.queue.bytes > MAX_QUEUED_BYTES:
            log.warning("the store is unreachable and %d bytes of commits are queued: dropping them, a "
                        "checkpoint will cover them", self.queue.bytes)
            self.checkpoints.needed = True

    def uploaded(self, commits: list[Commit], size: int, epoch: int) -> None:
        """A segment of `commits` (`size` bytes, uploaded at `epoch`) landed."""
        self.failures_in_a_row = 0
        self._failing_since = None
        if self.ownership is not None and not self.ownership.valid():
            # Uploaded, but our lease ran out meanwhile: a new owner may not have seen it.
            # Promise nothing (it is only ever replayed if no newer epoch holds these seqs).
            self.fence("the lease ran out while a log segment was uploading")
            raise Superseded("ownership lost", epoch)
        self.segments_uploaded += 1
        self.segment_bytes += size
        self.checkpoints.shipped(size)
        self.advance(commits[-1].seq)

    def advance(self, seq: int) -> None:
        """Everything up to `seq` is in the store: drop it from the queue, show it to readers
        (store durability), open its gates."""
        if self.on_stored is not None:
            self.on_stored(seq)
        done: list[ConcurrentFuture[None]] = self.queue.advance(seq)
        if seq > self.shipped_seq:
            self.shipped_seq = seq
            self.shipped_at = time.time()
        for g in done:
            if not g.done():
                g.set_result(None)


class StoreAhead(StartRefused):
    def __init__(self, local: int, shipped: int) -> None:
        super().__init__(
            f"the store's log reaches commit {shipped} but this data dir's WAL only {local}: another ingester "
            "wrote to this store since; start with an empty --data-dir to restore from the store")
