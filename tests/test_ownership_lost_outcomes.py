"""shared.ownership: writes of the ownership record whose outcome this process never learnt.

The local store writes in a worker thread: cancelling the coroutine that awaits a put does not
stop the write, it lands anyway. S3 can apply a PUT whose answer is lost (a timeout, a dropped
connection). Either way the record then holds a version we wrote, under an ETag we do not
know. The next conditional write of ours fails its precondition: that must not fence us as
if another owner had taken over (QA: a standby fenced itself right after taking over, at
the same epoch, named in the record as itself). A record naming another owner, or a higher
epoch, must still fence at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from ingester.owning import restore_keeping_the_lease
from shared import keys
from shared.config import IngesterConfig
from shared.errors import ObjectStoreUnavailable, Superseded
from shared.objectstore import ObjectStore, open_store
from shared.ownership import LeaseKeeper, OwnerRecord, Ownership, read_owner
from tests.test_ownership import LEASE, SKEW, FakeTime, NodeClock


class LateAnswers:
    """Forwards to a store; while `late` is set, a put reaches the store and completes there,
    but its answer comes `delay` seconds later (as when the local store's worker thread is
    done before the event loop resumes the awaiter): cancelling the awaiter meanwhile loses
    the answer, not the write. With `error` set, the answer is that error instead (a PUT
    that landed though the client saw a timeout)."""

    def __init__(self, inner: ObjectStore, delay: float = 0.0) -> None:
        self.inner = inner
        self.url = inner.url
        self.late = False
        self.delay = delay
        self.error: Exception | None = None
        self.landed: list[bytes] = []  # bodies written while late
        self.in_store = asyncio.Event()  # set once a late put has completed in the store

    async def put(self, key: str, data: bytes, **kw: Any) -> str:
        etag = await self.inner.put(key, data, **kw)
        if self.late:
            self.landed.append(data)
            self.in_store.set()
            if self.error is not None:
                raise self.error
            await asyncio.sleep(self.delay)
        return etag

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
async def local(tmp_path: Path) -> Any:
    async with open_store((tmp_path / "objects").as_uri()) as s:
        yield s


def node(store: Any, t: FakeTime, name: str) -> Ownership:
    return Ownership(cast(ObjectStore, store), name, f"http://{name}:4437", lease_seconds=LEASE,
                     max_skew=SKEW, clock=NodeClock(t))


async def test_a_cancelled_renewal_that_landed_does_not_fence_us(local: ObjectStore) -> None:
    t = FakeTime()
    late = LateAnswers(local, delay=3600)
    a = node(late, t, "a")
    await a.acquire()
    t.advance(1)
    late.late = True
    renewing = asyncio.create_task(a.renew())
    await late.in_store.wait()  # the write is done in the store; its answer never comes
    renewing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await renewing
    late.late = False
    landed = OwnerRecord.decode(late.landed[0])
    assert await read_owner(local) == landed and landed.epoch == 1 and landed.owner_id == "a"
    t.advance(1)
    rec = await a.renew()  # precondition failed on the old ETag: the record was ours, adopted
    assert not a.fenced and a.check() == 1 and a.remaining() == LEASE
    assert await read_owner(local) == rec and rec.renewed_at == t.now
    t.advance(1)
    await a.renew()  # and the ETag learnt is the right one
    assert await a.release()


async def test_a_renewal_that_landed_behind_a_timeout_does_not_fence_us(local: ObjectStore) -> None:
    t = FakeTime()
    late = LateAnswers(local)
    a = node(late, t, "a")
    await a.acquire()
    t.advance(1)  # (a renewal at the same time would write the same bytes: the same MD5 ETag)
    late.late, late.error = True, ObjectStoreUnavailable("injected: the answer timed out")
    keeper = LeaseKeeper(a, min_backoff=0.5)
    t.advance(await keeper.tick())  # failed, by its answer; it landed though
    assert keeper.failures == 1 and late.landed
    late.late = False
    assert await keeper.tick() == keeper.interval and not a.fenced
    assert await read_owner(local) == a.record


async def test_a_release_after_a_cancelled_renewal_still_releases(local: ObjectStore) -> None:
    """The service stops: its lease task is cancelled mid-renewal, then it releases."""
    t = FakeTime()
    late = LateAnswers(local, delay=3600)
    a, b = node(late, t, "a"), node(local, t, "b")
    await a.acquire()
    t.advance(1)
    late.late = True
    task = asyncio.create_task(LeaseKeeper(a).run())
    await late.in_store.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    late.late = False
    assert await a.release()
    assert (await b.acquire()).epoch == 2  # at once: the lease was released


async def renewal_landed_unanswered(late: LateAnswers, own: Ownership) -> None:
    """A renewal of `own` lands in the store, and is cancelled before its answer comes."""
    late.late = True
    renewing = asyncio.create_task(own.renew())
    await late.in_store.wait()
    renewing.cancel()
    await asyncio.gather(renewing, return_exceptions=True)
    late.late = False


async def test_a_record_of_another_owner_still_fences_at_once(local: ObjectStore) -> None:
    """Unchanged by the above: a lost answer of ours does not excuse another owner's record."""
    t = FakeTime()
    late = LateAnswers(local, delay=3600)
    a, b = node(late, t, "a"), node(local, t, "b")
    await a.acquire()
    t.advance(1)
    await renewal_landed_unanswered(late, a)
    t.advance(LEASE + SKEW + 0.1)
    await b.acquire()
    a._valid_until = a.clock.monotonic() + 1  # a believes it still has a moment
    with pytest.raises(Superseded) as e:
        await a.renew()
    assert "b's, epoch 2" in e.value.message and a.fenced
    assert (await read_owner(local)) == b.record


async def test_a_higher_epoch_of_our_own_id_still_fences(local: ObjectStore) -> None:
    """Another process under our owner_id (a restart of this node) took the record over."""
    t = FakeTime()
    late = LateAnswers(local, delay=3600)
    a, a2 = node(late, t, "a"), node(local, t, "a")
    await a.acquire()
    t.advance(1)
    await renewal_landed_unanswered(late, a)
    await a2.acquire()
    with pytest.raises(Superseded):
        await a.renew()
    assert a.fenced and (await read_owner(local)) == a2.record


async def test_a_same_epoch_record_we_never_wrote_still_fences(local: ObjectStore) -> None:
    """Only versions this process sent are adopted: a record naming us at our epoch that is
    none of them (edited by hand, say) is not ours to overwrite."""
    t = FakeTime()
    a = node(local, t, "a")
    rec = await a.acquire()
    forged = OwnerRecord(epoch=rec.epoch, owner_id="a", advertise_url="http://elsewhere:1",
                         lease_expires_at=rec.lease_expires_at + 5, renewed_at=rec.renewed_at + 5)
    await local.put(keys.OWNER_KEY, forged.encode())
    with pytest.raises(Superseded):
        await a.renew()
    assert a.fenced and await read_owner(local) == forged


async def test_restoring_stops_its_keeper_without_losing_a_renewal(tmp_path: Path) -> None:
    """restore_keeping_the_lease (a standby's takeover) ends while its keeper's renewal is
    in flight: the renewal completes and its ETag is ours, so the service's own keeper
    renews right after (QA's self-fencing standby)."""
    async with open_store((tmp_path / "objects").as_uri()) as store:
        late = LateAnswers(store, delay=0.3)
        own = Ownership(cast(ObjectStore, late), "b", "http://b:4437", lease_seconds=2.0, max_skew=0.05)
        acquired = await own.acquire()
        late.late = True  # the keeper's first renewal, at once, answers 0.3 s after it landed
        config = IngesterConfig(data_dir=tmp_path / "data", store=(tmp_path / "objects").as_uri())
        await restore_keeping_the_lease(config, own, cast(ObjectStore, late))  # nothing to restore
        late.late = False
        await asyncio.sleep(0.35)  # a cancelled renewal has landed by now (its answer lost)
        renewed = await read_owner(store)
        assert renewed is not None and renewed.renewed_at > acquired.renewed_at  # the keeper's
        await own.renew()
        assert not own.fenced and own.epoch == 1 and await read_owner(store) == own.record
        assert await own.release()


async def test_keeper_stop_lets_the_renewal_in_flight_finish(local: ObjectStore) -> None:
    t = FakeTime()
    late = LateAnswers(local, delay=0.2)
    a = node(late, t, "a")
    await a.acquire()
    t.advance(1)
    late.late = True
    keeper = LeaseKeeper(a)
    task = asyncio.create_task(keeper.run())
    await late.in_store.wait()  # renewing; its answer comes 0.2 s from now
    keeper.stop()
    await task  # returns, once the renewal is answered
    assert a.record is not None and a.record.renewed_at == t.now  # learnt: nothing left unanswered
    assert await read_owner(local) == a.record and not a.sent(a.record)
    late.late = False
    await a.renew()  # plain If-Match success, no adoption needed
    stopped = LeaseKeeper(a)
    stopped.stop()
    await asyncio.wait_for(stopped.run(), 5)  # stopped before it started: one tick, then returns


async def test_an_acquire_whose_answer_was_lost_is_known_as_ours(local: ObjectStore) -> None:
    """regain() (ingester/lease.py) takes the prefix back only from a record at our old epoch,
    or one we sent: a retake (epoch + 1) that landed though its answer was an error."""
    t = FakeTime()
    late = LateAnswers(local)
    a, b = node(late, t, "a"), node(local, t, "b")
    await a.acquire()
    a._fence("injected")
    late.late, late.error = True, ObjectStoreUnavailable("injected: the answer timed out")
    with pytest.raises(ObjectStoreUnavailable):
        await a.acquire()
    found = await read_owner(local)
    assert found is not None and found.epoch == 2 and a.sent(found) and a.fenced
    late.late = False
    assert (await a.acquire()).epoch == 3 and not a.fenced
    t.advance(LEASE + SKEW + 0.1)
    await b.acquire()
    other = await read_owner(local)
    assert other is not None and not a.sent(other)
