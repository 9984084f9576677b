"""The ingester's metrics and readiness checks, read from its components when scraped or
probed (shared/http/metrics.py, shared/http/health.py)."""

from __future__ import annotations

from collections.abc import Iterator

import lmdb
from aiohttp import web
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ingester.fastlane import served
from ingester.service import SERVICE, IngesterService
from shared.config import IngesterConfig
from shared.http.health import READINESS, store_check
from shared.http.limits import LIMITS
from shared.http.metrics import AppMetrics, StoreCollector, counter, gauge
from shared.objectstore.base import ObjectStore


def _wal(svc: IngesterService) -> Iterator[Metric]:
    try:
        stats = svc.wal.stats()
        info = svc.wal.env.info()
        page = int(svc.wal.env.stat()["psize"])
    except lmdb.Error:  # closed during shutdown
        return
    yield gauge("ds3_wal_records", "Records (messages) in the WAL: acknowledged, not sealed yet.", stats["records"])
    yield gauge("ds3_wal_record_bytes", "Bytes the WAL's records and journal databases occupy (pages).", stats["record_bytes"])
    yield gauge("ds3_wal_streams", "Streams the WAL knows (open, closed, soft-deleted).", stats["streams"])
    yield gauge("ds3_wal_file_bytes", "Bytes of the LMDB file in use (its high-water mark).",
                (int(info["last_pgno"]) + 1) * page)


def _streams(svc: IngesterService) -> int | None:
    try:
        return svc.wal.stats()["streams"]
    except lmdb.Error:  # closed during shutdown
        return None


def _cluster(svc: IngesterService) -> Iterator[Metric]:
    m = svc.membership
    if m is None:
        return
    cluster = m.cluster
    me = m.me
    member = GaugeMetricFamily("ds3_cluster_member", "1 while the cluster description names this ingester "
                               "(labels: its id and URL there), else 0.", labels=["ingester_id", "url"])
    member.add_metric([m.ingester_id, me.url if me is not None else ""], 1 if me is not None else 0)
    yield member
    yield gauge("ds3_cluster_generation", "Generation of the cluster description this ingester places streams "
                "by (0: none read yet).", cluster.generation if cluster is not None else 0)
    yield gauge("ds3_cluster_ingesters", "Ingesters the cluster description names.",
                len(cluster.ingesters) if cluster is not None else 0)
    streams = _streams(svc)
    if streams is not None:
        held = GaugeMetricFamily("ds3_cluster_streams", "Streams this ingester holds (its WAL's: open, closed, "
                                 "soft-deleted), by ingester id: sum over ingesters for the cluster.",
                                 labels=["ingester_id"])
        held.add_metric([m.ingester_id], streams)
        yield held
    yield counter("ds3_cluster_misdirected", "Stream requests refused with 421 Misdirected Request: another "
                  "ingester owns the stream.", m.misdirected)
    yield counter("ds3_cluster_description_read_failures", "Reads of the cluster description that failed or "
                  "were refused (the last good one stays in use).", m.watcher.failures)
    if svc.cross_forks is not None:
        yield counter("ds3_cluster_remote_forks_created", "Forks created here whose source lives on another "
                      "ingester (pinned there, inherited history read from the store).", svc.cross_forks.created)
        yield counter("ds3_cluster_fork_pins_released", "Pins of other ingesters' streams released (a remote "
                      "fork removed, or a pin its fork never used).", svc.cross_forks.released)
    mv = svc.moves
    if mv is not None:
        yield gauge("ds3_cluster_moves_pending_out", "Keys (streams, buckets) this ingester holds that another "
                    "ingester owns, as of its last move sweep: still to move out.", mv.pending_out)
        yield counter("ds3_cluster_moved_in", "Keys moved in from their previous owner.", mv.moved_in)
        yield counter("ds3_cluster_moved_out", "Keys moved out (the new owner holds them; the copy here was "
                      "dropped).", mv.moved_out)
        yield gauge("ds3_cluster_moves_in_flight", "Pulls waiting for the previous owner's export now.", mv.pulling)
        yield counter("ds3_cluster_move_failures", "Move steps that failed (each is retried).", mv.failures)
        yield from mv.move_seconds.collect()


def cluster_status(svc: IngesterService | None) -> dict[str, object] | None:
    """The "cluster" field of /readyz: who this ingester is, by which description, holding how many streams."""
    if svc is None or svc.membership is None:
        return None
    m = svc.membership
    cluster, me = m.cluster, m.me
    return {
        "ingester_id": m.ingester_id,
        "url": me.url if me is not None else None,
        "generation": cluster.generation if cluster is not None else None,
        "ingesters": [{"id": i.id, "url": i.url} for i in cluster.ingesters] if cluster is not None else [],
        "streams": _streams(svc),
        "source": m.watcher.source.description,
        "error": m.watcher.error,
        "moves": svc.moves.status() if svc.moves is not None else None,
    }


def collect(app: web.Application) -> Iterator[Metric]:
    svc = app.get(SERVICE)
    if svc is None:  # not started yet, or stopped
        return
    if svc.standing_by:  # no writer yet: what it knows of the owner's log
        yield from _following(svc)
        return
    committer = svc.committer
    yield from svc.append_seconds.collect()
    lane_served = served(app)
    if lane_served is not None:
        yield counter("ds3_http_fast_lane_appends", "Appends answered by the fast lane (ingester/fastlane.py), "
                      "not by aiohttp's handlers.", lane_served[0])
        yield counter("ds3_http_fast_lane_requests", "Requests (appends and HEADs) answered by the fast lane.",
                      lane_served[1])
    yield counter("ds3_wal_commits", "Group commits (durable write transactions).", committer.batches)
    yield counter("ds3_wal_operations", "Write operations committed (appends, creates, seals, ...).", committer.ops)
    yield from committer.batch_sizes.collect()
    yield from committer.commit_seconds.collect()
    yield from _wal(svc)
    yield from _cluster(svc)
    yield gauge("ds3_ingester_live_waiters", "Long-polls and SSE streams waiting for appends now.",
                svc.notifier.waiting)
    sealer = svc.sealer
    if sealer is not None:
        yield counter("ds3_seal_uploads", "Chunks sealed into the object store.", sealer.uploaded)
        yield counter("ds3_seal_upload_failures", "Chunk upload attempts that failed (each is retried with "
                      "backoff).", sealer.upload_failures)
        yield gauge("ds3_seal_backlog", "Chunks waiting to be uploaded, or uploading now.", sealer.backlog)
        yield from sealer.upload_seconds.collect()
    shipper = svc.shipper
    if shipper is not None:
        yield counter("ds3_log_segments_uploaded", "Log segments (group commits' write-sets) uploaded to the "
                      "object store.", shipper.segments_uploaded)
        yield counter("ds3_log_segment_bytes", "Bytes of log segments uploaded.", shipper.segment_bytes)
        yield counter("ds3_log_upload_failures", "Log segment uploads that failed (retried with backoff).",
                      shipper.upload_failures)
        yield counter("ds3_log_checkpoints_uploaded", "Checkpoints of the WAL uploaded.", shipper.checkpoints_uploaded)
        yield counter("ds3_log_checkpoint_bytes", "Bytes of checkpoints uploaded.", shipper.checkpoint_bytes)
        yield from shipper.segment_put_seconds.collect()
        yield gauge("ds3_log_shipped_seq", "The last commit seq known to be in the object store.", shipper.shipped_seq)
        yield gauge("ds3_log_committed_seq", "The last logged commit seq of the local WAL.", committer.seq)
        yield gauge("ds3_log_queued_commits", "Logged commits not yet in the object store.", shipper.queued)
        if svc.visibility is not None:
            yield gauge("ds3_log_unseen_commits", "Commits in the WAL that readers do not see yet: the store's log "
                        "does not hold them (--durability store).", svc.visibility.held)
        if svc.store_effects is not None:
            yield gauge("ds3_log_held_store_effects", "Commits whose effects in the object store (chunk uploads, "
                        "descriptors, deletions) wait for the store's log to hold them (--durability local).",
                        svc.store_effects.held)
        yield gauge("ds3_log_lag_seconds", "How long the oldest commit not yet in the object store has waited "
                    "(0: none waits).", shipper.lag_seconds())
    ownership = svc.ownership
    if ownership is not None:
        yield gauge("ds3_owner_epoch", "The epoch of this ingester's ownership of its store prefix.", ownership.epoch)
        yield gauge("ds3_owner_lease_remaining_seconds", "Seconds left on the ownership lease (0: fenced or lapsed).",
                    ownership.remaining())
    deleted = CounterMetricFamily("ds3_objects_deleted", "Objects deleted from the object store, by reason.",
                                  labels=["reason"])
    deleted.add_metric(["retention"], svc.reaper.deleted if svc.reaper is not None else 0)
    deleted.add_metric(["removed_stream"], sealer.gc_deleted if sealer is not None else 0)
    deleted.add_metric(["log_covered"], shipper.objects_deleted if shipper is not None else 0)
    yield deleted
    lim = app.get(LIMITS)
    if lim is not None:
        yield counter("ds3_slow_clients_dropped", "Connections dropped because the client took nothing sent to it "
                      "for --send-timeout.", lim.stuck.dropped)


def install(app: web.Application, metrics: AppMetrics, config: IngesterConfig) -> None:
    metrics.add(lambda: collect(app))
    metrics.add(StoreCollector(lambda: _service_stores(app)).collect)

    async def wal() -> str | None:
        svc = app.get(SERVICE)
        if svc is None:
            return "starting"
        if svc.standing_by:
            return "a standby's copy of the store's log (opened for writing when it takes over)"
        try:
            svc.wal.env.info()
        except lmdb.Error as e:
            return f"the LMDB environment is not open ({e})"
        return None if svc.committer.alive else "the WAL writer thread is not running"

    ready = app[READINESS]
    ready.add("wal", wal, cached=False)
    if config.store is not None:
        ready.add("object_store", store_check(lambda: _chunk_store(app)))
    if config.ingester_id is not None:
        async def cluster() -> str | None:
            svc = app.get(SERVICE)
            if svc is None or svc.membership is None:
                return "starting"
            return svc.membership.readiness()

        ready.add("cluster", cluster, cached=False)
        ready.describe("cluster", lambda: cluster_status(app.get(SERVICE)))

    if config.store is not None:  # every ingester with a store owns its prefix, or is fenced
        async def owner() -> str | None:
            svc = app.get(SERVICE)
            if svc is None or svc.ownership is None:
                return "starting"
            if svc.standing_by:  # "standby (owner: <url>, epoch N)"
                return svc.standby_status
            return None if svc.ownership.valid() else "this ingester does not own its store prefix (fenced)"

        ready.add("ownership", owner, cached=False)

        async def shipping() -> str | None:  # writes refused for the log's sake (ingester/shipper.py)
            svc = app.get(SERVICE)
            shipper = None if svc is None else svc.shipper
            return None if shipper is None else shipper.refusing()

        ready.add("log", shipping, cached=False)


def _service_stores(app: web.Application) -> list[ObjectStore]:
    svc = app.get(SERVICE)
    return [] if svc is None else svc.stores


def _chunk_store(app: web.Application) -> ObjectStore | None:
    svc = app.get(SERVICE)
    return None if svc is None else svc.objects


def _following(svc: IngesterService) -> Iterator[Metric]:
    follower = svc.follower
    if follower is None:
        return
    yield gauge("ds3_standby_followed_seq", "The last commit of the store's log this standby's WAL holds (a "
                "takeover replays only what follows it).", follower.seq)
    yield gauge("ds3_standby_followed_at", "When this standby last read the store's log (Unix time; 0: not yet).",
                follower.stepped_at)
    yield counter("ds3_standby_follow_steps", "Reads of the store's log that brought this standby's WAL up to date.",
                  follower.steps)
    yield counter("ds3_standby_log_restores", "Whole-log restores into this standby's WAL (at start, after the "
                  "owner checkpointed, after a failed step).", follower.restores)
