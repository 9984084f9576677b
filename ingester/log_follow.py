"""A standby follows the owner's log (issue 14): it restores the WAL from the store's log once
it starts, then extends it as segments land, so that a takeover replays only what landed since
its last step, not the whole log since the last checkpoint (up to CHECKPOINT_SEGMENTS
segments fetched one by one, seconds on S3, while nobody acknowledges writes).

What a takeover starts from must be what a restore (ingester/logstore.py) would build from
the store's log at that moment. A restore takes the latest checkpoint, then at every commit
the segment of the highest epoch that holds it; within one epoch a commit has one write-set
(one owner cut it; its re-cut segments hold the same commits), so the WAL depends only on the
epoch taken at each commit. The followed chain is therefore kept only if, in the listing read
after the lease is taken:
- the latest checkpoint is the one it started from (a newer one: the owner may have dropped
  commits that only the checkpoint holds, and the segments it covers are being deleted), and
- no segment it has not seen holds one of its commits under a higher epoch than it took there
  (a new owner's, landed after the step that took an older one's late write).
Otherwise the takeover restores the whole log, as before. Between steps the follower only
reads the store and writes its own WAL dir; it never deletes anything in the store (orphans
beyond the log's end are the owner's business, and the takeover's).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from ingester.logstore import Chain, LogListing, extend, list_log, restore_chain, segment_epoch
from ingester.wal import WalEnv
from shared.objectstore import ObjectStore

log = logging.getLogger("ds3.ingester")


class LogFollower:
    def __init__(self, objects: ObjectStore, wal_dir: Path, map_size: int) -> None:
        self.objects = objects
        self.wal_dir = wal_dir
        self.map_size = map_size
        self.chain: Chain | None = None
        # metrics
        self.steps = 0
        self.restores = 0  # whole-log restores (at start, after the owner checkpointed, after an error)
        self.stepped_at = 0.0  # time.time() of the last step that succeeded

    @property
    def seq(self) -> int:
        """The last commit the followed WAL holds (0: none yet)."""
        return self.chain.seq if self.chain is not None else 0

    async def step(self) -> int:
        """Catch up with what landed; returns the commits applied. Store errors propagate
        (the chain is dropped if the WAL may be half-written: the next step restores)."""
        listing = await list_log(self.objects)
        if self.chain is None or listing.latest_checkpoint != self.chain.base:
            applied = await self._restore(listing, final=False)
        else:
            applied = await self._extend(listing, final=False)
        self.steps += 1
        self.stepped_at = time.time()
        return applied

    async def take_over(self) -> str:
        """With the lease just taken: make the WAL what a restore would build now, from the
        followed chain when it is still good. Returns what was done, for the log."""
        listing = await list_log(self.objects)
        why = "nothing followed yet" if self.chain is None else await self._diverged(listing)
        if why is None:
            before = self.seq
            applied = await self._extend(listing, final=True)
            return f"followed the log to commit {before}; {applied} more commits replayed"
        log.warning("standby: restoring the whole log at the takeover: %s", why)
        applied = await self._restore(listing, final=True)
        return f"restored the whole log ({applied} commits after the checkpoint): {why}"

    async def _diverged(self, listing: LogListing) -> str | None:
        """Why the followed chain is not what a restore would build from `listing` (None: it is)."""
        chain = self.chain
        assert chain is not None
        if listing.latest_checkpoint != chain.base:
            return "the owner checkpointed since the last step"
        base = chain.base[0] if chain.base is not None else 0
        for ref in listing.segments:
            if ref.key in chain.seen or ref.first > chain.seq or ref.last <= base:
                continue
            epoch = await segment_epoch(self.objects, ref.key)
            at = max(ref.first, base + 1)
            if epoch > chain.epoch_at(at):
                return (f"segment {ref.key} (epoch {epoch}) landed since over commit {at}, which the followed log "
                        f"took from epoch {chain.epoch_at(at)}")
        return None

    async def _restore(self, listing: LogListing, *, final: bool) -> int:
        self.chain = None
        shutil.rmtree(self.wal_dir, ignore_errors=True)
        chain = await restore_chain(self.objects, self.wal_dir, self.map_size, listing, final=final)
        self.restores += 1
        self.chain = chain
        return chain.seq - (chain.base[0] if chain.base is not None else 0)

    async def _extend(self, listing: LogListing, *, final: bool) -> int:
        chain = self.chain
        assert chain is not None
        self.chain = None  # until the WAL and the chain agree again
        wal = WalEnv(self.wal_dir, self.map_size)
        try:
            applied = await extend(self.objects, wal, chain, listing, final=final)
        finally:
            wal.close()
        self.chain = chain
        return applied
