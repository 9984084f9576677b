"""The ingester's periodic chores on the writer: expiring streams, sealing aged chunks,
persisting TTL renewals; and a line of WAL throughput in the log every 10 s or so."""

from __future__ import annotations

import asyncio
import logging
import time

from ingester.store import Store
from ingester.wal import GroupCommitter
from shared.config import IngesterConfig
from shared.errors import Superseded, Unavailable

log = logging.getLogger("ds3.ingester")


async def housekeeping(config: IngesterConfig, committer: GroupCommitter, store: Store, *, sealing: bool) -> None:
    """Expire streams and persist TTL renewals; back off (capped) when the WAL fails."""
    tick = config.sweep_interval
    if sealing:  # honour the seal age to within half of it
        tick = min(tick, config.seal_age / 2)
    delay = tick
    last_fold = time.monotonic()
    last_stats = (time.monotonic(), 0, 0)
    mine = 0  # operations of our own since the last stats line (an idle WAL's are all ours: no line)
    while True:
        await asyncio.sleep(delay)
        t, b, o = time.monotonic(), committer.batches, committer.ops
        if t - last_stats[0] >= 10 and o - last_stats[2] > mine:
            log.info("wal: %.0f ops/s in %.0f commits/s (%.1f ops per commit)",
                     (o - last_stats[2]) / (t - last_stats[0]), (b - last_stats[1]) / (t - last_stats[0]),
                     (o - last_stats[2]) / max(1, b - last_stats[1]))
        if t - last_stats[0] >= 10:
            last_stats, mine = (t, b, o), 0
        try:
            mine += 1
            await committer.submit(store.sweep_expired)
            if sealing:
                mine += 1
                await committer.submit(store.seal_aged)
            if time.monotonic() - last_fold > 5:
                mine += 1
                await committer.submit(store.fold_touches)
                last_fold = time.monotonic()
            delay = tick
        except Superseded:  # not our prefix now (said once, by fence()): wait quietly
            delay = min(delay * 2, 60.0)
        except Unavailable as e:  # the store failing, the WAL full...: said where it happens; back off
            log.debug("housekeeping: %s", e.message)
            delay = min(delay * 2, 60.0)
        except Exception:
            log.exception("housekeeping failed")
            delay = min(delay * 2, 60.0)
