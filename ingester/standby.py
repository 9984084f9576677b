"""--standby: an ingester that does not own the store prefix yet watches the ownership record,
answers stream requests with 503 naming the owner, and takes the prefix over (the next epoch)
once the owner's lease lapses or is released. Meanwhile it follows the store's log into its WAL
dir (ingester/log_follow.py), so a takeover replays only what landed since the last step
(or restores the whole log where the followed one cannot be trusted), then starts serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from typing import TYPE_CHECKING, Final

from ingester.log_follow import LogFollower
from ingester.logstore import StartRefused
from ingester.owning import restore_keeping_the_lease, say_if_weaker
from shared.errors import ObjectStoreError, OwnedElsewhere, Superseded, Unavailable
from shared.ownership import OwnerRecord

if TYPE_CHECKING:
    from ingester.service import IngesterService

log = logging.getLogger("ds3.ingester")

FOLLOW_INTERVAL_MAX: Final = 2.0  # seconds between steps of the followed log, at most (else lease/3)
FOLLOW_BACKOFF_MAX: Final = 10.0


def refusal(svc: IngesterService) -> Unavailable:
    """The 503 a standby answers stream requests with, naming the owner's URL."""
    rec = svc.standby_owner
    own = svc.ownership
    if rec is None:
        return Unavailable(f"this ingester is a standby ({svc.standby_status}); it acknowledges no writes "
                           "until it owns the store prefix", retry_after=1)
    wait = rec.lease_expires_at + (own.max_skew if own is not None else 0) - time.time()
    if wait <= 0 or rec.released:
        # (QA: it said "send requests there", naming the dead or frozen owner it is replacing)
        return Unavailable(f"this ingester is taking over the store prefix: the lease of {rec.owner_id} at "
                           f"{rec.advertise_url or '(no URL)'} (epoch {rec.epoch}) "
                           f"{'was released' if rec.released else 'lapsed'}; retry", retry_after=1)
    return Unavailable(f"this ingester is a standby: the store prefix is owned by {rec.owner_id} at "
                       f"{rec.advertise_url or '(no URL)'} (epoch {rec.epoch}); send requests there",
                       retry_after=max(1, math.ceil(wait)))


async def stand_by(svc: IngesterService) -> None:
    """Watch the ownership record (about every lease/3, and just after the owner's lease
    would lapse), following the store's log meanwhile; once the lease has lapsed (or was
    released), take the prefix over with the next epoch, bring the WAL up to the log's end
    and start serving."""
    own = svc.ownership
    assert own is not None and svc.own_objects is not None
    interval = svc.config.lease_seconds / 3
    follower = svc.follower = LogFollower(svc.own_objects, svc.config.wal_dir, svc.config.wal_map_size)
    following = _Following(follower, min(interval, FOLLOW_INTERVAL_MAX))
    following.start()
    ownerless_said = False
    try:
        while True:
            wait = interval
            try:
                rec = await own.current()
                now = time.time()
                if rec is None:
                    # Nobody has ever owned the prefix. A standby exists to follow an owner: taking
                    # an empty prefix over made one pointed at a mistyped prefix a working owner of
                    # an empty store, and one that started first took the prefix from the owner
                    # meant to have it, which was then refused (found by QA).
                    if not ownerless_said:
                        log.warning("standby: nobody owns %s (no ownership record there): waiting for an owner "
                                    "(`ds3 ingester` without --standby) to start; check --store%s if one runs",
                                    own.store.url, " and --ingester-id" if svc.config.ingester_id else "")
                        ownerless_said = True
                    svc.standby_status = "standby (no owner yet: nobody has owned the store prefix)"
                    await asyncio.sleep(wait)
                    continue
                if rec.owner_id == own.owner_id or rec.lapsed(now, own.max_skew):
                    lapsed_at = time.monotonic()
                    # The step in flight finishes first (its WAL is where the takeover starts);
                    # the lease is taken after it, so that it is renewed from then on.
                    await following.stop()
                    try:
                        await own.acquire()
                        if await _take_over(svc, rec, lapsed_at):
                            return
                    finally:
                        if svc.standing_by:  # not taken over (lost the race, the store failed): follow on
                            following.start()
                    continue
                old = svc.standby_owner
                if old is None or (rec.owner_id, rec.epoch, rec.advertise_url) != (old.owner_id, old.epoch,
                                                                                   old.advertise_url):
                    # (said when the owner changes, not at each of its lease renewals)
                    log.info("standby: %s at %s owns %s (epoch %d)", rec.owner_id, rec.advertise_url or "(no URL)",
                             own.store.url, rec.epoch)
                svc.standby_owner = rec
                svc.standby_status = f"standby (owner: {rec.advertise_url or rec.owner_id}, epoch {rec.epoch})"
                until_lapse = rec.lease_expires_at + own.max_skew - now
                wait = min(interval, max(0.02, until_lapse + 0.02))
            except OwnedElsewhere:  # another standby won the race: watch it
                wait = 0.05
            except (ObjectStoreError, TimeoutError) as e:
                log.warning("standby: reading the ownership record of %s failed: %s", own.store.url, e)
            await asyncio.sleep(wait)
    finally:
        await following.stop(cancel=True)


class _Following:
    """The follower's loop as a task that can be stopped (the step in flight let finish, or
    cancelled) and started again."""

    def __init__(self, follower: LogFollower, interval: float) -> None:
        self.follower = follower
        self.interval = interval
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if not following_on() or (self._task is not None and not self._task.done()):
            return  # (off: the takeover then restores the whole log, as a standby did before)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(follow(self.follower, self.interval, self._stop), name="ds3-standby-follow")

    async def stop(self, cancel: bool = False) -> None:
        self._stop.set()
        if self._task is not None:
            if cancel:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def following_on() -> bool:
    """DS3_STANDBY_FOLLOW=0 turns following off: for tests of the whole-log restore at a
    takeover, and A/B measurements (docs/architecture.md)."""
    return os.environ.get("DS3_STANDBY_FOLLOW", "1") not in ("0", "false", "no", "off")


async def follow(follower: LogFollower, interval: float, stop: asyncio.Event) -> None:
    """Step the follower every `interval` until `stop`; failures are retried with a backoff
    (the takeover restores the whole log if the followed one is not usable then)."""
    delay = interval
    while not stop.is_set():
        try:
            applied = await follower.step()
            if applied:
                log.debug("standby: followed the log to commit %d (%d commits)", follower.seq, applied)
            delay = interval
        except Exception as e:  # a background loop: said, backed off, tried again
            delay = min(FOLLOW_BACKOFF_MAX, delay * 2)
            log.warning("standby: following the store's log failed (%s); again in %.1f s", e, delay)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stop.wait()


async def _take_over(svc: IngesterService, previous: OwnerRecord, lapsed_at: float) -> bool:
    """We own the prefix now: restore and serve. False (ownership released again) if the
    store's log cannot be restored now; the standby then carries on watching."""
    own = svc.ownership
    assert own is not None and svc.own_objects is not None
    log.warning("standby: taking over %s (epoch %d) from %s, epoch %d", own.store.url, own.epoch,
                previous.owner_id, previous.epoch)
    say_if_weaker(previous, svc.config)
    assert svc.follower is not None
    try:
        # The WAL dir holds the followed log (the follower started it afresh: the store's log
        # is the truth, not what a previous life left there); brought up to the log's end, or
        # restored whole where the followed one cannot be trusted.
        done = await restore_keeping_the_lease(svc.config, own, svc.own_objects, restore=svc.follower.take_over)
    except (ObjectStoreError, StartRefused, OSError, Superseded) as e:
        log.error("standby: restoring from %s failed (%s); releasing the prefix and watching again",
                  own.store.url, e)
        with contextlib.suppress(Exception):
            await own.release()
        await asyncio.sleep(svc.config.lease_seconds / 3)
        return False
    await svc.start_owned()
    svc.standby_status = None
    svc.standby_owner = None
    log.warning("standby: took over %s at epoch %d; serving (%.3f s after the lease lapsed; %s)", own.store.url,
                own.epoch, time.monotonic() - lapsed_at, done)
    return True


def stopped(task: asyncio.Task[None]) -> None:
    """The standby task's done callback: a takeover that failed stops the process."""
    if task.cancelled() or task.exception() is None:
        return
    log.error("standby: taking over failed; stopping", exc_info=task.exception())
    os.kill(os.getpid(), signal.SIGTERM)
