"""shared/cluster.py: the cluster description in the store (conditional writes), the file
source, the watcher (driven step by step) and an ingester's Membership."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared import keys
from shared.cluster import (
    ClusterWatcher,
    FileSource,
    Membership,
    StoreSource,
    load_cluster_file,
    read_cluster,
    set_cluster,
    write_cluster,
)
from shared.errors import ClusterChanged, Misdirected, ObjectStoreError, Unavailable
from shared.http.handlers import error_response
from shared.objectstore import LocalStore
from shared.placement import Cluster, PlacementError

AB = {"a": "http://127.0.0.1:1001", "b": "http://127.0.0.1:1002"}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LocalStore]:
    s = LocalStore(tmp_path / "objects")
    yield s
    await s.close()


async def test_set_and_read(store: LocalStore) -> None:
    assert await read_cluster(store) is None
    first = await set_cluster(store, AB)
    assert first.generation == 1 and first.ids == ("a", "b")
    found = await read_cluster(store)
    assert found is not None and found.cluster == first and found.etag
    assert json.loads(await store.get(keys.CLUSTER_KEY))["ingesters"][0] == {"id": "a", "url": "http://127.0.0.1:1001"}
    second = await set_cluster(store, {**AB, "c": "http://127.0.0.1:1003"}, expected_generation=1)
    assert second.generation == 2 and second.ids == ("a", "b", "c")
    with pytest.raises(ClusterChanged, match="at generation 2, not 1"):
        await set_cluster(store, AB, expected_generation=1)
    assert (await read_cluster(store)).cluster == second  # type: ignore[union-attr]


async def test_the_same_list_again_writes_nothing(store: LocalStore) -> None:
    """A retry, or a config tool run twice: no new generation (it would name the same list as
    its previous one, and streams still moving would 404 until they found their old owner)."""
    await set_cluster(store, AB)
    second = await set_cluster(store, {**AB, "c": "http://127.0.0.1:1003"})
    before = await read_cluster(store)
    assert before is not None
    again = await set_cluster(store, {"c": "http://127.0.0.1:1003", **AB})  # (any order)
    assert again == second and again.generation == 2 and again.previous is not None
    after = await read_cluster(store)
    assert after is not None and after.etag == before.etag
    # a changed URL is a change
    moved = await set_cluster(store, {**AB, "c": "http://127.0.0.1:2003"})
    assert moved.generation == 3


async def test_two_admins_cannot_clobber_each_other(store: LocalStore) -> None:
    await set_cluster(store, AB)
    seen = await read_cluster(store)
    assert seen is not None
    mine = seen.cluster.with_ingesters({**AB, "c": "http://127.0.0.1:1003"})
    theirs = seen.cluster.with_ingesters({**AB, "d": "http://127.0.0.1:1004"})
    await write_cluster(store, theirs, if_match=seen.etag)
    with pytest.raises(ClusterChanged, match="changed while it was being updated") as e:
        await write_cluster(store, mine, if_match=seen.etag)
    assert e.value.current_generation == 2
    assert (await read_cluster(store)).cluster == theirs  # type: ignore[union-attr]
    # the first write of all is If-None-Match: *
    with pytest.raises(ClusterChanged):
        await write_cluster(store, Cluster.of(AB), if_match=None)


async def test_concurrent_sets_one_wins(store: LocalStore) -> None:
    await set_cluster(store, AB)
    results = await asyncio.gather(
        *(set_cluster(store, {**AB, f"n{i}": f"http://127.0.0.1:{2000 + i}"}, expected_generation=1)
          for i in range(4)),
        return_exceptions=True,
    )
    won = [r for r in results if isinstance(r, Cluster)]
    assert len(won) == 1 and all(isinstance(r, ClusterChanged) for r in results if r not in won)
    assert (await read_cluster(store)).cluster == won[0]  # type: ignore[union-attr]


async def test_invalid_stored_description(store: LocalStore) -> None:
    await store.put(keys.CLUSTER_KEY, b'{"generation": 1, "ingesters": []}')
    with pytest.raises(ObjectStoreError, match=r"_ds3/cluster\.json is invalid: the cluster has no ingesters"):
        await read_cluster(store)


def test_cluster_file(tmp_path: Path) -> None:
    f = tmp_path / "cluster.json"
    f.write_bytes(Cluster.of(AB, 3).encode())
    assert load_cluster_file(f) == Cluster.of(AB, 3)
    f.write_text('{"generation": 1, "ingesters": [{"id": "a", "url": "http://h:1"}, {"id": "a", "url": "http://h:2"}]}')
    with pytest.raises(PlacementError, match=f"cluster file {f}: ingester id 'a' appears more than once"):
        load_cluster_file(f)
    with pytest.raises(PlacementError, match="No such file"):
        load_cluster_file(tmp_path / "missing.json")


@pytest.mark.parametrize("kind", ["store", "file"])
async def test_a_retired_ingester_is_recorded_where_the_description_lives(
        store: LocalStore, tmp_path: Path, kind: str) -> None:
    """An ingester out of the description, holding nothing, records the generation; the new
    owners read it (ingester/moves.py) instead of waiting on a stopped ingester."""
    source = StoreSource(store) if kind == "store" else FileSource(tmp_path / "cluster.json")
    assert await source.retired_at("c") is None
    await source.retire("c", 4)
    assert await source.retired_at("c") == 4 and await source.retired_at("b") is None
    await source.retire("c", 5)  # removed again later
    assert await source.retired_at("c") == 5
    # a record that is not c's, or not a record, says nothing
    garbage = [b"{not json", b'{"ingester": "b", "generation": 5}', b'{"ingester": "c", "generation": true}']
    for data in garbage:
        if isinstance(source, StoreSource):
            await store.put(f"{keys.CLUSTER_RETIRED_PREFIX}c.json", data)
        else:
            (tmp_path / "cluster.json.retired-c").write_bytes(data)
        assert await source.retired_at("c") is None, data


async def test_watcher_steps(store: LocalStore) -> None:
    w = ClusterWatcher(StoreSource(store), interval=5)
    changes: list[tuple[int | None, int]] = []
    w.on_change(lambda old, new: changes.append((old.generation if old else None, new.generation)))
    assert not await w.refresh()
    assert w.current is None and w.error is not None and "no cluster description" in w.error
    await set_cluster(store, AB)
    assert await w.refresh()
    assert w.current == Cluster.of(AB, 1) and w.error is None
    assert not await w.refresh()  # unchanged
    await set_cluster(store, {"a": AB["a"]})
    assert await w.refresh() and w.current.ids == ("a",)
    assert changes == [(None, 1), (1, 2)]
    # an unreadable description keeps the current one, and says why
    await store.put(keys.CLUSTER_KEY, b"garbage")
    assert not await w.refresh()
    assert w.current is not None and w.current.generation == 2
    assert w.error is not None and "not JSON" in w.error and w.failures == 1
    # the same generation with other contents, or an older one, is refused
    await store.put(keys.CLUSTER_KEY, Cluster.of(AB, 2).encode())
    assert not await w.refresh() and w.current.ids == ("a",)
    assert "changed without a new generation (2)" in (w.error or "")
    await store.put(keys.CLUSTER_KEY, Cluster.of(AB, 1).encode())
    assert not await w.refresh() and "went back to generation 1" in (w.error or "")
    await store.put(keys.CLUSTER_KEY, Cluster.of(AB, 3).encode())
    assert await w.refresh() and w.current.generation == 3 and w.error is None
    assert changes[-1] == (2, 3)


async def test_watcher_loop_with_injected_sleep(tmp_path: Path) -> None:
    f = tmp_path / "cluster.json"
    f.write_bytes(Cluster.of(AB, 1).encode())
    slept: list[float] = []
    tick = asyncio.Event()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await tick.wait()
        tick.clear()

    w = ClusterWatcher(FileSource(f), interval=2.5, sleep=sleep)
    await w.refresh()
    w.start()
    f.write_bytes(Cluster.of({"b": AB["b"]}, 2).encode())
    for _ in range(100):  # the loop waits in our sleep until we let it go
        await asyncio.sleep(0)
    assert w.current is not None and w.current.generation == 1
    tick.set()
    for _ in range(100):
        await asyncio.sleep(0)
        if w.current.generation == 2 and len(slept) == 2:
            break
    assert w.current.ids == ("b",)
    assert slept[:2] == [2.5, 2.5]
    await w.stop()


async def test_membership(tmp_path: Path) -> None:
    f = tmp_path / "cluster.json"
    w = ClusterWatcher(FileSource(f))
    m = Membership("a", w)
    await w.refresh()  # no file yet
    with pytest.raises(Unavailable, match="has not read the cluster description yet"):
        m.check("x")
    assert m.readiness() is not None and not m.owns("x")
    f.write_bytes(Cluster.of(AB, 4).encode())
    await w.refresh()
    assert m.readiness() is None and m.me is not None and m.me.id == "a"
    cluster = w.current
    assert cluster is not None
    mine = next(p for p in (f"s{n}" for n in range(100)) if cluster.owner(p).id == "a")
    theirs = next(p for p in (f"s{n}" for n in range(100)) if cluster.owner(p).id == "b")
    m.check(mine)
    assert m.owns(mine) and not m.owns(theirs)
    with pytest.raises(Misdirected) as e:
        m.check(theirs)
    assert e.value.owner_id == "b" and e.value.owner_url == AB["b"] and e.value.generation == 4
    assert "belongs to ingester b at http://127.0.0.1:1002, not to a (cluster generation 4)" in e.value.message
    assert m.misdirected == 1
    r = error_response(e.value)
    assert r.status == 421 and r.headers["DS3-Owner"] == AB["b"] and r.headers["DS3-Owner-Id"] == "b"
    assert r.headers["DS3-Cluster-Generation"] == "4" and r.headers["Cache-Control"] == "no-store"
    # a bucket and its streams: one owner
    bucket_owner = cluster.bucket_owner("tenant-1")
    m2 = Membership(bucket_owner.id, w)
    m2.check("\x00b/tenant-1/s1")
    m2.check("\x00b/tenant-1/s2")
    # an ingester the description does not name owns nothing
    f.write_bytes(Cluster.of({"b": AB["b"]}, 5).encode())
    await w.refresh()
    assert m.readiness() is not None and "not in the cluster description (generation 5: b)" in m.readiness()  # type: ignore[operator]
    with pytest.raises(Misdirected):
        m.check(mine)


class SlowSource:
    description = "slow"

    def __init__(self, cluster: Cluster, delay: float) -> None:
        self.cluster = cluster
        self.delay = delay
        self.loads = 0

    async def load(self) -> Cluster | None:
        self.loads += 1
        await asyncio.sleep(self.delay)
        return self.cluster


async def test_watcher_reads_are_shared_and_bounded() -> None:
    src = SlowSource(Cluster.of(AB, 2), 0.05)
    w = ClusterWatcher(src, timeout=1)
    assert list(await asyncio.gather(w.refresh(), w.refresh(), w.refresh())) == [True, True, True]
    assert src.loads == 1 and w.current is not None and w.current.generation == 2
    assert not await w.refresh_if_older(2) and src.loads == 1  # we have it: no read
    assert not await w.refresh_if_older(3) and src.loads == 2  # asked for newer: read (none there)
    slow = ClusterWatcher(SlowSource(Cluster.of(AB, 1), 5), timeout=0.05)
    assert not await slow.refresh()
    assert slow.current is None and "no answer within 0.05 s" in (slow.error or "") and slow.failures == 1
