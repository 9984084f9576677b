"""Keeping the store prefix while serving: the lease renewed; when it is lost, the service
fenced (IngesterService.fence: every write answers 503, no more log segments), and the prefix
taken back if nobody else took it meanwhile (a store outage outlasted the lease)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ingester.shipper import StoreAhead
from shared.errors import ObjectStoreError, OwnedElsewhere, Superseded
from shared.ownership import LeaseKeeper

if TYPE_CHECKING:
    from ingester.service import IngesterService

log = logging.getLogger("ds3.ingester")


async def keep_lease(svc: IngesterService) -> None:
    """Renew the lease. When it is lost: stop acknowledging at once; if nobody took the
    prefix over (the record is still ours, same epoch: a store outage outlasted the lease),
    take it back once the store answers and carry on; otherwise stay fenced for good."""
    own = svc.ownership
    assert own is not None
    while True:
        epoch = own.epoch
        try:
            await LeaseKeeper(own).run()
        except Superseded as e:
            svc.fence(str(e), for_good=False)
        except Exception as e:  # the keeper broke: the lease runs out; stop acknowledging now
            log.exception("renewing the ownership lease failed")
            svc.fence(f"renewing the lease failed: {e!r}", for_good=False)
        lost = await regain(svc, epoch)
        if lost is not None:
            svc.fence(lost, for_good=True)
            return


async def regain(svc: IngesterService, epoch: int) -> str | None:
    """Take the prefix back after our lease lapsed, if the record is still ours at `epoch`
    (so no one else owned it meanwhile, and no one else wrote its log). Else why not: it was
    taken over (by whom), or the store's log is ahead of our WAL."""
    own, shipper = svc.ownership, svc.shipper
    assert own is not None and shipper is not None
    delay = 0.2
    while True:
        try:
            rec = await own.current()
            if rec is None:
                return "its ownership record is gone"
            if rec.owner_id != own.owner_id or (rec.epoch != epoch and not own.sent(rec)):
                # (a later epoch of ours that we sent: a retake whose answer was lost)
                return f"{rec.owner_id} at {rec.advertise_url or '(no URL)'} took it over (epoch {rec.epoch})"
            await own.acquire()  # our own record: taken back with epoch + 1 (If-Match)
            await shipper.resume(svc.committer.seq)  # checkpoints what the log missed meanwhile
        except (OwnedElsewhere, StoreAhead) as e:
            log.error("cannot take the store prefix back: %s", e)
            return f"it cannot be taken back ({e})"
        except (ObjectStoreError, TimeoutError) as e:
            log.warning("taking the store prefix back failed (%s); again in %.1f s", e, delay)
            await asyncio.sleep(delay)
            delay = min(5.0, delay * 2)
            continue
        svc.committer.refusal = None
        log.warning("ownership of %s taken back (epoch %d): acknowledging writes again", svc.config.store,
                    own.epoch)
        return None

