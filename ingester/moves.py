"""Moving streams when the cluster description changes (issue 15, item 4): the event loop's
side (pulls, exports, drops, the sweep); the writer operations are in ingester/move_ops.py.

A changed description gives some placement keys (a plain stream's path; a bucket with all its
streams) to another ingester. The data moves *pull on demand, pushed by a sweep*:

- **Pull.** An ingester asked about a key it owns now but does not hold, while the previous
  description (carried in the current one, shared/placement.py) gave it to another ingester,
  first asks that ingester for it (`POST /_ds3/move-out`) and waits: every request for the key,
  fast lane included (it hands such requests to aiohttp), waits on one pull per key.
- **Export.** The old owner re-reads the description if the asker's is newer, and in one writer
  operation freezes the key's streams (StreamMeta.moved_to) and reads everything a new owner
  needs (shared/moveformat.py): metadata (same uid, positions, chunk ids, closure, Stream-Seq,
  TTL, snapshot fields), the chunk manifest, producer state and the unsealed records, journal
  included. Every write runs the cluster guard on the writer thread (Store.guard): a write
  queued before the freeze is in the export, any later one gets 421, so nothing acknowledged is
  left behind. A frozen stream is exported again unchanged if asked again (a lost answer is
  retried safely); "not held" is 204.
- **Import.** The new owner writes it in one writer operation: a new local sid, everything else
  as it was; `sealing` chunks are uploaded again under the same key with the same bytes (the
  manifest keeps the old sid their headers name, ChunkInfo.header_sid). Sealed chunks stay in
  the store under the uid. Then it tells the old owner (`POST /_ds3/move-done`), which drops its
  frozen copy without touching the store (no gc of the uid).
- **Sweep.** After adopting a description (and at start, and again with backoff while anything
  is left) each ingester lists the keys it holds but no longer owns and asks each key's new
  owner to pull it (`POST /_ds3/move-in`); once that answers, it drops its copy. So idle streams
  move too, and a lost move-done is made good.

Both writer operations are ordinary committer operations, so `--durability store` logs them
and replay (ingester/replay.py) rebuilds them. What is refused rather than risked (409): a
stream already frozen for another ingester (a second change before the first one's moves were
done).

Forks move with the machinery of forks across ingesters (remote_forks.py): a fork whose source
does not move with it carries its source's chain below the fork position, and the new owner
installs it as shadows (a source that stays here gets a pin by the fork's uid, which its
refcount counted already); a source with forks carries its pins, and the forks that stay here
are rewired to a shadow of it (each with a pin the new owner now holds). A bucket moves whole,
so a source and its fork in one bucket stay a local pair. Releases then go to whoever owns the
source by the current description.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import orjson

from ingester.move_ops import bucket_of, drop_moved, freeze_export, frozen_error, import_moved
from ingester.records import (
    StreamMeta,
)
from ingester.remote_forks import is_shadow
from shared import moveformat
from shared.buckets import INTERNAL_PREFIX
from shared.cluster import cancel_and_wait
from shared.config import LMDB_MAX_KEY
from shared.errors import Conflict, DS3Error, Misdirected, Unavailable
from shared.http.auth import INTERNAL_HEADER
from shared.http.metrics import LoopHistogram
from shared.objectstore.scoped import ScopedStore, ingester_scope
from shared.ownership import read_owner
from shared.placement import Cluster, Ingester, placement_key

if TYPE_CHECKING:
    from ingester.service import IngesterService

log = logging.getLogger("ds3.moves")

MOVE_TIMEOUT: Final = 60.0  # a whole export (a key's unsealed records) in one answer
CONNECT_TIMEOUT: Final = 2.0
_TIMEOUT: Final = aiohttp.ClientTimeout(total=MOVE_TIMEOUT, connect=CONNECT_TIMEOUT)
SWEEP_CONCURRENCY: Final = 4
SWEEP_RETRY_MAX: Final = 30.0
_CACHE_MAX: Final = 1 << 20
MOVE_SECONDS_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Test-only fault injection: never send move-done (the sweep must make it good).
_LOSE_MOVE_DONE: Final = os.environ.get("DS3_TEST_LOSE_MOVE_DONE") == "1"


# --- the event loop's side -------------------------------------------------------------------


class Mover:
    """One per cluster member: pulls, exports, drops and the sweep, with their counters."""

    def __init__(self, svc: IngesterService) -> None:
        assert svc.membership is not None
        self.svc = svc
        self.membership = svc.membership
        assert svc.members is not None  # (join_cluster sets both)
        self.members = svc.members
        self.me = svc.membership.ingester_id
        token = svc.config.auth.internal_token
        self._headers = {INTERNAL_HEADER: token} if token else {}
        self._gen = 0
        self._settled: set[str] = set()  # keys owned here that need no pull under generation _gen
        self._prev_owners: dict[str, str] = {}
        self._pulls: dict[str, asyncio.Future[None]] = {}
        self._guard_owners: tuple[Cluster | None, dict[str, Ingester]] = (None, {})  # the writer thread's
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._telling: set[asyncio.Task[None]] = set()  # move-dones being sent
        self.moved_in = 0  # keys imported
        self.moved_out = 0  # keys whose frozen copies were dropped (the new owner holds them)
        self.pending_out = 0  # keys held here that another ingester owns, as of the last sweep
        self.retired_at: int | None = None  # left out of this generation, and holding nothing: may stop
        self._retired: set[str] = set()  # previous owners that said they hold nothing (generation _gen)
        self.pulling = 0
        self.failures = 0
        self.last_error: str | None = None
        self.move_seconds = LoopHistogram(
            "ds3_cluster_move_seconds", "Time a moved-in key's first request waited: asking the old owner, "
            "its export, the import (the longest pause a write to a moving stream sees).", MOVE_SECONDS_BUCKETS,
        )

    # --- lifecycle ---

    def start(self) -> None:
        self._task = asyncio.create_task(self._sweep_loop(), name="ds3-move-sweep")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for telling in list(self._telling):  # the holder's sweep asks again
            await cancel_and_wait(telling)

    def changed(self, _old: Cluster | None, _new: Cluster) -> None:
        """A description was adopted: sweep now."""
        self._wake.set()

    # --- the guard (writer thread) ---

    def guard(self, path: str, meta: StreamMeta | None) -> None:
        """Store.guard: Misdirected unless this ingester owns `path` under the description current
        *now*, and the stream is not frozen. Writer thread only, so its owner cache is its own
        (Membership's belongs to the event loop: shared, a lookup racing a description change
        could cache an owner of the old description under the new one)."""
        cluster = self.membership.cluster
        if cluster is None:
            self.membership.check(path)  # Unavailable, with the watcher's reason
            return
        cached_for, owners = self._guard_owners
        if cached_for is not cluster or len(owners) >= _CACHE_MAX:
            owners = {}
            self._guard_owners = (cluster, owners)
        key = placement_key(path)
        owner = owners.get(key)
        if owner is None:
            owner = owners[key] = cluster.owner_of_key(key)
        if owner.id != self.me:
            raise Misdirected(owner.id, owner.url, cluster.generation, self.me)
        if meta is not None and meta.moved_to is not None:
            raise frozen_error(meta)

    # --- pulling (the new owner) ---

    def _cluster(self) -> Cluster | None:
        cluster = self.membership.cluster
        if cluster is not None and cluster.generation != self._gen:
            self._gen, self._settled, self._prev_owners, self._retired = cluster.generation, set(), {}, set()
        return cluster

    def _holds(self, key: str) -> bool:
        """Whether this WAL holds the key (a frozen copy does not count)."""
        wal = self.svc.wal
        with wal.env.begin(buffers=False) as txn:
            bucket_id = bucket_of(key)
            if bucket_id is not None:
                return txn.get(bucket_id.encode(), db=wal.buckets) is not None
            k = key.encode("utf-8", "surrogatepass")
            if not 0 < len(k) <= LMDB_MAX_KEY:  # names no stream (LMDB would refuse to look)
                return False
            raw = txn.get(k, db=wal.streams)
            return raw is not None and StreamMeta.decode(raw).moved_to is None

    def _previous_owner(self, cluster: Cluster, key: str) -> Ingester | None:
        """The key's owner under the previous description, when that is another ingester and this
        one owns it now; None when nothing can be moving in."""
        previous = cluster.previous
        if previous is None:
            return None
        owner_id = self._prev_owners.get(key)
        if owner_id is None:
            if len(self._prev_owners) >= _CACHE_MAX:
                self._prev_owners = {}
            owner_id = self._prev_owners[key] = previous.owner_of_key(key).id
        if owner_id == self.me or cluster.owner_of_key(key).id != self.me:
            return None
        return previous.get(owner_id)

    def needs_pull(self, path: str) -> bool:
        """Sync and cheap (the fast lane asks for every append): whether a request for `path`
        must wait for a pull first."""
        return self._needs_pull_key(placement_key(path))

    def _needs_pull_key(self, key: str) -> bool:
        cluster = self._cluster()
        if cluster is None or cluster.previous is None or key in self._settled:
            return False
        if self._previous_owner(cluster, key) is None or self._holds(key):
            self._settle(key)
            return False
        return True

    def _settle(self, key: str) -> None:
        if len(self._settled) >= _CACHE_MAX:
            self._settled = set()
        self._settled.add(key)

    async def ensure(self, path: str) -> None:
        await self.ensure_key(placement_key(path))

    async def ensure_key(self, key: str) -> None:
        """Return once this ingester holds `key` or knows there is nothing to move; raises
        Unavailable (503) while the old owner cannot hand it over, Conflict (409) if it refuses."""
        if not self._needs_pull_key(key):
            return
        fut = self._pulls.get(key)
        if fut is None:
            fut = self._pulls[key] = asyncio.ensure_future(self._pull(key))
            fut.add_done_callback(functools.partial(self._pull_done, key))
        await asyncio.shield(fut)

    def _pull_done(self, key: str, fut: asyncio.Future[None]) -> None:
        if self._pulls.get(key) is fut:
            del self._pulls[key]
        if not fut.cancelled() and fut.exception() is not None:
            fut.exception()  # retrieved: each waiter re-raises it

    async def _post(self, peer: Ingester, endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """POST to cluster member `peer`: at the description's URL or, once that failed (or did
        not answer for a second), where a standby of it runs (shared/owner_watch.py). A
        connection error is raised as it is."""
        peers = self.svc.peers
        assert peers is not None

        async def send(url: str) -> tuple[int, bytes]:
            async with peers.post(url.rstrip("/") + endpoint, data=orjson.dumps(body), timeout=_TIMEOUT,
                                  headers={**self._headers, "Content-Type": "application/json"}) as r:
                return r.status, await r.read()

        try:
            return await self.members.call(peer.id, peer.url, send)
        except (aiohttp.ClientConnectionError, TimeoutError, OSError):
            self.members.failed(peer.id)
            raise

    def url_of(self, peer: Ingester) -> str:
        return self.members.url(peer.id, peer.url).rstrip("/")

    async def take_from(self, key: str, holder: Ingester) -> None:
        """The sweep of `holder` offers `key`, which this ingester owns: once it holds it (the
        usual pull from the previous owner), or, if that found nothing, straight from `holder`
        (a holder from before the previous description: a second change overtook the move)."""
        await self.ensure_key(key)
        if holder.id != self.me and not self._holds(key):
            fut = self._pulls.get(key)
            if fut is None:
                fut = self._pulls[key] = asyncio.ensure_future(self._pull(key, holder))
                fut.add_done_callback(functools.partial(self._pull_done, key))
            await asyncio.shield(fut)

    async def _pull(self, key: str, source: Ingester | None = None) -> None:
        cluster = self._cluster()
        assert cluster is not None
        source = source or self._previous_owner(cluster, key)
        if source is None:
            return
        if source.id in self._retired:  # it said it holds nothing: nothing to move
            self._settle(key)
            return
        started = time.perf_counter()
        self.pulling += 1
        try:
            status, body = await self._post(source, "/_ds3/move-out",
                                            {"key": key, "generation": cluster.generation, "to": self.me})
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            if await self._has_retired(source, cluster):
                self._settle(key)
                return
            self._failed(f"ingester {source.id} at {self.url_of(source)} does not answer: {e!r}")
            raise Unavailable(f"this stream is moving here from ingester {source.id} at {self.url_of(source)}, which does "
                              f"not answer ({type(e).__name__}); retry shortly", retry_after=1) from None
        finally:
            self.pulling -= 1
        if status == 204:  # it never held the key: nothing to move
            self._settle(key)
            return
        if status != 200:
            message = _message(body)
            self._failed(f"moving {key!r} from {source.id}: {status} {message}")
            if status == 409:
                raise Conflict(f"this stream cannot move here from ingester {source.id}: {message}")
            if status == 421:
                with contextlib.suppress(Exception):
                    await self.membership.watcher.refresh()
            raise Unavailable(f"this stream is moving here from ingester {source.id}, which answered {status} "
                              f"({message}); retry shortly", retry_after=1)
        try:
            export = moveformat.decode(body)
        except moveformat.MoveFormatError as e:
            self._failed(f"moving {key!r} from {source.id}: {e}")
            raise Unavailable(f"this stream is moving here from ingester {source.id}: {e}", retry_after=1) from None
        n = await self.svc.committer.submit(functools.partial(import_moved, self.svc.store, export=export))
        self._settle(key)
        self.moved_in += 1
        took = time.perf_counter() - started
        self.move_seconds.observe(took)
        log.info("moved in %r from %s (%d streams, %d bytes of unsealed records) in %.3f s", key, source.id, n,
                 export.record_bytes, took)
        if not _LOSE_MOVE_DONE:
            task = asyncio.get_running_loop().create_task(self._done(source, key, cluster.generation))
            self._telling.add(task)  # (cancelled at stop: the peers' session closes then)
            task.add_done_callback(self._told)

    def _told(self, task: asyncio.Task[None]) -> None:
        self._telling.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            # A move that finished as the ingester stopped (its peers' session closed under the
            # move-done, before stop() could cancel it): retrieved here, or asyncio logs it as
            # an ERROR with its traceback ("Task exception was never retrieved").
            log.info("move-done not sent: %r", e)

    async def _done(self, source: Ingester, key: str, generation: int) -> None:
        """Tell the old owner to drop its frozen copy (best effort: its sweep asks again)."""
        for delay in (0.0, 0.5, 2.0):
            await asyncio.sleep(delay)
            try:
                status, body = await self._post(source, "/_ds3/move-done",
                                                {"key": key, "generation": generation, "to": self.me})
                if status == 204:
                    return
                log.warning("move-done of %r to %s: %d %s", key, source.id, status, _message(body))
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                log.warning("move-done of %r to %s failed: %r", key, source.id, e)

    async def _has_retired(self, source: Ingester, cluster: Cluster) -> bool:
        """Whether `source`, out of the current description, recorded that it holds nothing under
        it (so it may have been stopped: shared/cluster.py)."""
        if cluster.get(source.id) is not None:
            return False
        try:
            at = await self.membership.watcher.source.retired_at(source.id)
        except Exception as e:  # an unreadable record: as if there were none (503, retried)
            log.warning("cannot read whether ingester %s retired: %r", source.id, e)
            return False
        if at != cluster.generation and not await self._never_ran(source):
            return False
        if self._gen == cluster.generation:
            self._retired.add(source.id)
        return True

    async def _never_ran(self, source: Ingester) -> bool:
        """Whether `source` never owned its namespace (no ownership record): added and removed
        again before it ever ran, it holds nothing. Found by QA: the keys placed on it answered
        503 ("moving here from ...") until the next change of the description."""
        objects = self.svc.objects
        if objects is None:
            return False
        try:
            return await read_owner(ScopedStore(objects, ingester_scope(source.id))) is None
        except Exception as e:  # unreadable: as if it had run (503, retried)
            log.warning("cannot read whether ingester %s ever ran: %r", source.id, e)
            return False

    def _failed(self, why: str) -> None:
        self.failures += 1
        self.last_error = why
        log.warning("move: %s", why)

    # --- the old owner ---

    async def _current_at_least(self, generation: int) -> Cluster:
        watcher = self.membership.watcher
        await watcher.refresh_if_older(generation)
        cluster = watcher.current
        if cluster is None or cluster.generation < generation:
            raise Unavailable(f"ingester {self.me} cannot read cluster description generation {generation} yet "
                              f"({watcher.error or 'not published?'})", retry_after=1)
        return cluster

    async def export(self, key: str, generation: int, to: str) -> bytes | None:
        """Freeze and export `key` for ingester `to`; None when it is not held here."""
        cluster = await self._current_at_least(generation)
        owner = cluster.owner_of_key(key)
        if owner.id != to:  # the asker is not the owner (any more): it must re-read the description
            raise Misdirected(owner.id, owner.url, cluster.generation, to)
        export = await self.svc.committer.submit(functools.partial(
            freeze_export, self.svc.store, key=key, to=owner, generation=cluster.generation, me=self.me))
        if export is None:
            return None
        # Encoding a big export takes a while: off the event loop.
        return await asyncio.get_running_loop().run_in_executor(None, moveformat.encode, export)

    async def drop(self, key: str, generation: int) -> int:
        """The new owner holds `key`: drop what is frozen here."""
        cluster = await self._current_at_least(generation)
        owned = cluster.owner_of_key(key).id == self.me
        dropped = await self.svc.committer.submit(functools.partial(
            drop_moved, self.svc.store, key=key, owned_here=owned))
        if dropped:
            self.moved_out += 1
            log.info("moved out %r (%d streams): the new owner holds it", key, dropped)
        return int(dropped)

    # --- the sweep ---

    def _held_elsewhere(self, cluster: Cluster) -> list[str]:
        """Keys this WAL holds (frozen copies included) that another ingester owns (read thread)."""
        wal = self.svc.wal
        keys: set[str] = set()
        with wal.env.begin(buffers=False) as txn:
            for k in txn.cursor(db=wal.streams).iternext(keys=True, values=False):
                path = bytes(k).decode("utf-8", "surrogatepass")
                if not is_shadow(path):  # another ingester's stream, read by forks here: never moved
                    keys.add(placement_key(path))
            for k in txn.cursor(db=wal.buckets).iternext(keys=True, values=False):
                keys.add(f"{INTERNAL_PREFIX}{bytes(k).decode()}/")
        return sorted(k for k in keys if cluster.owner_of_key(k).id != self.me)

    async def _sweep_loop(self) -> None:
        delay, retry = 0.0, 1.0  # at once at start: a restart may have moves left
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()
            try:
                left = await self.sweep()
            except Exception as e:  # never let the loop die
                self._failed(f"sweep failed: {e!r}")
                left = 1
            if left == 0:  # a new description wakes it; the hourly pass is a safety net
                delay, retry = 3600.0, 1.0
            else:
                delay, retry = retry, min(SWEEP_RETRY_MAX, retry * 2)

    async def sweep(self) -> int:
        """Hand every key held here that another ingester owns to that owner; how many are left."""
        cluster = self.membership.cluster
        if cluster is None:
            return 0
        keys = await self.svc.reads.run(self._held_elsewhere, cluster)
        self.pending_out = len(keys)
        if not keys:
            await self._retire_if_left_out(cluster)
            return 0
        log.info("moving %d keys out to their new owners (generation %d)", len(keys), cluster.generation)
        limit = asyncio.Semaphore(SWEEP_CONCURRENCY)
        unreachable: dict[str, str] = {}  # owner id -> why it did not answer: one line each
        waiting: Counter[str] = Counter()  # of those, keys left for the next sweep

        async def one(key: str) -> None:
            async with limit:
                owner = cluster.owner_of_key(key)
                if owner.id in unreachable:  # (it did not answer this sweep: the next one asks again)
                    waiting[owner.id] += 1
                    return
                try:
                    status, body = await self._post(owner, "/_ds3/move-in", {
                        "key": key, "generation": cluster.generation, "from": self.me,
                        # where to pull from when the owner's description no longer knows us
                        "from_url": self._my_url(cluster)})
                except (aiohttp.ClientError, TimeoutError, OSError) as e:
                    unreachable[owner.id] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                    waiting[owner.id] += 1
                    return
                if status != 204:
                    self._failed(f"asking {owner.id} to take {key!r}: {status} {_message(body)}")
                    return
                try:
                    await self.drop(key, cluster.generation)
                except DS3Error as e:
                    self._failed(f"dropping {key!r} after its move: {e}")
                    return
                self.pending_out -= 1

        await asyncio.gather(*(one(k) for k in keys))
        for owner_id, why in sorted(unreachable.items()):
            owner = cluster.get(owner_id)
            self._failed(f"ingester {owner_id} at {self.url_of(owner) if owner else '?'} does not answer ({why[:200]}): "
                         f"{waiting[owner_id]} keys wait for the next sweep")
        if self.pending_out == 0:
            self.last_error = None  # everything handed over: what failed before is done
            await self._retire_if_left_out(cluster)
        return self.pending_out

    def _my_url(self, cluster: Cluster) -> str:
        me = cluster.get(self.me) or (cluster.previous.get(self.me) if cluster.previous is not None else None)
        return me.url if me is not None else self.svc.config.advertised

    async def _retire_if_left_out(self, cluster: Cluster) -> None:
        """Left out of `cluster` and holding nothing: say so where the description lives, so the
        new owners stop asking for keys this ingester never held, and it can be stopped."""
        if cluster.get(self.me) is not None:
            self.retired_at = None  # (taken back into the cluster)
            return
        if self.retired_at == cluster.generation:
            return
        was_member = cluster.previous is not None and cluster.previous.get(self.me) is not None
        if not was_member and self.moved_out == 0:
            return  # never held anything here (started before being added): nothing to retire from
        await self.membership.watcher.source.retire(self.me, cluster.generation)
        self.retired_at = cluster.generation
        log.info("ingester %s is not in cluster description generation %d and has handed over everything it "
                 "held: it may be stopped", self.me, cluster.generation)

    def status(self) -> dict[str, object]:
        return {"pending_out": self.pending_out, "moved_in": self.moved_in, "moved_out": self.moved_out,
                "pulling": self.pulling, "failures": self.failures, "last_error": self.last_error,
                "retired_at": self.retired_at}


def _message(body: bytes) -> str:
    return body[:300].decode("utf-8", "replace").strip()
