"""The ingester's moving parts wired together: WAL, writer, reads, wake-ups, housekeeping."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from typing import Final, TypeVar, cast

import aiohttp
import lmdb
from aiohttp import web

from ingester import retention
from ingester.forks_across import CrossForks
from ingester.live import Notifier
from ingester.logstore import StartRefused, drop_wal_behind_log, list_log, restore, wal_is_empty
from ingester.moves import Mover
from ingester.reads import ReadResult, Reads
from ingester.reaper import ObjectReaper
from ingester.records import FLAG_END_OF_APPEND, StreamMeta
from ingester.sealing import Sealer
from ingester.shipper import Durability, Shipper, StoreAhead
from ingester.snapshots import Snapshots
from ingester.store import Store
from ingester.wal import GroupCommitter, WalEnv
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
from shared.cluster import ClusterWatcher, FileSource, Membership, StoreSource
from shared.config import IngesterConfig
from shared.errors import BadRequest, Misdirected, ObjectStoreError, OwnedElsewhere, Superseded, Unavailable
from shared.http.metrics import LoopHistogram
from shared.objectstore import LocalStore, ObjectStore, open_store
from shared.objectstore.scoped import ScopedStore, ingester_scope
from shared.ownership import LeaseKeeper, OwnerRecord, Ownership
from shared.placement import placement_key
from shared.protocol import is_json

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
        self.own_objects: ObjectStore | None = None  # this ingester's log and ownership record (see _own_store)
        self.sealer: Sealer | None = None
        self.chunk_reader: ChunkReader | None = None
        self.shipper: Shipper | None = None
        self.ownership: Ownership | None = None
        self.notifier = Notifier()
        self._committer: GroupCommitter | None = None
        self._snapshots: Snapshots | None = None
        self._reaper: ObjectReaper | None = None
        self._blobs: ObjectStore | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # With --ingester-id: the cluster description and which streams are this ingester's
        # (handlers and the fast lane check every stream request against it). None: no cluster.
        self.membership: Membership | None = None
        self.peers: aiohttp.ClientSession | None = None
        self.cross_forks: CrossForks | None = None  # forks of other ingesters' streams (a cluster)
        self.moves: Mover | None = None  # moving streams in and out as the description changes
        self._reread_at = 0.0
        self._lease_task: asyncio.Task[None] | None = None
        # --standby: why this ingester does not serve yet (None: it owns the prefix and serves),
        # and the owner's record as last read.
        self.standby_status: str | None = None
        self.standby_owner: OwnerRecord | None = None
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

    def _owner_id(self) -> str:
        """--owner-id, else an id kept in the data dir: a restart on the same disk (a crash
        included) takes its own record back at once; a new disk waits for the lease."""
        if self.config.owner_id is not None:
            return self.config.owner_id
        path = self.config.data_dir / "owner-id"
        try:
            found = path.read_text().strip()
            if found:
                return found
        except FileNotFoundError:
            pass
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        oid = f"ingester-{secrets.token_hex(8)}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(oid + "\n")
        os.replace(tmp, path)
        return oid

    def _open_ownership(self) -> Ownership:
        config = self.config
        assert config.store is not None
        self.objects = open_store(config.store, s3_endpoint=config.s3_endpoint)
        self.own_objects = self._own_store(self.objects)
        self.ownership = Ownership(self.own_objects, self._owner_id(), config.advertised,
                                   lease_seconds=config.lease_seconds)
        return self.ownership

    async def _own_and_restore(self) -> None:
        """With a store: own its prefix, and restore an empty data dir from the store's log,
        before the WAL is opened."""
        config = self.config
        ownership = self._open_ownership()
        try:
            await ownership.acquire()
        except OwnedElsewhere as e:
            raise StartRefused(f"not starting: {e} (its lease is renewed while it runs; start this one once "
                               "it stopped, give it the same --owner-id to take it over, or run it with "
                               "--standby to take over when the lease lapses)") from None
        except ObjectStoreError as e:
            raise StartRefused(f"not starting: cannot take ownership of {config.store}: {e}") from None
        if config.durability == "store" and self.own_objects is not None:  # (see drop_wal_behind_log)
            await drop_wal_behind_log(self.own_objects, config.wal_dir, config.wal_map_size)
        if wal_is_empty(config.wal_dir):
            await self._restore_wal()

    async def _restore_wal(self) -> None:
        """Rebuild the (empty) WAL dir from the store's log, if it holds one."""
        assert self.own_objects is not None
        listing = await list_log(self.own_objects)
        if not listing.empty:
            log.info("empty data dir: restoring the WAL from %s (%d checkpoints, %d segments)",
                     self.own_objects.url, len(listing.checkpoints), len(listing.segments))
            await restore(self.own_objects, self.config.wal_dir, self.config.wal_map_size, listing)

    # --- standby (--standby) ------------------------------------------------------------

    @property
    def standing_by(self) -> bool:
        """A standby that has not taken over yet: no WAL, no writer; stream requests get 503."""
        return self.standby_status is not None

    def standby_refusal(self) -> Unavailable:
        """The 503 a standby answers stream requests with, naming the owner's URL."""
        rec = self.standby_owner
        own = self.ownership
        if rec is None:
            return Unavailable(f"this ingester is a standby ({self.standby_status}); it acknowledges no writes "
                               "until it owns the store prefix", retry_after=1)
        wait = rec.lease_expires_at + (own.max_skew if own is not None else 0) - time.time()
        return Unavailable(f"this ingester is a standby: the store prefix is owned by {rec.owner_id} at "
                           f"{rec.advertise_url or '(no URL)'} (epoch {rec.epoch}); send requests there",
                           retry_after=max(1, math.ceil(wait)))

    async def _stand_by(self) -> None:
        """Watch the ownership record (about every lease/3, and just after the owner's lease
        would lapse); once it has lapsed (or was released), take the prefix over with the next
        epoch, restore the WAL from the store's log into a fresh WAL dir and start serving."""
        own = self.ownership
        assert own is not None
        interval = self.config.lease_seconds / 3
        while True:
            wait = interval
            try:
                rec = await own.current()
                now = time.time()
                if rec is None or rec.owner_id == own.owner_id or rec.lapsed(now, own.max_skew):
                    lapsed_at = time.monotonic()
                    await own.acquire()
                    if await self._take_over(rec, lapsed_at):
                        return
                    continue
                if rec != self.standby_owner:
                    log.info("standby: %s at %s owns %s (epoch %d)", rec.owner_id, rec.advertise_url or "(no URL)",
                             own.store.url, rec.epoch)
                self.standby_owner = rec
                self.standby_status = f"standby (owner: {rec.advertise_url or rec.owner_id}, epoch {rec.epoch})"
                until_lapse = rec.lease_expires_at + own.max_skew - now
                wait = min(interval, max(0.02, until_lapse + 0.02))
            except OwnedElsewhere:  # another standby won the race: watch it
                wait = 0.05
            except (ObjectStoreError, TimeoutError) as e:
                log.warning("standby: reading the ownership record of %s failed: %s", own.store.url, e)
            await asyncio.sleep(wait)

    async def _take_over(self, previous: OwnerRecord | None, lapsed_at: float) -> bool:
        """We own the prefix now: restore and serve. False (ownership released again) if the
        store's log cannot be restored now; the standby then carries on watching."""
        own = self.ownership
        assert own is not None
        log.warning("standby: taking over %s (epoch %d) from %s", own.store.url, own.epoch,
                    f"{previous.owner_id}, epoch {previous.epoch}" if previous is not None else "nobody")
        try:
            # The local WAL may be stale (an earlier takeover, a previous life as owner): the
            # store's log is the truth. Start from a fresh WAL dir: checkpoint + segments.
            shutil.rmtree(self.config.wal_dir, ignore_errors=True)
            await self._restore_keeping_the_lease(own)
        except (ObjectStoreError, StartRefused, OSError, Superseded) as e:
            log.error("standby: restoring from %s failed (%s); releasing the prefix and watching again",
                      own.store.url, e)
            with contextlib.suppress(Exception):
                await own.release()
            await asyncio.sleep(self.config.lease_seconds / 3)
            return False
        await self._start_owned()
        self.standby_status = None
        self.standby_owner = None
        log.warning("standby: took over %s at epoch %d; serving (%.3f s after the lease lapsed)", own.store.url,
                    own.epoch, time.monotonic() - lapsed_at)
        return True

    async def _restore_keeping_the_lease(self, own: Ownership) -> None:
        """Restore while renewing the lease just taken: a restore may outlast it (a long log, a
        slow store), and a lapsed lease would let another standby take the prefix meanwhile.
        Superseded if the lease is lost before the restore is done."""
        keeper = asyncio.create_task(LeaseKeeper(own).run(), name="ds3-lease-restoring")
        restoring = asyncio.create_task(self._restore_wal(), name="ds3-restore")
        try:
            await asyncio.wait({keeper, restoring}, return_when=asyncio.FIRST_COMPLETED)
            if not restoring.done():  # the keeper stopped: the lease is lost
                restoring.cancel()
                await asyncio.gather(restoring, return_exceptions=True)
                error = keeper.exception() if not keeper.cancelled() else None
                raise error if isinstance(error, Superseded) else Superseded(
                    f"the ownership lease was lost while restoring ({error!r})", own.epoch)
            restoring.result()
        finally:
            for task in (keeper, restoring):
                task.cancel()
            await asyncio.gather(keeper, restoring, return_exceptions=True)

    def _own_store(self, objects: ObjectStore) -> ObjectStore:
        """Where this ingester's commit log, checkpoints and ownership record live: the store's
        root, or, as one of a cluster's ingesters (--ingester-id), a namespace of its own
        (`_ds3/ingesters/<id>/`: the members share the store, not their logs)."""
        if self.config.ingester_id is None:
            return objects
        return ScopedStore(objects, ingester_scope(self.config.ingester_id))

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
        if self.config.standby:
            self._open_ownership()
            self.standby_status = "standby (owner: not read yet)"
            self._standby_task = asyncio.create_task(self._stand_by(), name="ds3-standby")
            self._standby_task.add_done_callback(self._standby_done)
            return
        if self.config.store is not None:
            await self._own_and_restore()
        await self._start_owned()

    def _standby_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("standby: taking over failed; stopping", exc_info=task.exception())
        os.kill(os.getpid(), signal.SIGTERM)

    async def _start_owned(self) -> None:
        """Open the WAL and start writing (the store prefix is ours, the WAL restored)."""
        loop = asyncio.get_running_loop()
        if self.config.store is not None:
            self._open_wal()
            assert self.own_objects is not None
            self.shipper = Shipper(self.wal, self.own_objects, loop, durability=cast(Durability, self.config.durability),
                                   interval=self.config.ship_interval,
                                   checkpoint_interval=self.config.checkpoint_interval, ownership=self.ownership,
                                   uploads=self.config.log_uploads)
        self._committer = GroupCommitter(
            self.wal, loop, on_abort=self.store.reset, on_commit=self.store.flush, on_durable=self._on_durable,
            on_logged=self.shipper.on_logged if self.shipper is not None else None,
        )
        self._committer.start()
        if self.shipper is not None:
            await self.shipper.prepare(self.committer.seq)
            self.shipper.start()
            assert self.ownership is not None
            self._lease_task = asyncio.create_task(self._keep_lease(), name="ds3-lease")
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
            log.info("sealing chunks into %s (%d to upload, %d removed streams to clean)",
                     self.config.store, len(refs), len(garbage))
        if self.config.ingester_id is not None:
            await self._join_cluster(self.config.ingester_id)
        # Snapshot blobs live in the object store; with none configured, in the data dir.
        self._blobs = self.objects or LocalStore(self.config.data_dir.absolute() / "snapshots")
        self._reaper = ObjectReaper(self.store, self.committer, self._blobs)
        self._reaper.enqueue(await self.committer.submit(lambda txn: retention.pending(self.store, txn)))
        self._reaper.start()
        self._snapshots = Snapshots(
            self.store, self.committer, self.reads, self._blobs, self.chunk_reader, self.sealer, self._reaper,
            self.config.max_read_bytes,
        )
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="ds3-housekeeping"))

    async def _join_cluster(self, ingester_id: str) -> None:
        if self.config.cluster is not None:
            source: FileSource | StoreSource = FileSource(self.config.cluster)
        else:
            assert self.objects is not None  # the config insists on --store or --cluster
            source = StoreSource(self.objects)
        watcher = ClusterWatcher(source, self.config.cluster_refresh)
        await watcher.refresh()  # a failure leaves it without a description: stream requests get 503
        watcher.start()
        self.membership = Membership(ingester_id, watcher)
        self.peers = aiohttp.ClientSession()  # calls to the other ingesters (moves, forks): one per process
        self.cross_forks = CrossForks(self)
        self.cross_forks.start()
        self.moves = Mover(self)
        self.store.guard = self.moves.guard  # every write re-checks ownership on the writer thread
        watcher.on_change(self.moves.changed)
        self.moves.start()
        why = self.membership.readiness()
        log.info("cluster member %s (description from %s)%s", ingester_id, source.description,
                 f": not ready: {why}" if why else "")

    async def _keep_lease(self) -> None:
        """Renew the lease. When it is lost: stop acknowledging at once; if nobody took the
        prefix over (the record is still ours, same epoch: a store outage outlasted the lease),
        take it back once the store answers and carry on; otherwise stay fenced for good."""
        own = self.ownership
        assert own is not None
        while True:
            epoch = own.epoch
            try:
                await LeaseKeeper(own).run()
            except Superseded as e:
                self.fence(str(e), for_good=False)
            except Exception as e:  # the keeper broke: the lease runs out; stop acknowledging now
                log.exception("renewing the ownership lease failed")
                self.fence(f"renewing the lease failed: {e!r}", for_good=False)
            if not await self._regain(epoch):
                self.fence("another ingester owns the store prefix now", for_good=True)
                return

    async def _regain(self, epoch: int) -> bool:
        """Take the prefix back after our lease lapsed, if the record is still ours at `epoch`
        (so no one else owned it meanwhile, and no one else wrote its log). False if it was
        taken over, or the store's log is ahead of our WAL."""
        own, shipper = self.ownership, self.shipper
        assert own is not None and shipper is not None
        delay = 0.2
        while True:
            try:
                rec = await own.current()
                if rec is None or rec.owner_id != own.owner_id or rec.epoch != epoch:
                    return False
                await own.acquire()  # our own record: taken back with epoch + 1 (If-Match)
                await shipper.resume(self.committer.seq)  # checkpoints what the log missed meanwhile
            except (OwnedElsewhere, StoreAhead) as e:
                log.error("cannot take the store prefix back: %s", e)
                return False
            except (ObjectStoreError, TimeoutError) as e:
                log.warning("taking the store prefix back failed (%s); again in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)
                continue
            self.committer.refusal = None
            log.warning("ownership of %s taken back (epoch %d): acknowledging writes again", self.config.store,
                        own.epoch)
            return True

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
            asyncio.get_running_loop().create_task(self.sealer.stop())

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
        if self._blobs is not None and self._blobs is not self.objects:
            await self._blobs.close()
        if self._committer is not None:
            folds: list[asyncio.Future[int]] = []
            with contextlib.suppress(Exception):
                folds.append(self.committer.submit(self.store.fold_touches))
                folds.append(self.committer.submit(self.store.fold_last_writes))
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
        assert self.membership is not None
        try:
            self.membership.check_key(key)
        except Misdirected:
            await self._reread_description()
            self.membership.misdirected -= 1  # one refusal counts once (below, if it is still one)
            self.membership.check_key(key)
        if self.moves is None:
            return
        if path is None:
            await self.moves.ensure_key(key)
        elif self.moves.needs_pull(path):
            await self.moves.ensure(path)

    async def _reread_description(self) -> None:
        """Before refusing a stream with 421: re-read the description (a read every 0.25 s at
        most; requests meanwhile share the one in flight). A router that already follows a newer
        one (a change that gave us the stream) then waits for one store read, not for our next
        --cluster-refresh."""
        assert self.membership is not None
        watcher = self.membership.watcher
        now = time.monotonic()
        if watcher.refreshing or now - self._reread_at >= 0.25:
            self._reread_at = now
            await watcher.refresh()

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
            await self.sealer.published(req.path, 2.0)
        return result

    async def _sealed_sub_offset(self, source_path: str, fork_offset: str, sub: int) -> int | None:
        """A fork sub-offset into a sealed chunk of the source: resolve it with the chunk's
        index (N bytes of the append there, or N of its JSON messages). None: not sealed."""
        if self.chunk_reader is None:
            return None
        try:
            position = offsets.parse(fork_offset).position
        except offsets.OffsetSyntaxError:
            return None  # the writer answers 400
        found = await self.reads.run(self.reads.sealed_at, source_path, position)
        if found is None:
            return None
        sealed, json_stream = found
        head = await self.chunk_reader.head(sealed.uid, sealed.chunk)
        if position >= head.header.end:
            return None
        first = head.record_at(position)
        if not json_stream:
            if sub > first.end - position:
                raise BadRequest("invalid Stream-Fork-Sub-Offset: larger than the append at that offset")
            return position + sub
        count = 0
        for span in head.spans():
            if span.end <= position:
                continue
            count += 1
            if count == sub:
                return span.end
            if span.flags & FLAG_END_OF_APPEND:
                break
        raise BadRequest("invalid Stream-Fork-Sub-Offset: more messages than the append at that offset")

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
            await self.sealer.published(path, 2.0)

    # --- reads -------------------------------------------------------------------------

    async def head(self, path: str) -> StreamMeta:
        return await self.reads.head(path)

    async def read(self, path: str, start: offsets.Offset | str, *, renew: bool = True) -> ReadResult:
        res = await self.reads.read(path, start, self.config.max_read_bytes)
        if res.sealed is not None:
            await self._read_sealed(res)
        if renew and res.meta.ttl is not None:
            self.store.touches[path] = time.time()
        return res

    async def _read_sealed(self, res: ReadResult) -> None:
        """The read starts in a sealed chunk: serve that chunk's part from the object store."""
        sealed = res.sealed
        assert sealed is not None and self.chunk_reader is not None
        piece = await self.chunk_reader.slice(
            sealed.uid, sealed.chunk, sealed.start, self.config.max_read_bytes, cap=sealed.end
        )
        if is_json(res.meta.content_type) and not piece.head.is_boundary(sealed.start):
            raise BadRequest("offset is not at a message boundary of this JSON stream")
        res.messages = [await self.chunk_reader.read(piece)]
        res.end = piece.end
        res.next_offset = (
            res.meta.tail_offset if piece.end >= res.meta.tail else offsets.encode(sealed.chunk, piece.end)
        )
        res.sealed = None

    def touch(self, meta: StreamMeta) -> None:
        if meta.ttl is not None:
            self.store.touches[meta.path] = time.time()

    # --- housekeeping ------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        """Expire streams and persist TTL renewals; back off (capped) when the WAL fails."""
        tick = self.config.sweep_interval
        if self.sealer is not None:  # honour the seal age to within half of it
            tick = min(tick, self.config.seal_age / 2)
        delay = tick
        last_fold = time.monotonic()
        last_stats = (time.monotonic(), 0, 0)
        while True:
            await asyncio.sleep(delay)
            t, b, o = time.monotonic(), self.committer.batches, self.committer.ops
            if t - last_stats[0] >= 10 and o > last_stats[2]:
                log.info("wal: %.0f ops/s in %.0f commits/s (%.1f ops per commit)",
                         (o - last_stats[2]) / (t - last_stats[0]), (b - last_stats[1]) / (t - last_stats[0]),
                         (o - last_stats[2]) / max(1, b - last_stats[1]))
                last_stats = (t, b, o)
            try:
                await self._submit(self.store.sweep_expired)
                if self.sealer is not None:
                    await self._submit(self.store.seal_aged)
                if time.monotonic() - last_fold > 5:
                    await self._submit(self.store.fold_touches)
                    last_fold = time.monotonic()
                delay = tick
            except Superseded:  # not our prefix now (said once, by fence()): wait quietly
                delay = min(delay * 2, 60.0)
            except Exception:
                log.exception("housekeeping failed")
                delay = min(delay * 2, 60.0)


SERVICE: Final = web.AppKey("ingester_service", IngesterService)
