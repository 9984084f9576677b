"""--standby: an ingester that does not own the store prefix yet watches the ownership record,
answers stream requests with 503 naming the owner, and takes the prefix over (the next epoch)
once the owner's lease lapses or is released: it restores the WAL from the store's log into a
fresh WAL dir and starts serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import time
from typing import TYPE_CHECKING

from ingester.logstore import StartRefused
from ingester.owning import restore_keeping_the_lease
from shared.errors import ObjectStoreError, OwnedElsewhere, Superseded, Unavailable
from shared.ownership import OwnerRecord

if TYPE_CHECKING:
    from ingester.service import IngesterService

log = logging.getLogger("ds3.ingester")


def refusal(svc: IngesterService) -> Unavailable:
    """The 503 a standby answers stream requests with, naming the owner's URL."""
    rec = svc.standby_owner
    own = svc.ownership
    if rec is None:
        return Unavailable(f"this ingester is a standby ({svc.standby_status}); it acknowledges no writes "
                           "until it owns the store prefix", retry_after=1)
    wait = rec.lease_expires_at + (own.max_skew if own is not None else 0) - time.time()
    return Unavailable(f"this ingester is a standby: the store prefix is owned by {rec.owner_id} at "
                       f"{rec.advertise_url or '(no URL)'} (epoch {rec.epoch}); send requests there",
                       retry_after=max(1, math.ceil(wait)))


async def stand_by(svc: IngesterService) -> None:
    """Watch the ownership record (about every lease/3, and just after the owner's lease
    would lapse); once it has lapsed (or was released), take the prefix over with the next
    epoch, restore the WAL from the store's log into a fresh WAL dir and start serving."""
    own = svc.ownership
    assert own is not None
    interval = svc.config.lease_seconds / 3
    while True:
        wait = interval
        try:
            rec = await own.current()
            now = time.time()
            if rec is None or rec.owner_id == own.owner_id or rec.lapsed(now, own.max_skew):
                lapsed_at = time.monotonic()
                await own.acquire()
                if await _take_over(svc, rec, lapsed_at):
                    return
                continue
            old = svc.standby_owner
            if old is None or (rec.owner_id, rec.epoch, rec.advertise_url) != (old.owner_id, old.epoch, old.advertise_url):
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


async def _take_over(svc: IngesterService, previous: OwnerRecord | None, lapsed_at: float) -> bool:
    """We own the prefix now: restore and serve. False (ownership released again) if the
    store's log cannot be restored now; the standby then carries on watching."""
    own = svc.ownership
    assert own is not None and svc.own_objects is not None
    log.warning("standby: taking over %s (epoch %d) from %s", own.store.url, own.epoch,
                f"{previous.owner_id}, epoch {previous.epoch}" if previous is not None else "nobody")
    try:
        # The local WAL may be stale (an earlier takeover, a previous life as owner): the
        # store's log is the truth. Start from a fresh WAL dir: checkpoint + segments.
        shutil.rmtree(svc.config.wal_dir, ignore_errors=True)
        await restore_keeping_the_lease(svc.config, own, svc.own_objects)
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
    log.warning("standby: took over %s at epoch %d; serving (%.3f s after the lease lapsed)", own.store.url,
                own.epoch, time.monotonic() - lapsed_at)
    return True


def stopped(task: asyncio.Task[None]) -> None:
    """The standby task's done callback: a takeover that failed stops the process."""
    if task.cancelled() or task.exception() is None:
        return
    log.error("standby: taking over failed; stopping", exc_info=task.exception())
    os.kill(os.getpid(), signal.SIGTERM)
