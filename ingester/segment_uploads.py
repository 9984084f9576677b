"""The shipper's uploads: queued commits cut into log segments (shared/logsegment.py, stamped
with our ownership epoch) and PUT under `log/` with if_absent, one at a time or (store mode)
several in flight, confirmed in commit order.

A segment is cut from whatever is queued at each attempt, so a retry after an upload whose
answer was lost may write a longer segment that overlaps the first: harmless (replay skips
what it applied; ingester/logstore.py). An if_absent PUT refused on a key whose content is
ours counts as done. What a landed or failed upload means for gates, fencing and the shipped
seq is the shipper's (Shipper.uploaded, Shipper.upload_failed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Final

from ingester.logstore import ORPHANS_MAX
from shared.errors import (
    ObjectNotFound,
    ObjectStoreError,
    ObjectStoreUnavailable,
    PreconditionFailed,
    Superseded,
)
from shared.http.metrics import LoopHistogram
from shared.logsegment import Commit, LogSegmentError, encode, parse_prelude, segment_key

if TYPE_CHECKING:
    from ingester.shipper import Shipper
    from shared.objectstore.base import ObjectStore

log = logging.getLogger("ds3.shipper")

# store mode: segment PUTs in flight at once (acknowledged in commit order); a recovery tells
# the orphans they may leave beyond a failed one from a gap by this bound
UPLOADS_IN_FLIGHT: Final = ORPHANS_MAX + 1
STALE_SEGMENT_ATTEMPTS: Final = 3  # a superseded owner's segment under our key, replaced at most this often
MAX_EPOCH: Final = 2**63
ENCODE_INLINE_BYTES: Final = 256 * 1024  # larger segments are encoded on a worker thread
# store mode, while an upload is in flight: the next segment's first commit waits this share of
# a PUT's recent latency (at most HOLD_MAX seconds) for more commits to join it (ship_pipelined)
HOLD_SHARE: Final = 0.25
HOLD_MAX: Final = 0.025
# store mode: while a segment PUT takes less than this (a moving average: a local directory,
# MinIO or moto near by), one upload in flight, not --log-uploads: the commits gather while the
# PUT before runs, in fewer and larger segments. Under 32 writers on moto, 1 in flight against 4:
# about a third more appends/s and a quarter less CPU per append in the ingester, a third less
# in moto (docs/bench.md, 2026-11-30). Further away, a commit waiting for the PUT before its own
# costs more than the PUTs: up to --log-uploads. (10 ms sat inside moto's PUT p99 under load:
# the count flipped back and forth.)
NEAR_PUT_SECONDS: Final = 0.020
# A segment PUT that has not answered after this (plus a second per MiB) is abandoned as
# failed and cut again: a store that hangs instead of refusing (a frozen server, a dropped
# route) never failed a PUT, so store-mode appends waited for the lease to lapse (10 s) instead
# of GATE_SECONDS, and the upload failures and /readyz said nothing (found by QA). If the
# abandoned PUT lands after all, the segment cut again overlaps it: harmless (logstore).
PUT_TIMEOUT_SECONDS: Final = 2.0
# (fine enough for a p99 within a fifth: scripts/bench durability reads it)
PUT_SECONDS_BUCKETS: Final = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015,
                              0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class SegmentUploads:
    def __init__(self, shipper: Shipper) -> None:
        self.shipper = shipper
        self.queue = shipper.queue
        self.put_seconds = 0.0  # a segment PUT's recent latency (moving average)
        # Every landed segment PUT, as the ingester saw it under its own load: in store mode an
        # append waits for one (the bench compares ack p99 with it).
        self.put_histogram = LoopHistogram(
            "ds3_log_segment_put_seconds", "Time to PUT a log segment into the object store (landed "
            "uploads, retries of a refused key included).", PUT_SECONDS_BUCKETS)

    async def ship_once(self) -> int:
        """Upload one segment of what is queued; returns how many commits it held (0: nothing
        queued). Store errors propagate (the commits stay queued); after GATE_ATTEMPTS of them
        in a row (or GATE_SECONDS) the gates of the commits taken fail."""
        commits, size = self.queue.take()
        if not commits:
            return 0
        epoch = self.shipper.check_owner()
        try:
            size = await self._upload(commits, size, epoch)
        except ObjectStoreError:
            self.shipper.upload_failed(commits[-1].seq)
            raise
        self.shipper.uploaded(commits, size, epoch)
        return len(commits)

    async def ship_pipelined(self) -> None:
        """Store mode: keep up to `uploads` segment uploads in flight (each commit waits for
        the PUT before it, not for every PUT before it), confirming them in commit order: a
        segment counts (its gates open) only once every segment before it has landed. While
        one is in flight, the next segment is cut once its first commit has waited HOLD_SHARE
        of a PUT's recent latency (at most HOLD_MAX), so the commits of that moment share it:
        a PUT costs CPU on both sides (and money on S3), and a commit per segment made the
        PUTs, not the appends, the work (on moto: 7 appends a segment -> 15, +40% appends/s;
        on a store 20 ms away: half the PUTs, appends/s the same). Nothing in flight: at once.
        When one fails, the rest are waited for and everything from the failed one on is cut
        again; a later segment that landed meanwhile is an orphan beyond a hole (its commits
        were never acknowledged), which the next upload overlaps, or a recovery drops
        (logstore.restore). Returns once nothing is queued or in flight."""
        shipper, queue = self.shipper, self.queue
        inflight: deque[tuple[list[Commit], int, asyncio.Task[int]]] = deque()
        try:
            while True:
                hold = 0.0
                while len(inflight) < self.slots() and queue.untaken():
                    if inflight and (hold := self._hold_left()) > 0:
                        break  # more commits may join this segment while the one before uploads
                    commits, size = queue.take()
                    if not commits:
                        break
                    epoch = shipper.check_owner()
                    queue.taken_upto = commits[-1].seq
                    inflight.append((commits, epoch, asyncio.create_task(self._upload(commits, size, epoch))))
                if not inflight:
                    return
                commits, epoch, head = inflight[0]
                if not head.done():
                    shipper.wake.clear()
                    waiter = asyncio.ensure_future(shipper.wake.wait())
                    try:
                        await asyncio.wait({head, waiter}, timeout=hold if hold > 0 else None,
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    continue
                inflight.popleft()
                try:
                    size = head.result()
                except ObjectStoreError:
                    if inflight:  # let them land or fail; their commits are cut again from here
                        await asyncio.wait([t for _, _, t in inflight])
                    shipper.upload_failed(commits[-1].seq)
                    raise
                shipper.uploaded(commits, size, epoch)
        finally:
            for _, _, t in inflight:
                t.cancel()
            queue.taken_upto = 0  # whatever is still queued is cut again

    def slots(self) -> int:
        """Uploads that may be in flight now: --log-uploads, or one for a near store."""
        return self.shipper.uploads if self.put_seconds >= NEAR_PUT_SECONDS else 1

    def _hold_left(self) -> float:
        """How much longer the oldest untaken commit waits for others before its segment goes."""
        since = self.queue.untaken_since()
        if since is None:
            return 0.0
        return since + min(HOLD_MAX, HOLD_SHARE * self.put_seconds) - time.monotonic()

    async def _upload(self, commits: list[Commit], size: int, epoch: int) -> int:
        """Encode and PUT one segment (`size`: about its length); its length."""
        if size > ENCODE_INLINE_BYTES:
            body = await asyncio.to_thread(encode, commits, epoch)
        else:
            body = encode(commits, epoch)
        started = time.monotonic()
        await self._put_segment(segment_key(commits[0].seq, commits[-1].seq), body, commits, epoch)
        took = time.monotonic() - started
        self.put_seconds += 0.2 * (took - self.put_seconds)
        self.put_histogram.observe(took)
        return len(body)

    async def _put_segment(self, key: str, body: bytes, commits: list[Commit], epoch: int) -> None:
        objects = self.shipper.objects
        for _ in range(STALE_SEGMENT_ATTEMPTS):
            try:
                await _put_within(objects, key, body)
                return
            except PreconditionFailed:
                try:
                    there = await objects.get(key)
                except ObjectNotFound:
                    raise PreconditionFailed(f"{key}: refused, then not found") from None
                if there == body or self._ours_of_an_earlier_epoch(there, commits, epoch):
                    return
                if (written := _epoch_of(there)) >= epoch or written in self.shipper.epochs_held:
                    # Only another owner writes different bytes under our key: we are superseded.
                    # (Other commits under an epoch we held: not ours to overwrite either.)
                    raise Superseded(f"log segment {key} in the store is not ours (another owner wrote it)",
                                     self.shipper.epoch()) from None
                # A superseded owner's late write (an upload in flight when its lease lapsed, or
                # retransmitted after a partition healed) under the key of our next commits: no
                # restore takes it where ours exists (the higher epoch wins), and none of it was
                # acknowledged. Out of the way; ours goes in its place.
                log.warning("log segment %s holds a superseded owner's late write (epoch %d, ours %d): replacing it",
                            key, written, epoch)
                await objects.delete(key)
        raise Superseded(f"log segment {key} keeps being written by a superseded owner", self.shipper.epoch())

    def _ours_of_an_earlier_epoch(self, there: bytes, commits: list[Commit], epoch: int) -> bool:
        """Whether `there` is these very commits as this process cut them under an epoch it held
        before `epoch`: an upload in flight when the lease lapsed landed after the fence (its
        thread went on), and the lease taken back cut the same commits again under the next
        epoch. The log holds them already; nobody else can have written that epoch."""
        return any(there == encode(commits, held) for held in self.shipper.epochs_held if held < epoch)


async def _put_within(objects: ObjectStore, key: str, body: bytes) -> None:
    """An if_absent PUT of a segment, failed (ObjectStoreUnavailable) if the store does not
    answer within PUT_TIMEOUT_SECONDS plus a second per MiB."""
    timeout = PUT_TIMEOUT_SECONDS + len(body) / (1 << 20)
    try:
        await asyncio.wait_for(objects.put(key, body, content_type="application/octet-stream", if_absent=True),
                               timeout)
    except TimeoutError:
        raise ObjectStoreUnavailable(f"{key}: the store did not answer a PUT within {timeout:.1f} s") from None


def _epoch_of(segment: bytes) -> int:
    """The epoch a segment was written under (one that does not parse: a newer owner's, as far
    as replacing it goes: never deleted)."""
    try:
        return parse_prelude(segment)[2]
    except LogSegmentError:
        return MAX_EPOCH
