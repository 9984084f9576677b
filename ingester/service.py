"""The ingester's moving parts wired together: WAL, writer, reads, wake-ups, housekeeping.

Its concerns live in modules of their own: taking the store prefix and restoring at start
(ingester/owning.py), keeping its lease (ingester/lease.py), --standby (ingester/standby.py),
cluster membership (ingester/cluster_member.py), reads of sealed chunks
(ingester/sealed_reads.py) and the periodic chores (ingester/housekeeping.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar, cast

import aiohttp
import lmdb
from aiohttp import web

from ingester import membership, retention, standby, wal_binding
from ingester.cluster_member import OwnedCheck, join_cluster
from ingester.forks_across import CrossForks
from ingester.housekeeping import housekeeping
from ingester.lease import keep_lease
from ingester.live import Notifier
from ingester.log_follow import LogFollower
from ingester.logstore import StartRefused
from ingester.moves import Mover
from ingester.owning import own_and_restore, own_store, owner_id
from ingester.reads import ReadResult, Reads
from ingester.reaper import ObjectReaper
from ingester.records import StreamMeta
from ingester.sealed_reads import complete_read, sealed_sub_offset
from ingester.sealing import Sealer
from ingester.shipper import Durability, Shipper
from ingester.snapshots import Snapshots
from ingester.store import Store
from ingester.store_effects import StoreEffects
from ingester.visibility import Visibility
from ingester.wal import GroupCommitter, WalEnv, gate_refusal
from ingester.writes import (
    AppendRequest,
    AppendResult,
    Committed,
    CreateRequest,
    CreateResult,
    SealPolicy,
    SubOffsetSealed,
)
from shared import offsets
from shared.chunkstore import ChunkReader
from shared.cluster import Membership
from shared.config import IngesterConfig
from shared.errors import ObjectStoreError, Superseded, Unavailable
from shared.http.metrics import LoopHistogram
from shared.objectstore import LocalStore, ObjectStore, open_store
from shared.owner_watch import MemberOwners
from shared.ownership import OwnerRecord, Ownership
from shared.placement import placement_key
from shared.tasks import spawn

log = logging.getLogger("ds3.ingester")
T = TypeVar("T")
APPEND_SECONDS_BUCKETS: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class IngesterService:
    wal: WalEnv
    store: Store
    reads: Reads

    def __init__(self, config: IngesterConfig) -> None:
        self.config = config
        self.objects: ObjectStore | None = None
        self.own_objects: ObjectStore | None = None  # its log and ownership record (owning.own_store)
        self.sealer: Sealer | None = None
        self.chunk_reader: ChunkReader | None = None
        self.shipper: Shipper | None = None
        self.ownership: Ownership | None = None
        self.notifier = Notifier()
        # SIGTERM's drain began (ingester/app.py end_live_waits): a live wait answers at once,
        # a long-poll as its timeout would, an SSE response ends
        self.draining = False
        self._committer: GroupCommitter | None = None
        self._snapshots: Snapshots | None = None
        self._reaper: ObjectReaper | None = None
        self._blobs: ObjectStore | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()  # (shared/tasks.py)
        # With --ingester-id: the cluster description and which streams are this ingester's
        # (handlers and the fast lane check every stream request against it). None: no cluster.
        self.membership: Membership | None = None
        self.peers: aiohttp.ClientSession | None = None
        # Where the other members run when a standby took one over (with a store: their records)
        self.members: MemberOwners | None = None
        self.cross_forks: CrossForks | None = None  # forks of other ingesters' streams (a cluster)
        self.moves: Mover | None = None  # moving streams in and out as the description changes
        self._owned_check = OwnedCheck(self)  # owned_key
        self._lease_task: asyncio.Task[None] | None = None
        # --standby: why this ingester does not serve yet (None: it owns the prefix and serves),
        # and the owner's record as last read.
        self.standby_status: str | None = None
        self.standby_owner: OwnerRecord | None = None
        self.follower: LogFollower | None = None  # a standby's copy of the store's log (ingester/log_follow.py)
        self.visibility: Visibility | None = None  # --durability store: what readers see (ingester/visibility.py)
        self.store_effects: StoreEffects | None = None  # --durability local (ingester/store_effects.py)
        self._standby_task: asyncio.Task[None] | None = None
        # Collected by ingester.metrics at scrape time; observed on the event loop only.
        self.append_seconds = LoopHistogram(
            "ds3_ingester_append_seconds", "Time from an append's submission to the writer until it is durable "
            "(acknowledged appends).", APPEND_SECONDS_BUCKETS,
        )
        if config.store is None:  # nothing to restore from: open the WAL now
            self._open_wal()

    def _open_wal(self) -> None:
        config = self.config
        self.wal = WalEnv(config.wal_dir, config.wal_map_size)
        seal = None
        if config.store is not None:
            seal = SealPolicy(config.seal_bytes, config.seal_age, config.wal_max_bytes)
        self.store = Store(self.wal, seal=seal)
        self.reads = Reads(self.wal, self.store.touches, threads=config.read_threads)

    def _open_ownership(self) -> Ownership:
        config = self.config
        assert config.store is not None
        self.objects = open_store(config.store, s3_endpoint=config.s3_endpoint)
        self.own_objects = own_store(self.objects, config)
        self.ownership = Ownership(self.own_objects, owner_id(config), config.advertised,
                                   lease_seconds=config.lease_seconds, durability=config.durability)
        return self.ownership

    # --- standby (--standby, ingester/standby.py) ------------------------------------------

    @property
    def standing_by(self) -> bool:
        """A standby that has not taken over yet: no WAL, no writer; stream requests get 503."""
        return self.standby_status is not None

    def standby_refusal(self) -> Unavailable:
        """The 503 a standby answers stream requests with, naming the owner's URL."""
        return standby.refusal(self)

    def fenced_refusal(self) -> Superseded | None:
        """Why this ingester answers no stream request now (None: it may): it owned its store
        prefix and does not now (taken over, or its lease lapsed before a renewal). Reads too,
        not only writes: another ingester may have taken over and appended since, so our tail,
        a HEAD's next offset, a long-poll's "nothing new", may be stale."""
        own = self.ownership
        if own is None or self.standing_by or own.valid():
            return None
        refusal = self._committer.refusal if self._committer is not None else None
        if isinstance(refusal, Superseded):
            return refusal
        return Superseded("this ingester does not own its store prefix now: its lease lapsed before it was "
                          "renewed (the object store did not answer in time, or another ingester took over)",
                          own.epoch)

    @property
    def committer(self) -> GroupCommitter:
        assert self._committer is not None, "service not started"
        return self._committer

    @property
    def snapshots(self) -> Snapshots:
        assert self._snapshots is not None, "service not started"
        return self._snapshots

    @property
    def reaper(self) -> ObjectReaper | None:
        return self._reaper

    @property
    def stores(self) -> list[ObjectStore]:
        """The object stores in use: sealed chunks, and snapshot blobs (the same store, or a
        directory under --data-dir without one)."""
        return [s for s in (self.objects, self._blobs) if s is not None]

    async def start(self) -> None:
        if self.config.store is None:
            wal_binding.check(self.wal, self.config.wal_dir, None)
        else:
            self._open_ownership()
            assert self.own_objects is not None and self.objects is not None
            adopts = False
            try:
                if self.config.ingester_id is None:
                    await membership.check_lone(self.objects, self.config.store)
                else:
                    adopts = await membership.adopts(self.objects, self.config.ingester_id)
            except ObjectStoreError as e:
                if not self.config.standby:  # (a standby waits for its store; taking over checks it)
                    raise StartRefused(f"not starting: cannot read {self.config.store}: {e}") from None
            wal_binding.check_dir(self.config.wal_dir, self.config.wal_map_size, self.own_objects.url,
                                  may_join=adopts)
        if self.config.standby:
            self.standby_status = "standby (owner: not read yet)"
            self._standby_task = asyncio.create_task(standby.stand_by(self), name="ds3-standby")
            self._standby_task.add_done_callback(standby.stopped)
            return
        if self.ownership is not None:
            assert self.own_objects is not None
            await own_and_restore(self.config, self.ownership, self.own_objects,
                                  adopted_from=self.objects if adopts else None)
        await self.start_owned()

    async def start_owned(self) -> None:
        """Open the WAL and start writing (the store prefix is ours, the WAL restored)."""
        loop = asyncio.get_running_loop()
        if self.config.store is not None:
            self._open_wal()
            assert self.own_objects is not None
            wal_binding.bind(self.wal, self.config.wal_dir, self.own_objects.url)
            self.shipper = Shipper(self.wal, self.own_objects, loop, durability=cast(Durability, self.config.durability),
                                   interval=self.config.ship_interval, max_lag=self.config.ship_lag_bound,
                                   checkpoint_interval=self.config.checkpoint_interval, ownership=self.ownership,
                                   uploads=self.config.log_uploads)
        hold: Callable[[int, Any], Any] | None = None
        if self.shipper is not None and self.config.durability == "store":
            # Readers see a commit once the store's log has it (ingester/visibility.py).
            self.visibility = Visibility(self.wal, self._on_durable, time.time)
            self.store.visibility = self.reads.visibility = self.visibility
            self.shipper.on_stored = self.visibility.release
            hold = self.visibility.hold
        elif self.shipper is not None:
            # A commit's effects in the store wait for the store's log (ingester/store_effects.py).
            self.store_effects = StoreEffects(self._on_durable, self.shipper.wake_soon)
            self.shipper.on_stored, self.shipper.urgent = self.store_effects.release, self.store_effects.urgent
            hold = self.store_effects.hold
        self._committer = GroupCommitter(
            self.wal, loop, on_abort=self.store.reset, on_commit=self.store.flush, on_durable=self._on_durable,
            on_logged=self.shipper.on_logged if self.shipper is not None else None, hold=hold,
        )
        self._committer.start()
        if self.shipper is not None:
            await self.shipper.prepare(self.committer.seq)
            self.shipper.start()
            assert self.ownership is not None
            self._lease_task = asyncio.create_task(keep_lease(self), name="ds3-lease")
            log.info("logging commits to %s (durability %s, epoch %d, from commit %d)", self.config.store,
                     self.config.durability, self.ownership.epoch, self.committer.seq)
        n = await self.committer.submit(self.store.load_expiry_index)
        log.info("write-ahead log open at %s (%d streams with an expiry)", self.config.wal_dir, n)
        if self.config.store is not None:
            assert self.objects is not None
            self.chunk_reader = ChunkReader(self.objects)
            self.sealer = Sealer(self.store, self.committer, self.objects, self.reads.run, self.config.uploads)
            refs = await self.committer.submit(self.store.load_sealing_index)
            garbage = await self.committer.submit(self.store.load_gc)
            self.sealer.enqueue_chunks(refs)
            self.sealer.enqueue_removed(garbage)
            self.sealer.enqueue_descriptors(await self.committer.submit(self.store.load_unpublished))
            self.sealer.start()
            self.sealer.enqueue_drops(await self.committer.submit(self.store.load_drops))
            log.info("sealing chunks into %s (%d to upload, %d removed streams to clean)",
                     self.config.store, len(refs), len(garbage))
        if self.config.ingester_id is not None:
            await join_cluster(self, self.config.ingester_id)
        # Snapshot blobs live in the object store; with none configured, in the data dir.
        self._blobs = self.objects or LocalStore(self.config.data_dir.absolute() / "snapshots")
        self._reaper = ObjectReaper(self.store, self.committer, self._blobs)
        self._reaper.enqueue(await self.committer.submit(lambda txn: retention.pending(self.store, txn)))
        self._reaper.start()
        self._snapshots = Snapshots(
            self.store, self.committer, self.reads, self._blobs, self.chunk_reader, self.published,
            self.reap_when_stored, self.config.max_read_bytes,
        )
        self._tasks.append(asyncio.create_task(
            housekeeping(self.config, self.committer, self.store, sealing=self.sealer is not None),
            name="ds3-housekeeping"))

    def fence(self, why: str, *, for_good: bool = True) -> None:
        """We may not own the store prefix (taken over, or our lease ran out): acknowledge
        nothing more (every write: 503), upload no more log segments; for good, no more chunks
        either."""
        log.error("fenced: %s; every write answers 503 %s", why,
                  "from now on" if for_good else "until the store prefix is ours again")
        refusal = Superseded(f"this ingester does not own its store prefix now: {why}", self.ownership.epoch
                             if self.ownership is not None else 0)
        if self._committer is not None:
            self._committer.refusal = refusal
        if self.shipper is not None:
            self.shipper.fence(why)
        if for_good and self.sealer is not None:
            spawn(self.sealer.stop(), self._background, "stopping the sealer of a fenced ingester", logger=log)

    async def stop(self) -> None:
        if self._standby_task is not None:
            self._standby_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._standby_task
        if self.cross_forks is not None:
            await self.cross_forks.stop()
        if self.moves is not None:
            await self.moves.stop()
        if self.peers is not None:
            await self.peers.close()
        if self.members is not None:
            await self.members.stop()
        if self.membership is not None:
            await self.membership.watcher.stop()
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease_task
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.notifier.wake_all()
        if self._reaper is not None:
            await self._reaper.stop()
        if self.sealer is not None:
            await self.sealer.stop()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._blobs is not None and self._blobs is not self.objects:
            await self._blobs.close()
        if self._committer is not None:
            folds: list[asyncio.Future[int]] = []
            with contextlib.suppress(Exception):
                folds.append(self.committer.submit(self.store.fold_touches))
                folds.append(self.committer.submit(self.store.fold_last_writes))
                folds.append(self.committer.submit(self.store.mark_clean))  # (after the folds: commit order)
            if self.shipper is None:
                await asyncio.gather(*folds, return_exceptions=True)
            await asyncio.get_running_loop().run_in_executor(None, self.committer.stop)
            if self.shipper is not None:
                # The folds' outcomes may wait for their segment (store durability), and the
                # shipping task may be cancelled already (a signal): ship from here.
                await self.shipper.stop()
                await asyncio.gather(*folds, return_exceptions=True)
        if self.ownership is not None:
            with contextlib.suppress(Exception):
                await self.ownership.release()
        if self.objects is not None:
            await self.objects.close()
        if hasattr(self, "reads"):
            self.reads.close()
        if hasattr(self, "wal"):
            self.wal.close()

    def _on_durable(self, news: Committed) -> None:
        self.notifier.bump(news.changed)
        if news.released and self._reaper is not None:
            self._reaper.enqueue(news.released)
        if self.sealer is not None:
            self.sealer.enqueue_chunks(news.rolled)
            self.sealer.enqueue_removed(news.removed)
            if news.descriptors:
                self.sealer.enqueue_descriptors(news.descriptors)

    async def owned(self, path: str) -> None:
        """In a cluster: 421 unless this ingester owns the stream now; wait while it moves in
        from its previous owner (503 if that one cannot hand it over). Call only with a
        membership (callers test `membership is not None`, so one ingester pays nothing)."""
        await self.owned_key(placement_key(path), path)

    async def owned_key(self, key: str, path: str | None = None) -> None:
        """`owned` for a placement key (a bucket; or a stream's, with its `path`)."""
        await self._owned_check(key, path)

    # --- writes ------------------------------------------------------------------------

    def _submit(self, fn: Callable[[lmdb.Transaction], T]) -> asyncio.Future[T]:
        return self.committer.submit(fn)

    async def create(self, req: CreateRequest) -> CreateResult:
        if self.cross_forks is not None and req.fork_from is not None and self.cross_forks.is_remote(req.fork_from):
            return await self.cross_forks.create(req)
        for attempt in range(3):
            if req.fork_from is not None and req.fork_sub_offset and req.fork_offset is not None:
                resolved = await self._sealed_sub_offset(req.fork_from, req.fork_offset, req.fork_sub_offset)
                if resolved is not None:
                    req = dataclasses.replace(req, fork_sub_position=resolved)
            try:
                result = await self._submit(functools.partial(self.store.create, req=req))
                break
            except SubOffsetSealed:
                if attempt == 2:
                    raise
        else:  # pragma: no cover - the loop breaks or raises
            raise AssertionError("unreachable")
        if result.created and self.sealer is not None:
            # The path may have held an earlier stream (deleted, or expired just now): readers
            # must see the new descriptor before anyone can read the new stream through them.
            await self.published(req.path)
        return result

    async def _sealed_sub_offset(self, source_path: str, fork_offset: str, sub: int) -> int | None:
        """A fork sub-offset into a sealed chunk of the source (ingester/sealed_reads.py);
        None: not sealed."""
        if self.chunk_reader is None:
            return None
        return await sealed_sub_offset(self.reads, self.chunk_reader, source_path, fork_offset, sub)

    async def append(self, req: AppendRequest) -> AppendResult:
        started = time.perf_counter()
        result = await self._submit(lambda txn: self.store.append(txn, req))
        self.append_seconds.observe(time.perf_counter() - started)
        return result

    async def delete(self, path: str) -> None:
        await self._submit(lambda txn: self.store.delete(txn, path))
        if self.cross_forks is not None and self.store.releases_queued:
            # a fork of another ingester's stream: release its pin before answering, so the
            # source (deleted already, say) is gone when the client looks (queued if that fails)
            self.store.releases_queued = False
            await self.cross_forks.release_now()
        if self.sealer is not None:  # readers must stop serving it once the DELETE is answered
            await self.published(path)

    async def published(self, path: str) -> None:
        """Wait (bounded) until readers see the path's descriptor as the last commit left it:
        in local durability its publishing waits for the store's log first (store_effects)."""
        if self.sealer is None:
            return
        if self.store_effects is not None:
            await self.store_effects.released(self.committer.seq, 2.0)
        await self.sealer.published(path, 2.0)

    def reap_when_stored(self, garbage: list[str]) -> None:
        """Objects the last commit made unreachable, to delete once the store's log holds it
        (at once but in local durability: store_effects)."""
        if self.store_effects is not None:
            self.store_effects.after(self.committer.seq, Committed(released=garbage))
        elif self._reaper is not None:
            self._reaper.enqueue(garbage)

    # --- reads -------------------------------------------------------------------------

    async def head(self, path: str) -> StreamMeta:
        return await self.reads.head(path)

    async def read(self, path: str, start: offsets.Offset | str, *, renew: bool = True) -> ReadResult:
        res = await self.reads.read(path, start, self.config.max_read_bytes)
        if res.sealed is not None or res.continues:
            await complete_read(self.reads, self.chunk_reader, path, res, self.config.max_read_bytes)
        if renew and res.meta.ttl is not None:
            self.store.touches[path] = time.time()
        return res

    async def read_stored(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """`fn` in a read transaction, for what readers see without a stream's hidden state (a
        bucket, the listings). In `--durability store` the answer waits until the store holds
        the commits it read (503 if they fail to get there), as an acknowledgement would: a
        bucket whose create was answered 503 is never shown, nor a stream a standby taking
        over would not have (ingester/visibility.py)."""
        wal = self.wal

        def run() -> tuple[int, T]:
            with wal.env.begin(buffers=False) as txn:
                return wal.commit_seq(txn), fn(txn)

        seq, out = await self.reads.run(run)
        if self.visibility is not None and seq > self.visibility.released_upto:
            assert self.shipper is not None
            gate = self.shipper.on_logged.caught_up(seq)
            if gate is not None:
                try:  # (shielded: a client that leaves must not cancel the shipper's future)
                    await asyncio.shield(asyncio.wrap_future(gate))
                except Exception as why:
                    raise gate_refusal(why) from None
        return out

    def touch(self, meta: StreamMeta) -> None:
        if meta.ttl is not None:
            self.store.touches[meta.path] = time.time()


SERVICE: Final = web.AppKey("ingester_service", IngesterService)
