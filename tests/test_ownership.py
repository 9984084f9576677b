"""shared.ownership: one owner per store prefix, over the local store and S3 (moto's server).
Time is a FakeTime that tests move; each process has its own clock on it (with a skew)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from shared import keys
from shared.errors import (
    ObjectStoreError,
    ObjectStoreUnavailable,
    OwnedElsewhere,
    PreconditionFailed,
    Superseded,
)
from shared.objectstore import ObjectStore, open_store
from shared.ownership import LeaseKeeper, OwnerRecord, Ownership, read_owner
from tests.s3server import MotoS3

LEASE = 9.0
SKEW = 1.0
T0 = 1_767_225_600.0


class FakeTime:
    def __init__(self) -> None:
        self.now = T0

    def advance(self, seconds: float) -> None:
        self.now += seconds


class NodeClock:
    """One machine's clocks: wall = true time + skew; monotonic counts from its own origin."""

    def __init__(self, t: FakeTime, skew: float = 0.0) -> None:
        self.t = t
        self.skew = skew

    def wall(self) -> float:
        return self.t.now + self.skew

    def monotonic(self) -> float:
        return self.t.now - T0 + 1000.0


@pytest.fixture(params=["local", "s3"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    if request.param == "local":
        s: ObjectStore = open_store((tmp_path / "objects").as_uri())
    else:
        bucket: str = request.getfixturevalue("s3_bucket")
        server: MotoS3 = request.getfixturevalue("s3_server")
        s = open_store(f"s3://{bucket}/some/prefix", s3_endpoint=server.endpoint)
    async with s:
        yield s


@pytest.fixture
def t() -> FakeTime:
    return FakeTime()


def node(store: ObjectStore, t: FakeTime, name: str, skew: float = 0.0, **kw: Any) -> Ownership:
    return Ownership(store, name, f"http://{name}:4437", lease_seconds=LEASE, max_skew=SKEW,
                     clock=NodeClock(t, skew), **kw)


# ---------------------------------------------------------------- acquire
async def test_acquire_on_an_empty_store(store: ObjectStore, t: FakeTime) -> None:
    a = node(store, t, "a")
    assert await a.current() is None and not a.valid() and a.epoch == 0
    rec = await a.acquire()
    assert rec == OwnerRecord(epoch=1, owner_id="a", advertise_url="http://a:4437",
                              lease_expires_at=T0 + LEASE, renewed_at=T0)
    assert a.valid() and a.check() == 1 and a.remaining() == LEASE
    assert await a.current() == rec == await read_owner(store)
    stored = orjson.loads(await store.get(keys.OWNER_KEY))
    assert stored == {"version": 1, "epoch": 1, "owner_id": "a", "advertise_url": "http://a:4437",
                      "renewed_at": T0, "lease_expires_at": T0 + LEASE}
    assert (await store.head(keys.OWNER_KEY)).content_type == "application/json"
    with pytest.raises(RuntimeError):
        await a.acquire()


async def test_second_acquirer_refused_while_the_lease_is_live(store: ObjectStore, t: FakeTime) -> None:
    a, b = node(store, t, "a"), node(store, t, "b")
    await a.acquire()
    for dt in (0.0, LEASE, SKEW):  # to the end of the lease, then through the skew allowance
        t.advance(dt)
        with pytest.raises(OwnedElsewhere) as e:
            await b.acquire()
        assert (e.value.owner_id, e.value.advertise_url, e.value.epoch) == ("a", "http://a:4437", 1)
        assert e.value.lease_expires_at == T0 + LEASE
        assert "owned by a (http://a:4437, epoch 1) until at least 2026-01-01T00:00:09.000+00:00" in e.value.message
        assert e.value.retry_after >= 1
    assert not b.valid() and b.record is None
    with pytest.raises(Superseded):
        b.check()
    assert (await b.current()) == a.record


async def test_takeover_after_expiry_bumps_the_epoch_and_fences_the_old_owner(
        store: ObjectStore, t: FakeTime) -> None:
    a, b = node(store, t, "a"), node(store, t, "b")
    await a.acquire()
    t.advance(LEASE + SKEW + 0.01)
    assert not a.valid()  # a knows its lease is over before b may take over
    rec = await b.acquire()
    assert (rec.epoch, rec.owner_id, rec.lease_expires_at) == (2, "b", t.now + LEASE)
    assert b.check() == 2
    with pytest.raises(Superseded):  # lapsed: a does not even try to write
        await a.renew()
    assert a.fenced and (await a.current()) == rec
    assert not await a.release()
    assert (await a.current()) == rec


async def test_old_owner_renewal_fails_once_taken_over(store: ObjectStore, t: FakeTime) -> None:
    """The old owner's clock runs slow (or it was paused): it still believes in its lease when
    it renews, and only the conditional write tells it that it was superseded."""
    a, b = node(store, t, "a", skew=-0.5), node(store, t, "b", skew=0.5)
    await a.acquire()
    t.advance(LEASE + 0.6)  # b's clock: past the lease + skew allowance
    await b.acquire()
    a._valid_until = a.clock.monotonic() + 5  # as if a had been frozen since before the lapse
    assert a.valid()
    with pytest.raises(Superseded) as e:
        await a.renew()
    assert "taken over" in e.value.message and "b's, epoch 2" in e.value.message and e.value.epoch == 1
    assert a.fenced and not a.valid()
    with pytest.raises(Superseded):
        a.check()
    with pytest.raises(Superseded):
        await a.renew()
    assert (await a.current()) == b.record  # a wrote nothing


async def test_renewal_extends_the_lease(store: ObjectStore, t: FakeTime) -> None:
    a, b = node(store, t, "a"), node(store, t, "b")
    first = await a.acquire()
    t.advance(LEASE - 1)
    rec = await a.renew()
    assert (rec.epoch, rec.renewed_at, rec.lease_expires_at) == (1, t.now, t.now + LEASE)
    assert a.remaining() == LEASE and (await a.current()) == rec
    t.advance(LEASE - 1)  # past the first lease + skew: the renewal holds b off
    assert t.now > first.lease_expires_at + SKEW
    with pytest.raises(OwnedElsewhere):
        await b.acquire()
    assert a.check() == 1


async def test_release_lets_a_standby_take_over_at_once(store: ObjectStore, t: FakeTime) -> None:
    a, b = node(store, t, "a"), node(store, t, "b", skew=-SKEW)  # b's clock even lags
    await a.acquire()
    t.advance(1)
    assert await a.release()
    assert not a.valid() and a.fenced
    with pytest.raises(Superseded):
        a.check()
    released = await a.current()
    assert released is not None and released.released and released.lease_expires_at == t.now
    rec = await b.acquire()
    assert rec.epoch == 2 and rec.owner_id == "b"
    assert not await a.release()  # twice: nothing more to give up


async def test_own_record_is_taken_over_at_once_with_a_new_epoch(store: ObjectStore, t: FakeTime) -> None:
    """A restarted process with the same owner_id does not wait for its old lease."""
    await node(store, t, "a").acquire()
    again = node(store, t, "a")
    assert (await again.acquire()).epoch == 2


async def test_a_fenced_owner_may_acquire_again_when_free(store: ObjectStore, t: FakeTime) -> None:
    a = node(store, t, "a")
    await a.acquire()
    t.advance(LEASE)
    with pytest.raises(Superseded):
        a.check()  # lapsed: fenced for good, this epoch
    rec = await a.acquire()
    assert rec.epoch == 2 and a.check() == 2 and not a.fenced


async def test_skew_within_bounds_never_overlaps(store: ObjectStore, t: FakeTime) -> None:
    """The standby's clock runs ahead by almost max_skew: the owner's own lease still ends
    (by its monotonic clock) before the standby may take over."""
    a, b = node(store, t, "a"), node(store, t, "b", skew=0.9 * SKEW)
    await a.acquire()
    step = 0.05
    while True:
        t.advance(step)
        try:
            await b.acquire()
            break
        except OwnedElsewhere:
            continue
    assert not a.valid()
    assert t.now >= T0 + LEASE


async def test_concurrent_acquirers_on_an_empty_store(store: ObjectStore, t: FakeTime) -> None:
    for round_ in range(3):
        nodes = [node(store, t, f"n{round_}-{i}") for i in range(8)]
        results = await asyncio.gather(*(n.acquire() for n in nodes), return_exceptions=True)
        won = [r for r in results if isinstance(r, OwnerRecord)]
        assert len(won) == 1, results
        assert all(isinstance(r, OwnedElsewhere) for r in results if not isinstance(r, OwnerRecord))
        assert won[0].epoch == round_ + 1 and (await read_owner(store)) == won[0]
        assert sum(n.valid() for n in nodes) == 1
        t.advance(LEASE + SKEW + 1)  # the next round takes a lapsed record over


async def test_unreadable_record_is_left_alone(store: ObjectStore, t: FakeTime) -> None:
    for bad in (b"not json", b"[]", b'{"epoch": 1}', orjson.dumps({
            "version": 2, "epoch": 1, "owner_id": "x", "advertise_url": "", "renewed_at": 1.0,
            "lease_expires_at": 2.0})):
        await store.put(keys.OWNER_KEY, bad)
        with pytest.raises(ObjectStoreError) as e:
            await node(store, t, "a").acquire()
        assert "unreadable" in e.value.message
        assert await store.get(keys.OWNER_KEY) == bad


# ---------------------------------------------------------------- lost answers, store errors
class FaultyStore:
    """Forwards to a store; puts can fail before reaching it, or reach it and report a
    precondition failure (what a retried conditional write whose answer was lost sees)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.fail_puts = False
        self.lose_answers = False

    async def put(self, key: str, data: bytes, **kw: Any) -> str:
        if self.fail_puts:
            raise ObjectStoreUnavailable("injected: store unreachable")
        etag = await self.inner.put(key, data, **kw)
        if self.lose_answers:
            raise PreconditionFailed(key, "injected: the retry of a write that happened")
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_write_whose_answer_was_lost_counts(store: ObjectStore, t: FakeTime) -> None:
    faulty = FaultyStore(store)
    a = node(cast(ObjectStore, faulty), t, "a")
    faulty.lose_answers = True
    assert (await a.acquire()).epoch == 1  # created, though the answer said otherwise
    t.advance(1)
    rec = await a.renew()
    assert a.check() == 1 and (await read_owner(store)) == rec
    faulty.lose_answers = False
    t.advance(1)
    await a.renew()  # the ETag learnt by reading back is the right one
    assert await a.release()


async def test_keeper_renews_every_third_of_the_lease(store: ObjectStore, t: FakeTime) -> None:
    a = node(store, t, "a")
    await a.acquire()
    keeper = LeaseKeeper(a)
    assert keeper.interval == LEASE / 3
    for _ in range(10):
        t.advance(await keeper.tick())
        assert a.valid() and a.remaining() == LEASE - LEASE / 3
    rec = await a.current()
    assert rec is not None and rec.lease_expires_at == t.now - LEASE / 3 + LEASE


async def test_keeper_backs_off_then_fences_when_the_lease_runs_out(store: ObjectStore, t: FakeTime) -> None:
    faulty = FaultyStore(store)
    a = node(cast(ObjectStore, faulty), t, "a")
    await a.acquire()
    keeper = LeaseKeeper(a, min_backoff=0.5, max_backoff=2.0)
    faulty.fail_puts = True
    delays = []
    with pytest.raises(Superseded) as e:
        while True:
            delay = await keeper.tick()
            delays.append(delay)
            t.advance(delay)
    assert "lapsed" in e.value.message and a.fenced and not a.valid()
    assert delays[:3] == [0.5, 1.0, 2.0] and max(delays) == 2.0  # doubling, capped
    # within half the lease left (or min_backoff): several tries, the last one just before it ends
    assert delays == [0.5, 1.0, 2.0, 2.0, 1.75, 0.875, 0.5, 0.5]
    assert sum(delays[:-1]) < LEASE <= sum(delays)
    assert keeper.failures == len(delays)  # the last tick found the lease over: no attempt
    faulty.fail_puts = False  # too late: fenced for good
    with pytest.raises(Superseded):
        await keeper.tick()
    with pytest.raises(Superseded):
        await a.renew()


async def test_keeper_recovers_if_the_store_comes_back_in_time(store: ObjectStore, t: FakeTime) -> None:
    faulty = FaultyStore(store)
    a = node(cast(ObjectStore, faulty), t, "a")
    await a.acquire()
    keeper = LeaseKeeper(a, min_backoff=0.5)
    faulty.fail_puts = True
    for _ in range(3):
        t.advance(await keeper.tick())
    assert keeper.failures == 3 and a.valid()
    faulty.fail_puts = False
    assert await keeper.tick() == keeper.interval
    assert keeper.failures == 0 and a.remaining() == LEASE


async def test_keeper_stops_when_superseded(store: ObjectStore, t: FakeTime) -> None:
    a, b = node(store, t, "a"), node(store, t, "b")
    await a.acquire()
    t.advance(LEASE + SKEW + 0.1)
    await b.acquire()
    a._valid_until = a.clock.monotonic() + 1  # a believes it still has a moment
    with pytest.raises(Superseded):
        await LeaseKeeper(a).tick()
    assert a.fenced


async def test_keeper_run_in_real_time(tmp_path: Path) -> None:
    """The loop itself, on the system clock: a 2 s lease stays owned past its first term. (A
    0.6 s lease failed under a full test run's load: a renewal's fsync can take that long.)"""
    async with open_store(tmp_path.as_uri()) as store:
        a = Ownership(store, "a", lease_seconds=2.0, max_skew=0.05)
        b = Ownership(store, "b", lease_seconds=2.0, max_skew=0.05)
        await a.acquire()
        task = asyncio.create_task(LeaseKeeper(a).run())
        await asyncio.sleep(3.0)
        assert a.valid() and not task.done()
        with pytest.raises(OwnedElsewhere):
            await b.acquire()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await a.release()
        assert (await b.acquire()).epoch == 2


async def test_the_record_says_what_its_owner_acknowledges_after(store: ObjectStore, t: FakeTime,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A taker learns the durability its predecessor ran with (a record without it, from before,
    reads as unknown), and an ingester that acknowledges less says so (found by QA: a standby
    left at --durability local silently lowered a store-mode owner's guarantee)."""
    from ingester.owning import say_if_weaker
    from shared.config import IngesterConfig

    a = node(store, t, "a", durability="store")
    await a.acquire()
    await a.renew()
    found = await read_owner(store)
    assert found is not None and found.durability == "store"
    await a.release()
    b = node(store, t, "b", durability="local")
    await b.acquire()
    assert b.previous_record is not None and b.previous_record.durability == "store"
    local = IngesterConfig(data_dir=Path("/nonexistent"), store=store.url)
    with caplog.at_level("WARNING", logger="ds3.ingester"):
        say_if_weaker(b.previous_record, local)
        say_if_weaker(b.previous_record, IngesterConfig(data_dir=Path("/nonexistent"), store=store.url,
                                                        durability="store"))
        say_if_weaker(None, local)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(
        f"the previous owner of {store.url} (a, epoch 1) ran with --durability store (an append acknowledged once "
        "the store's log held it); this ingester runs with --durability local: "), said
    old = orjson.loads(found.encode())
    del old["durability"]
    assert OwnerRecord.decode(orjson.dumps(old)).durability is None


def test_a_standby_taking_over_does_not_send_clients_to_the_owner_it_replaces() -> None:
    """QA: between the owner's lapse and the end of the takeover, the standby's 503 said "send
    requests there", naming the dead (or frozen) owner; the reader had just said it was replaced."""
    import time
    from types import SimpleNamespace
    from typing import Any, cast

    from ingester.standby import refusal
    from shared.ownership import OwnerRecord

    now = time.time()
    live = OwnerRecord(epoch=2, owner_id="a", advertise_url="http://a:1", lease_expires_at=now + 5, renewed_at=now)
    svc: Any = SimpleNamespace(standby_owner=live, ownership=SimpleNamespace(max_skew=1.0), standby_status="")
    assert "send requests there" in refusal(cast(Any, svc)).message
    for rec in (OwnerRecord(epoch=2, owner_id="a", advertise_url="http://a:1", lease_expires_at=now - 2,
                            renewed_at=now - 8),  # lapsed
                OwnerRecord(epoch=2, owner_id="a", advertise_url="http://a:1", lease_expires_at=now,
                            renewed_at=now)):  # released
        svc.standby_owner = rec
        got = refusal(cast(Any, svc))
        assert "taking over" in got.message and "send requests there" not in got.message, got.message
        assert got.retry_after == 1
