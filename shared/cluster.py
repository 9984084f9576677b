"""Where the cluster description lives, and watching it (issue 15). No aiohttp.

The description (shared.placement.Cluster) is one object in the store every process of a
deployment already reads: keys.CLUSTER_KEY (`_ds3/cluster.json` below the store prefix). It is
only ever written conditionally, like the ownership record: `ds3 cluster set` reads it with its
ETag, writes generation + 1 with If-Match (If-None-Match: * for the first), and of two admins
racing exactly one wins; the other gets ClusterChanged and changes nothing. For `ds3 dev` and
tests a JSON file in the same format can stand in for the store (`--cluster FILE`).

ClusterWatcher re-reads its source every `interval` seconds and exposes the newest description
it has seen (`current`). It only moves forward: a description is adopted when its generation is
higher than the current one. One with the same generation but other contents, or a lower one,
is refused with a logged error (a change must bump the generation, or processes could disagree
about the same generation); an unreadable one, or a store that does not answer, keeps the
current description and says why in `error` (a read that takes over `timeout` seconds fails).
Time is injectable (`sleep`), and `refresh()` is one step, so tests drive it; concurrent
refreshes share one read, and `refresh_if_older(generation)` re-reads at once when someone
(a 421's DS3-Cluster-Generation) shows a newer generation exists.

An ingester left out of the description hands its keys over (ingester/moves.py) and then
records that it holds nothing (`ClusterSource.retire`: `_ds3/cluster-retired/<id>.json`, or a
file beside the `--cluster` file), so the new owners stop asking it once it is stopped.

Membership is an ingester's view: its own id and the watcher; `check(path)` raises Misdirected
(421, naming the owner) for a stream another ingester owns, or Unavailable (503) while no
description has been read yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import orjson

from shared import keys
from shared.errors import (
    ClusterChanged,
    Misdirected,
    ObjectNotFound,
    ObjectStoreError,
    PreconditionFailed,
    Unavailable,
)
from shared.localfile import write_durably
from shared.objectstore.base import ObjectStore
from shared.placement import Cluster, Ingester, PlacementError, placement_key

log = logging.getLogger("ds3.cluster")

DEFAULT_INTERVAL: Final = 5.0
DEFAULT_READ_TIMEOUT: Final = 10.0  # a read that takes longer counts as failed (the last description stays)
_CACHE_MAX: Final = 65_536  # owners remembered per description (placement keys -> owner)


async def cancel_and_wait(task: asyncio.Task[None] | None) -> None:
    """Stop a background loop (the watcher's, the ingester's move sweep): cancel it and return
    once it has ended. None: there is none."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- the stored description ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredCluster:
    cluster: Cluster
    etag: str  # of the version read: what an update passes as If-Match


def _decode(data: bytes, where: str) -> Cluster:
    try:
        return Cluster.decode(data)
    except PlacementError as e:
        raise ObjectStoreError(f"cluster description {where} is invalid: {e}") from None


async def read_cluster(store: ObjectStore, key: str = keys.CLUSTER_KEY) -> StoredCluster | None:
    """The description in the store with its ETag; None when there is none. An invalid one
    raises ObjectStoreError naming the key (it is never overwritten blindly)."""
    try:
        data, etag = await store.get_with_etag(key)
    except ObjectNotFound:
        return None
    return StoredCluster(_decode(data, key), etag)


async def write_cluster(store: ObjectStore, cluster: Cluster, *, if_match: str | None,
                        key: str = keys.CLUSTER_KEY) -> str:
    """Write `cluster` over the version whose ETag is `if_match` (None: only if there is no
    description yet); returns the new ETag. ClusterChanged if another version is there."""
    data = cluster.encode()
    try:
        if if_match is None:
            return await store.put(key, data, content_type="application/json", if_absent=True)
        return await store.put(key, data, content_type="application/json", if_match=if_match)
    except PreconditionFailed:
        # Lost, or won with its answer lost and retried by the client (base.ObjectStore.put):
        # what is there now decides.
        now = await read_cluster(store, key)
        if now is not None and now.cluster == cluster:
            return now.etag
        gen = now.cluster.generation if now is not None else 0
        raise ClusterChanged(
            f"the cluster description changed while it was being updated (now generation {gen}"
            f"{'' if now is not None else ', deleted'}): read it again and retry", gen,
        ) from None


async def set_cluster(store: ObjectStore, ingesters: Iterable[tuple[str, str]] | Mapping[str, str], *,
                      expected_generation: int | None = None, key: str = keys.CLUSTER_KEY) -> Cluster:
    """Replace the ingester list: the next generation, written with If-Match on the version
    read (If-None-Match: * for the first, generation 1). `expected_generation`: refuse unless
    the current one is that (0: none yet), so an admin changes what they looked at."""
    pairs = list(ingesters.items()) if isinstance(ingesters, Mapping) else list(ingesters)
    now = await read_cluster(store, key)
    gen = now.cluster.generation if now is not None else 0
    if expected_generation is not None and expected_generation != gen:
        raise ClusterChanged(f"the cluster description is at generation {gen}, not {expected_generation}", gen)
    wanted = Cluster.of(pairs, gen + 1)
    if now is not None and set(wanted.ingesters) == set(now.cluster.ingesters):
        # The same list again (a retry, a config tool run twice): nothing to write. A new
        # generation would name this list as its previous one, and streams still moving under
        # the current one would not find their old owner for a while (404s; found by QA).
        return now.cluster
    # The new description carries the one it replaces: a stream's new owner asks the previous
    # owner for it (ingester/moves.py), even if it never saw that description itself.
    if now is None and key == keys.CLUSTER_KEY:  # (a single ingester's prefix: shared/adoption.py)
        from shared.adoption import first_description

        new = await first_description(store, wanted, pairs[0][0])
    else:
        new = Cluster(gen + 1, wanted.ingesters, previous=now.cluster.alone() if now is not None else None)
    await write_cluster(store, new, if_match=now.etag if now is not None else None, key=key)
    return new


# --- sources and the watcher --------------------------------------------------------------


class ClusterSource(Protocol):
    description: str  # where it is read from, for messages

    async def load(self) -> Cluster | None:
        """The description now; None when there is none (yet). Raises when it cannot be read
        or is invalid (the message says which)."""

    async def retire(self, ingester_id: str, generation: int) -> None:
        """Record that `ingester_id`, left out of description `generation`, holds nothing any
        more (its sweep handed every key over)."""

    async def retired_at(self, ingester_id: str) -> int | None:
        """The generation `ingester_id` last retired at (None: never, or unreadable)."""


# A removed ingester keeps running until its sweep has handed every key over; then it says so
# here and may be stopped. The new owners need to know: a key placed on it by the previous
# description and not held by its new owner (a stream that never existed, or was deleted) is
# asked of the old owner first, and a stopped one cannot answer "not held". Without this
# record, such requests answered 503 until the next description change (after removing the
# third of three ingesters, 1 in 3 new streams could not be created).


def _marker(ingester_id: str, generation: int) -> bytes:
    return orjson.dumps({"ingester": ingester_id, "generation": generation})


def _marker_generation(data: bytes, ingester_id: str) -> int | None:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("ingester") != ingester_id:
        return None
    gen = doc.get("generation")
    return gen if isinstance(gen, int) and not isinstance(gen, bool) else None


class StoreSource:
    def __init__(self, store: ObjectStore, key: str = keys.CLUSTER_KEY) -> None:
        self.store = store
        self.key = key
        self.description = f"{store.url} {key}"

    async def load(self) -> Cluster | None:
        found = await read_cluster(self.store, self.key)
        return None if found is None else found.cluster

    async def retire(self, ingester_id: str, generation: int) -> None:
        await self.store.put(f"{keys.CLUSTER_RETIRED_PREFIX}{ingester_id}.json", _marker(ingester_id, generation),
                             content_type="application/json")

    async def retired_at(self, ingester_id: str) -> int | None:
        try:
            data = await self.store.get(f"{keys.CLUSTER_RETIRED_PREFIX}{ingester_id}.json")
        except ObjectStoreError:  # NotFound included: not retired, as far as anyone can tell
            return None
        return _marker_generation(data, ingester_id)


class FileSource:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = str(path)

    async def load(self) -> Cluster | None:
        return load_cluster_file(self.path)

    async def retire(self, ingester_id: str, generation: int) -> None:
        await asyncio.to_thread(write_durably, _marker_path(self.path, ingester_id), _marker(ingester_id, generation))

    async def retired_at(self, ingester_id: str) -> int | None:
        return await asyncio.to_thread(file_retired_at, self.path, ingester_id)


def _marker_path(cluster_file: Path, ingester_id: str) -> Path:
    return cluster_file.with_name(f"{cluster_file.name}.retired-{ingester_id}")


def file_retired_at(cluster_file: Path, ingester_id: str) -> int | None:
    """FileSource.retired_at without an event loop (`ds3 dev` waits on it)."""
    try:
        data = _marker_path(cluster_file, ingester_id).read_bytes()
    except OSError:
        return None
    return _marker_generation(data, ingester_id)


def load_cluster_file(path: Path) -> Cluster:
    """A description from a JSON file (the stored format); PlacementError names the file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PlacementError(f"cluster file {path}: {e.strerror or e}") from None
    try:
        return Cluster.decode(data)
    except PlacementError as e:
        raise PlacementError(f"cluster file {path}: {e}") from None


Sleep = Callable[[float], Awaitable[None]]


class ClusterWatcher:
    """The newest cluster description of a source, re-read every `interval` seconds."""

    def __init__(self, source: ClusterSource, interval: float = DEFAULT_INTERVAL, *,
                 sleep: Sleep = asyncio.sleep, timeout: float = DEFAULT_READ_TIMEOUT,
                 optional: bool = False) -> None:
        self.source = source
        # optional: having no description is a normal state (a reader in front of one ingester),
        # not an error to log
        self.optional = optional
        self.interval = interval
        self.timeout = timeout
        self.current: Cluster | None = None
        self.error: str | None = None  # why the last read failed or was refused; None when fine
        self.reads = 0
        self.failures = 0
        self.changes = 0  # descriptions adopted (the first included)
        self._sleep = sleep
        self._listeners: list[Callable[[Cluster | None, Cluster], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._reading: asyncio.Future[bool] | None = None

    def on_change(self, listener: Callable[[Cluster | None, Cluster], None]) -> None:
        """`listener(old, new)` after a description is adopted (on the event loop)."""
        self._listeners.append(listener)

    async def refresh(self) -> bool:
        """Read the source once; True when a newer description was adopted. Concurrent calls
        share one read."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._refresh())
            self._reading.add_done_callback(self._read_done)
        return await asyncio.shield(self._reading)

    @property
    def refreshing(self) -> bool:
        """A read is in flight (a refresh() now shares it)."""
        return self._reading is not None

    def _read_done(self, fut: asyncio.Future[bool]) -> None:
        if self._reading is fut:
            self._reading = None

    async def refresh_if_older(self, generation: int) -> bool:
        """Re-read now if the current description is older than `generation` (e.g. a 421's
        DS3-Cluster-Generation); True when a newer one was adopted."""
        current = self.current
        if current is not None and current.generation >= generation:
            return False
        return await self.refresh()

    async def _refresh(self) -> bool:
        self.reads += 1
        try:
            async with asyncio.timeout(self.timeout):
                found = await self.source.load()
        except (PlacementError, ObjectStoreError, OSError, TimeoutError) as e:
            self.failures += 1
            if isinstance(e, TimeoutError):
                message = f"no answer within {self.timeout:g} s"
            else:
                message = e.message if isinstance(e, ObjectStoreError) else str(e)
            self._fail(f"cannot read the cluster description from {self.source.description}: {message}")
            return False
        if found is None:
            if self.optional and self.current is None:
                self.error = None
                return False
            self._fail(f"there is no cluster description in {self.source.description} yet "
                       "(write one with `ds3 cluster set`)")
            return False
        old = self.current
        if old is not None and found.generation <= old.generation:
            if found == old:
                self.error = None
            elif found.generation == old.generation:
                self._fail(f"the cluster description in {self.source.description} changed without a new "
                           f"generation ({found.generation}): ignored; every change must raise the generation")
            else:
                self._fail(f"the cluster description in {self.source.description} went back to generation "
                           f"{found.generation} (this process has {old.generation}): ignored")
            return False
        self.current = found
        self.error = None
        self.changes += 1
        log.info("cluster description generation %d: %s", found.generation,
                 ", ".join(i.describe() for i in found.ingesters))
        for listener in self._listeners:
            try:
                listener(old, found)
            except Exception:
                log.exception("cluster change listener failed")
        return True

    def _fail(self, why: str) -> None:
        if why != self.error:  # once per distinct problem, not every interval
            log.warning("%s", why)
        self.error = why

    async def run(self) -> None:
        while True:
            await self._sleep(self.interval)
            await self.refresh()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="ds3-cluster-watcher")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)


class Membership:
    """An ingester's side of placement: which streams are its own under the current
    description of `watcher`."""

    def __init__(self, ingester_id: str, watcher: ClusterWatcher) -> None:
        self.ingester_id = ingester_id
        self.watcher = watcher
        self.misdirected = 0  # requests refused with 421
        self._cached_for: Cluster | None = None
        self._owners: dict[str, Ingester] = {}

    @property
    def cluster(self) -> Cluster | None:
        return self.watcher.current

    @property
    def me(self) -> Ingester | None:
        c = self.watcher.current
        return None if c is None else c.get(self.ingester_id)

    def owner_of_key(self, key: str) -> Ingester:
        cluster = self.watcher.current
        if cluster is None:
            raise Unavailable(f"this ingester ({self.ingester_id}) has not read the cluster description yet: "
                              f"{self.watcher.error or 'starting'}", retry_after=max(1, round(self.watcher.interval)))
        if cluster is not self._cached_for or len(self._owners) >= _CACHE_MAX:
            self._cached_for, self._owners = cluster, {}
        owner = self._owners.get(key)
        if owner is None:
            owner = self._owners[key] = cluster.owner_of_key(key)
        return owner

    def check_key(self, key: str) -> None:
        owner = self.owner_of_key(key)
        if owner.id != self.ingester_id:
            self.misdirected += 1
            cluster = self.watcher.current
            assert cluster is not None
            raise Misdirected(owner.id, owner.url, cluster.generation, self.ingester_id)

    def check(self, path: str) -> None:
        """Misdirected (421) unless this ingester owns the stream with internal path `path`;
        Unavailable (503) while it has no description."""
        self.check_key(placement_key(path))

    def owns(self, path: str) -> bool:
        try:
            return self.owner_of_key(placement_key(path)).id == self.ingester_id
        except Unavailable:
            return False

    def readiness(self) -> str | None:
        """Why this ingester should get no traffic (None: it is a member of the cluster)."""
        cluster = self.watcher.current
        if cluster is None:
            return self.watcher.error or "no cluster description read yet"
        if cluster.get(self.ingester_id) is None:
            return (f"ingester id {self.ingester_id} is not in the cluster description (generation "
                    f"{cluster.generation}: {', '.join(cluster.ids)}): it owns no stream")
        return None
