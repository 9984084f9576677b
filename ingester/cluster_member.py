"""As one of a cluster's ingesters (--ingester-id): joining the cluster (the description, the
peers' session, forks across ingesters, moves) and checking that a stream is this ingester's
before it is served."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import aiohttp

from ingester.forks_across import CrossForks
from ingester.moves import Mover
from shared.cluster import ClusterWatcher, FileSource, Membership, StoreSource
from shared.errors import Misdirected
from shared.owner_watch import MemberOwners

if TYPE_CHECKING:
    from ingester.service import IngesterService

log = logging.getLogger("ds3.ingester")


async def join_cluster(svc: IngesterService, ingester_id: str) -> None:
    if svc.config.cluster is not None:
        source: FileSource | StoreSource = FileSource(svc.config.cluster)
    else:
        assert svc.objects is not None  # the config insists on --store or --cluster
        source = StoreSource(svc.objects)
    watcher = ClusterWatcher(source, svc.config.cluster_refresh)
    await watcher.refresh()  # a failure leaves it without a description: stream requests get 503
    watcher.start()
    svc.membership = Membership(ingester_id, watcher)
    svc.peers = aiohttp.ClientSession()  # calls to the other ingesters (moves, forks): one per process
    svc.members = MemberOwners(svc.objects)  # where a member's standby runs (with a store: its record)
    svc.cross_forks = CrossForks(svc)
    svc.cross_forks.start()
    svc.moves = Mover(svc)
    svc.store.guard = svc.moves.guard  # every write re-checks ownership on the writer thread
    watcher.on_change(svc.moves.changed)
    svc.moves.start()
    why = svc.membership.readiness()
    log.info("cluster member %s (description from %s)%s", ingester_id, source.description,
             f": not ready: {why}" if why else "")


class OwnedCheck:
    """IngesterService.owned_key: 421 unless this ingester owns the placement key now."""

    def __init__(self, svc: IngesterService) -> None:
        self.svc = svc
        self._reread_at = 0.0

    async def __call__(self, key: str, path: str | None) -> None:
        svc = self.svc
        assert svc.membership is not None
        try:
            svc.membership.check_key(key)
        except Misdirected:
            await self._reread_description()
            svc.membership.misdirected -= 1  # one refusal counts once (below, if it is still one)
            svc.membership.check_key(key)
        if svc.moves is None:
            return
        if path is None:
            await svc.moves.ensure_key(key)
        elif svc.moves.needs_pull(path):
            await svc.moves.ensure(path)

    async def _reread_description(self) -> None:
        """Before refusing a stream with 421: re-read the description (a read every 0.25 s at
        most; requests meanwhile share the one in flight). A router that already follows a newer
        one (a change that gave us the stream) then waits for one store read, not for our next
        --cluster-refresh."""
        assert self.svc.membership is not None
        watcher = self.svc.membership.watcher
        now = time.monotonic()
        if watcher.refreshing or now - self._reread_at >= 0.25:
            self._reread_at = now
            await watcher.refresh()
