"""ingester/publisher.py on a real WAL (tests/wal_harness.py) and a local-directory store whose
writes a test can hold back or fail: descriptors of different streams are written at once, one
stream's changes one at a time and the newest last, a failing store is retried, waiters are
told, and a stream's mark in the WAL goes only once what the store has is current."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest

from ingester.publisher import Publisher
from ingester.store_sealing import descriptor_of
from ingester.writes import SealPolicy
from shared import keys
from shared.objectstore.local import LocalStore
from tests.wal_harness import Clock, Harness

SEAL = SealPolicy(seal_bytes=1 << 20, seal_age=60.0, wal_max_bytes=1 << 30)


class HeldStore:
    """A LocalStore whose descriptor writes wait for `gate` and may fail first."""

    def __init__(self, root: Path) -> None:
        self.inner = LocalStore(root)
        self.gate = asyncio.Event()
        self.gate.set()
        self.now = 0  # writes in progress
        self.most = 0  # the most at once
        self.by_key: dict[str, int] = {}  # writes of each key in progress
        self.fail = 0  # the next this many writes fail
        self.writes = 0
        self.sync_gate = asyncio.Event()
        self.sync_gate.set()
        self.sync_fail = 0  # the next this many syncs fail
        self.synced: list[str] = []  # keys synced, in order
        self.durable_kw: list[bool] = []  # each put's durable=

    async def put(self, key: str, data: bytes, **kw: Any) -> str:
        self.now += 1
        self.most = max(self.most, self.now)
        self.by_key[key] = self.by_key.get(key, 0) + 1
        assert self.by_key[key] == 1, f"two writes of {key} at once"
        try:
            await self.gate.wait()
            self.writes += 1
            if self.fail:
                self.fail -= 1
                raise OSError("the store is down")
            self.durable_kw.append(kw.get("durable", True))
            return await self.inner.put(key, data, **kw)
        finally:
            self.now -= 1
            self.by_key[key] -= 1

    async def delete(self, key: str, **kw: Any) -> None:
        self.durable_kw.append(kw.get("durable", True))
        await self.inner.delete(key, **kw)

    async def sync(self, keys: Collection[str]) -> None:
        await self.sync_gate.wait()
        if self.sync_fail:
            self.sync_fail -= 1
            raise OSError("the disk is gone")
        await self.inner.sync(keys)
        self.synced += keys

    def stored(self, path: str) -> dict[str, Any] | None:
        file = self.inner.root / keys.descriptor_key(path)
        return json.loads(file.read_bytes()) if file.exists() else None


async def stopped(runner: asyncio.Future[None]) -> None:
    runner.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await runner


@pytest.fixture
def hs(tmp_path: Path) -> Iterator[tuple[Harness, HeldStore]]:
    """A WAL harness that marks descriptors to publish (a seal policy), and a held store."""
    h = Harness(tmp_path / "wal", Clock(), seal=SEAL)
    try:
        yield h, HeldStore(tmp_path / "objects")
    finally:
        h.close()


def desc(h: Harness, path: str) -> Any:
    meta = h.meta(path)
    return None if meta is None else descriptor_of(meta)


def marks(h: Harness) -> set[str]:
    return set(h.run(h.store.load_unpublished))


def test_descriptors_of_different_streams_are_written_at_once(hs: tuple[Harness, HeldStore]) -> None:
    h, objects = hs
    pub = Publisher(h.store, h.committer, objects, concurrency=8)  # type: ignore[arg-type]
    paths = [f"s{i}" for i in range(20)]
    for p in paths:
        h.create(p)
    assert marks(h) == set(paths)

    async def main() -> list[bool]:
        runner = asyncio.ensure_future(pub.run())
        objects.gate.clear()
        pub.enqueue({p: desc(h, p) for p in paths})
        await asyncio.sleep(0.05)
        assert objects.now == 8  # as many as it may, no more
        early = await pub.published("s0", 0.05)
        objects.gate.set()
        done = await asyncio.gather(*(pub.published(p, 5) for p in paths))
        await asyncio.sleep(0.2)  # (the marks go in a commit of their own)
        await stopped(runner)
        return [early, *done]

    early, *done = h.loop.run_until_complete(main())
    assert not early and all(done)
    assert objects.most == 8
    assert all(objects.stored(p)["uid"] == h.meta(p).uid for p in paths)  # type: ignore[index, union-attr]
    assert marks(h) == set()


def test_a_change_while_its_stream_is_written_is_written_after_it(hs: tuple[Harness, HeldStore]) -> None:
    h, objects = hs
    pub = Publisher(h.store, h.committer, objects)  # type: ignore[arg-type]
    h.create("p")
    made = desc(h, "p")

    async def main() -> None:
        runner = asyncio.ensure_future(pub.run())
        objects.gate.clear()
        pub.enqueue({"p": made})
        await asyncio.sleep(0.05)
        h.append("p", b"", close=True)  # (a closed stream: a new descriptor)
        pub.enqueue({"p": desc(h, "p")})
        await asyncio.sleep(0.05)
        assert objects.now == 1  # not a second write of the same key meanwhile
        objects.gate.set()
        assert await pub.published("p", 5)
        await asyncio.sleep(0.2)
        await stopped(runner)

    h.loop.run_until_complete(main())
    assert objects.writes == 2
    assert objects.stored("p")["closed"] is True  # type: ignore[index]
    assert marks(h) == set()


def publish_one(h: Harness, objects: HeldStore, path: str, settle: float = 0.0) -> bool:
    """Create `path`, publish its descriptor with a publisher of its own, and say whether the
    create would have been acknowledged (within 10 s); `settle`: seconds left for the marks."""
    pub = Publisher(h.store, h.committer, objects)  # type: ignore[arg-type]
    h.create(path)

    async def main() -> bool:
        runner = asyncio.ensure_future(pub.run())
        pub.enqueue({path: desc(h, path)})
        ok = await pub.published(path, 10)
        await asyncio.sleep(settle)
        await stopped(runner)
        return ok

    return h.loop.run_until_complete(main())


def test_a_failing_store_is_tried_again(hs: tuple[Harness, HeldStore]) -> None:
    h, objects = hs
    objects.fail = 2
    assert publish_one(h, objects, "f")  # backoff 0.2 s, then 0.4 s
    assert objects.writes == 3 and objects.stored("f") is not None


def test_a_create_is_acknowledged_before_its_descriptor_is_synced_and_the_mark_waits_for_the_sync(
        hs: tuple[Harness, HeldStore]) -> None:
    """Descriptors are written visible but not yet durable (no fsyncs each); the create is
    acknowledged then, and its mark, what a restart writes again after a machine crash, is
    dropped only once one sync has made every descriptor written meanwhile durable."""
    h, objects = hs
    pub = Publisher(h.store, h.committer, objects)  # type: ignore[arg-type]
    paths = [f"d{i}" for i in range(5)]
    for p in paths:
        h.create(p)

    async def main() -> None:
        runner = asyncio.ensure_future(pub.run())
        objects.sync_gate.clear()
        pub.enqueue({p: desc(h, p) for p in paths})
        assert all(await asyncio.gather(*(pub.published(p, 5) for p in paths)))  # acknowledged...
        assert all(objects.stored(p) is not None for p in paths)  # ...visible to readers...
        await asyncio.sleep(0.1)
        assert marks(h) == set(paths)  # ...and the marks kept while the sync is held
        objects.sync_gate.set()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not marks(h):
                break
        await stopped(runner)

    h.loop.run_until_complete(main())
    assert objects.durable_kw == [False] * 5
    assert sorted(objects.synced) == sorted(keys.descriptor_key(p) for p in paths)
    assert marks(h) == set()


def test_a_failed_sync_keeps_the_marks(hs: tuple[Harness, HeldStore]) -> None:
    h, objects = hs
    objects.sync_fail = 1
    assert publish_one(h, objects, "k", settle=0.2)
    assert objects.stored("k") is not None
    assert marks(h) == {"k"}  # a restart writes it again (Store.load_unpublished)


def test_a_mark_goes_only_when_the_store_has_the_stream_as_it_is(hs: tuple[Harness, HeldStore]) -> None:
    """What was written is compared with the stream now (Store.published): a change committed
    meanwhile keeps its mark, so a crash before its own descriptor is written cannot lose it."""
    h, _ = hs
    h.create("m")
    before = desc(h, "m")
    h.append("m", b"x", close=True)
    assert not h.run(lambda txn: h.store.published(txn, "m", before))  # an older descriptor
    assert marks(h) == {"m"}
    assert not h.run(lambda txn: h.store.published(txn, "m", None))  # "removed", but it is there
    assert h.run(lambda txn: h.store.published(txn, "m", desc(h, "m")))
    assert marks(h) == set()
    h.delete("m")
    assert marks(h) == {"m"}
    assert not h.run(lambda txn: h.store.published(txn, "m", before))  # it is gone now
    assert h.run(lambda txn: h.store.published(txn, "m", None))
    assert marks(h) == set()


def test_each_commit_hands_on_the_descriptor_as_it_left_the_stream(hs: tuple[Harness, HeldStore]) -> None:
    """The writer keeps changing its metadata objects after a commit; what a commit hands the
    publisher is a snapshot taken on the writer thread. (It was the object itself: a close
    committed while the create's descriptor was being written looked like the same change, and
    the closed descriptor was never written.)"""
    h, _ = hs
    h.create("n")
    h.append("n", b"x", close=True)
    h.loop.run_until_complete(asyncio.sleep(0.1))  # (commits' outcomes reach the loop)
    published = [d.descriptors["n"] for d in h.durable if "n" in d.descriptors]
    assert [d.closed for d in published] == [False, True]
    assert published[1].final_offset is not None and published[0].final_offset is None


def test_a_round_of_failures_backs_off_once(hs: tuple[Harness, HeldStore]) -> None:
    """Every write of two rounds fails (the store is down a moment): each next round comes after
    one backoff step (0.2 s, then 0.4 s), not one per failed write (16 doublings a round: the
    30 s cap before the third round)."""
    h, objects = hs
    objects.fail = 32
    pub = Publisher(h.store, h.committer, objects, concurrency=16)  # type: ignore[arg-type]
    paths = [f"r{i}" for i in range(16)]
    for p in paths:
        h.create(p)

    async def main() -> list[bool]:
        runner = asyncio.ensure_future(pub.run())
        pub.enqueue({p: desc(h, p) for p in paths})
        done = await asyncio.gather(*(pub.published(p, 3) for p in paths))
        await stopped(runner)
        return done

    assert all(h.loop.run_until_complete(main()))
    assert objects.writes == 48
