"""The shipper's side on the GroupCommitter's writer thread (wal.OnLogged): every logged commit
is queued for the object store (ingester/ship_queue.py), and in store mode its writes wait on a
gate; the shipping task on the event loop is woken when there is something to do.

Which gate a commit gets (see ingester/shipper.py for the two durability modes):
- store mode: one shared by every commit gathered until the shipper next takes the queue,
  completed once a segment holding them is in the store; a commit queued before its LMDB
  commit (before_commit) gets one of its own, none at all if its segment already landed.
- local mode: none, while our lease holds and the log is less than --max-ship-lag behind.
- fenced, the store failing (store mode), the lease over or the log too far behind (local
  mode): a failed one (503).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future as ConcurrentFuture
from typing import TYPE_CHECKING, Final

from ingester.ship_queue import MAX_SEGMENT_BYTES, Gate
from shared.errors import Superseded, Unavailable
from shared.logsegment import Commit

if TYPE_CHECKING:
    from ingester.shipper import Shipper

GATE_ATTEMPTS: Final = 3  # store mode: failed uploads in a row before waiting writes get 503
LAGGING: Final = ("the write is in the write-ahead log but the object store's copy of the log is {lag:.1f} s behind "
                  "(--max-ship-lag {bound:g} s), so it is not acknowledged; retry (an idempotent producer's retry "
                  "is deduplicated)")
NOT_SHIPPED: Final = ("the write is in the write-ahead log but its log segment did not reach the object store; "
                      "retry (an idempotent producer's retry is deduplicated)")


class LogHook:
    """What the committer calls (wal.OnLogged): the shipper's hooks on the writer thread."""

    __slots__ = ("queue", "shipper")

    def __init__(self, shipper: Shipper) -> None:
        self.shipper = shipper
        self.queue = shipper.queue

    def before_commit(self, commit: Commit) -> bool:
        """Store mode: queue the commit (and wake the uploads) before LMDB commits it, so the
        PUT runs while LMDB syncs. False (on_logged queues it after the commit) in local mode,
        fenced, or while the store keeps failing (on_logged answers 503 at once then)."""
        shipper, queue = self.shipper, self.queue
        if shipper.durability != "store" or not shipper.early:
            return False
        with queue.lock:
            if shipper.fence_reason is not None or shipper.failures_in_a_row >= GATE_ATTEMPTS:
                return False
            queue.append(commit)
            queue.early_seq = commit.seq
            shipper.early_commits += 1
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            shipper.loop.call_soon_threadsafe(shipper.wake.set)
        return True

    def caught_up(self, seq: int) -> Gate | None:
        """For outcomes of a batch that committed nothing (a producer's duplicate, a create of
        a stream that exists, a close of a closed stream): they rely on what commit `seq` (the
        last one) and those before it wrote, so they are acknowledged only as an outcome of that
        commit would be. Before, a retry of an append answered 503 (its segment did not reach
        the store; its log too far behind) got 204 at once, though the store still lacked it."""
        shipper, queue = self.shipper, self.queue
        with queue.lock:
            if shipper.fence_reason is not None:
                return _failed(Superseded(shipper.fence_reason, shipper.epoch()))
            if shipper.durability == "store" and seq <= queue.landed_seq:
                return None  # in the store already
            refusal = self._refusal()
            if refusal is not None:
                return _failed(refusal)
            # store mode: opened once a segment (or checkpoint) covers `seq`
            return queue.own_gate(seq) if shipper.durability == "store" else None

    def _refusal(self) -> Unavailable | None:
        """Under the lock: why a commit's outcomes are refused now (fencing aside), or None.
        Store mode: the store is failing (503 now rather than after the next attempt; the commit
        is queued all the same, and shipped once the store answers). Local mode, which
        acknowledges after the fsync: our lease is over (a process frozen past it, then resumed
        before the keeper noticed: another ingester may own the prefix by now), or the log is
        past --max-ship-lag (the store failing or cut off: what a lost disk would take with it
        stops growing there)."""
        shipper = self.shipper
        if shipper.durability == "store":
            return Unavailable(NOT_SHIPPED, 5) if shipper.failures_in_a_row >= GATE_ATTEMPTS else None
        if shipper.ownership is not None and not shipper.ownership.valid():
            return self._lapsed()
        lag = shipper.lagging()
        return None if lag is None else Unavailable(LAGGING.format(lag=lag, bound=shipper.max_lag), 2)

    def _lapsed(self) -> Superseded:
        return Superseded("the lease on the store prefix ran out", self.shipper.epoch())

    def commit_failed(self, commit: Commit, exc: BaseException) -> None:
        """LMDB could not commit what before_commit queued (not even a second time): the log
        may hold a commit the WAL lacks, so ship nothing more (see ingester/shipper.py)."""
        why = f"the write-ahead log could not commit {commit.seq}, whose log segment may be in the store: {exc!r}"
        with contextlib.suppress(RuntimeError):
            self.shipper.loop.call_soon_threadsafe(self.shipper.fence, why)

    def __call__(self, commit: Commit) -> Gate | None:
        """After LMDB committed: queue the commit (unless before_commit did); in store mode,
        its gate."""
        shipper, queue = self.shipper, self.queue
        ownership = shipper.ownership
        gate: Gate | None = None
        with queue.lock:
            if shipper.fence_reason is not None:
                return _failed(Superseded(shipper.fence_reason, shipper.epoch()))
            early = commit.seq <= queue.early_seq
            first = False if early else queue.append(commit)
            if early and commit.seq <= queue.landed_seq:
                # Its segment landed (our lease held then) while LMDB synced. Our lease must
                # still hold now (a process frozen during the fsync: as in local mode below).
                return None if ownership is None or ownership.valid() else _failed(self._lapsed())
            refusal = self._refusal()  # (the commit stays queued: it is in this WAL)
            if refusal is not None:
                gate = _failed(refusal)
            elif shipper.durability == "store" and early:
                # A gate of its own: its segment may be cut already (the next commit's may not).
                gate = queue.own_gate(commit.seq)
            elif shipper.durability == "store":
                gate = queue.join_gate(commit.seq)
            wake = not early and (first or shipper.durability == "store" or queue.bytes >= MAX_SEGMENT_BYTES)
        if wake:
            with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
                shipper.loop.call_soon_threadsafe(shipper.wake.set)
        return gate


def _failed(exc: BaseException) -> Gate:
    gate: Gate = ConcurrentFuture()
    gate.set_exception(exc)
    return gate
