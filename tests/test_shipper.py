"""The log shipper (ingester/shipper.py) driven directly: gates, batching, store errors and
backoff, harmless re-uploads, fencing, checkpoints, and restoring (ingester/logstore.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from pathlib import Path
from typing import Any

import lmdb
import pytest

from ingester import ship_queue
from ingester import shipper as shipper_mod
from ingester.logstore import ORPHANS_MAX, RestoreError, drop_wal_behind_log, list_log, restore
from ingester.replay import replay
from ingester.ship_queue import ShipQueue
from ingester.shipper import GATE_ATTEMPTS, Shipper, StoreAhead
from ingester.wal import GroupCommitter, WalEnv
from shared.errors import ObjectStoreUnavailable, Superseded, Unavailable
from shared.logsegment import DB_IDS, PUT, Commit, decode, encode, segment_key
from shared.objectstore import LocalStore
from shared.ownership import Ownership
from tests.wal_harness import dump

STREAMS = DB_IDS["streams"]


def commit(seq: int, key: bytes = b"k") -> Commit:
    return Commit(seq, [(STREAMS, PUT, key + b"%d" % seq, b"v%d" % seq)])


class FlakyStore(LocalStore):
    """A local store whose next `fail_puts` puts fail as an unreachable store's would."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail_puts = 0
        self.put_keys: list[str] = []

    async def put(self, key: str, data: bytes, **kw: Any) -> str:
        if self.fail_puts > 0:
            self.fail_puts -= 1
            raise ObjectStoreUnavailable("the store is down (test)")
        self.put_keys.append(key)
        return await super().put(key, data, **kw)


def _committer(wal: WalEnv, s: Shipper) -> GroupCommitter:
    """A started committer logging to `s` (nothing else hooked)."""
    committer = GroupCommitter(wal, s.loop, on_abort=lambda: None, on_commit=lambda txn: None,
                               on_durable=lambda news: None, on_logged=s.on_logged)
    committer.start()
    return committer


@pytest.fixture
def objects(tmp_path: Path) -> FlakyStore:
    return FlakyStore(tmp_path / "objects")


@pytest.fixture
def wal(tmp_path: Path) -> Any:
    w = WalEnv(tmp_path / "wal", 64 * 1024 * 1024)
    yield w
    w.close()


async def test_gate_completes_only_after_the_upload(wal: WalEnv, objects: FlakyStore) -> None:
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    gate = s.on_logged(commit(1))
    gate2 = s.on_logged(commit(2))
    assert gate is not None and gate is gate2  # gathered while nothing was uploading: one gate
    assert not gate.done()
    assert await s.ship_once() == 2
    assert gate.done() and gate.exception() is None
    assert objects.put_keys == [segment_key(1, 2)]
    segment = decode(await objects.get(segment_key(1, 2)))
    assert [c.seq for c in segment.commits] == [1, 2]
    assert s.shipped_seq == 2 and s.queued == 0 and s.lag_seconds() == 0
    gate3 = s.on_logged(commit(3))
    assert gate3 is not None and gate3 is not gate and not gate3.done()
    assert await s.ship_once() == 1 and gate3.done()
    assert await s.ship_once() == 0


async def test_local_mode_has_no_gate(wal: WalEnv, objects: FlakyStore) -> None:
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="local", interval=0.1)
    assert s.on_logged(commit(1)) is None
    s.start()
    for _ in range(100):
        if s.shipped_seq == 1:
            break
        await asyncio.sleep(0.02)
    assert s.shipped_seq == 1 and objects.put_keys == [segment_key(1, 1)]
    await s.stop()


async def test_store_errors_fail_the_gate_after_bounded_retries_and_ship_later(
        wal: WalEnv, objects: FlakyStore) -> None:
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    objects.fail_puts = GATE_ATTEMPTS
    gate = s.on_logged(commit(1))
    assert gate is not None
    for i in range(GATE_ATTEMPTS):
        with pytest.raises(ObjectStoreUnavailable):
            await s.ship_once()
        assert gate.done() == (i == GATE_ATTEMPTS - 1)
    assert isinstance(gate.exception(), Unavailable)  # -> 503: nothing promised
    assert s.queued == 1  # still to ship: the commit is in the local WAL
    gate2 = s.on_logged(commit(2))  # while the store keeps failing: 503 at once, queued all the same
    assert gate2 is not None and isinstance(gate2.exception(), Unavailable) and s.queued == 2
    assert await s.ship_once() == 2  # the store is back: one segment with both
    gate3 = s.on_logged(commit(3))
    assert gate3 is not None and not gate3.done()  # and gates wait for uploads again
    assert await s.ship_once() == 1 and gate3.exception() is None
    assert s.upload_failures == GATE_ATTEMPTS and objects.put_keys == [segment_key(1, 2), segment_key(3, 3)]


class HangingStore(FlakyStore):
    """Log segment PUTs never answer while `hang` is set (a frozen server, a dropped route)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hang = True

    async def put(self, key: str, data: bytes, **kw: Any) -> str:
        if key.startswith("log/") and self.hang:
            await asyncio.sleep(3600)
        return await super().put(key, data, **kw)


async def test_a_store_that_hangs_fails_the_gate_as_one_that_refuses(
        wal: WalEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QA: a store that stopped answering (SIGSTOPped moto) never failed a segment PUT: a
    store-mode append waited until the lease lapsed, and the upload failures (and /readyz)
    said nothing. A PUT not answered within PUT_TIMEOUT_SECONDS counts as failed."""
    from ingester import segment_uploads

    monkeypatch.setattr(segment_uploads, "PUT_TIMEOUT_SECONDS", 0.2)
    objects = HangingStore(tmp_path / "objects")
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    s.start()
    try:
        gate = s.on_logged(commit(1))
        assert gate is not None
        with pytest.raises(Unavailable):  # 503: after GATE_ATTEMPTS timed-out PUTs
            await asyncio.wait_for(asyncio.wrap_future(gate), 10)
        assert s.upload_failures >= GATE_ATTEMPTS
        objects.hang = False  # the store answers again: the commit ships
        deadline = time.monotonic() + 10
        while s.shipped_seq < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        await s.stop()


async def test_the_loop_backs_off_and_retries(wal: WalEnv, objects: FlakyStore) -> None:
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    objects.fail_puts = 2  # fewer than GATE_ATTEMPTS: the writes wait, then succeed
    s.start()
    gate = s.on_logged(commit(1))
    assert gate is not None
    await asyncio.wait_for(asyncio.wrap_future(gate), 5)
    assert s.upload_failures == 2 and s.shipped_seq == 1
    await s.stop()


async def test_reupload_is_harmless_and_a_foreign_segment_fences(wal: WalEnv, objects: FlakyStore) -> None:
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    # the same bytes already there (an upload whose answer was lost): done
    await objects.put(segment_key(1, 1), encode([commit(1)]))
    gate = s.on_logged(commit(1))
    assert await s.ship_once() == 1 and gate is not None and gate.exception() is None
    # other bytes under our key: another owner wrote it
    await objects.put(segment_key(2, 2), encode([commit(2, b"other")], epoch=7))
    gate = s.on_logged(commit(2))
    with pytest.raises(Superseded):
        await s.ship_once()
    s.fence("test")
    assert gate is not None and isinstance(gate.exception(), Superseded)
    later = s.on_logged(commit(3))
    assert later is not None and isinstance(later.exception(), Superseded)


async def test_a_superseded_owners_late_segment_under_our_key_is_replaced(
        tmp_path: Path, wal: WalEnv, objects: FlakyStore) -> None:
    """The old owner's upload of commit 2 (epoch 1), in flight when its lease lapsed, lands after
    we (epoch 2) restored to commit 1: our commit 2 has the same key. We are not superseded (it
    fenced itself before); its segment goes and ours takes the key, and a restore has ours."""
    await objects.put(segment_key(1, 1), encode([commit(1)], epoch=1))
    await objects.put(segment_key(2, 2), encode([commit(2, b"zombie")], epoch=1))
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store", ownership=HeldEpoch(2))  # type: ignore[arg-type]
    gate = s.on_logged(commit(2, b"ours"))
    assert await s.ship_once() == 1 and gate is not None and gate.exception() is None
    assert await restored_keys(objects, tmp_path / "restored") == (2, [b"k1", b"ours2"])


async def test_a_superseded_owners_late_segment_past_our_end_is_not_a_log_ahead(
        tmp_path: Path, wal: WalEnv, objects: FlakyStore) -> None:
    """Our WAL ends at commit 2 (ours, epoch 2); a superseded owner's late re-cut segment of
    epoch 1 reaches to commit 4. No restore takes its 3 and 4 (the chain holds commit 2 under
    epoch 2), so it is no log ahead of ours: a restart must not refuse (StoreAhead), and the
    segment goes."""
    await objects.put(segment_key(1, 2), encode([commit(1), commit(2)], epoch=2))
    await objects.put(segment_key(2, 4), encode([commit(2, b"old"), commit(3, b"old"), commit(4, b"old")], epoch=1))
    replay(wal, [commit(1), commit(2)])
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="local")
    await s.prepare(2)
    assert s.shipped_seq == 2
    assert segment_key(2, 4) not in [r.key for r in (await list_log(objects)).segments]
    # another owner's (a higher epoch) past our end is still a log ahead of ours
    await objects.put(segment_key(3, 3), encode([commit(3, b"new")], epoch=3))
    with pytest.raises(StoreAhead):
        await s.prepare(2)


class HeldEpoch:
    """The ownership as the shipper asks it: our epoch now (a lease taken back: the next)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def check(self) -> int:
        return self.epoch

    def valid(self) -> bool:
        return True


async def test_our_own_segment_of_an_earlier_epoch_is_not_another_owners(wal: WalEnv, objects: FlakyStore) -> None:
    """An upload in flight when the lease lapsed lands after the fence (the local store's
    thread goes on); the lease taken back (epoch + 1) cuts the same commits again. The segment
    there is ours, under an epoch this process held: shipping goes on. It stopped for good
    ("not ours (another owner wrote it)"), and with it every later write (found by QA: one
    SIGSTOP of 11 s, one time in three)."""
    own = HeldEpoch(1)
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store", ownership=own)  # type: ignore[arg-type]
    s.on_logged(commit(1))
    assert await s.ship_once() == 1  # under epoch 1
    await objects.put(segment_key(2, 2), encode([commit(2)], epoch=1))  # the late landing
    own.epoch = 2
    gate = s.on_logged(commit(2))
    assert await s.ship_once() == 1 and gate is not None and gate.exception() is None
    # the same commits under an epoch we never held: another owner's
    await objects.put(segment_key(3, 3), encode([commit(3)], epoch=5))
    s.on_logged(commit(3))
    with pytest.raises(Superseded):
        await s.ship_once()


async def test_other_commits_under_our_earlier_epoch_fence(wal: WalEnv, objects: FlakyStore) -> None:
    own = HeldEpoch(1)
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store", ownership=own)  # type: ignore[arg-type]
    s.on_logged(commit(1))
    assert await s.ship_once() == 1
    await objects.put(segment_key(2, 2), encode([commit(2, b"other")], epoch=1))
    own.epoch = 2
    s.on_logged(commit(2))
    with pytest.raises(Superseded):
        await s.ship_once()


async def test_a_fenced_owner_uploads_nothing(wal: WalEnv, objects: FlakyStore) -> None:
    own = Ownership(objects, "me", lease_seconds=5)
    await own.acquire()
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store", ownership=own)
    s.on_logged(commit(1))
    assert await s.ship_once() == 1
    assert decode(await objects.get(segment_key(1, 1))).epoch == 1
    await own.release()  # fenced from here on
    gate = s.on_logged(commit(2))
    with pytest.raises(Superseded):
        await s.ship_once()
    assert segment_key(2, 2) not in objects.put_keys
    assert gate is not None and not gate.done()  # the service fences the shipper (fails it) next
    s.fence("released")
    assert isinstance(gate.exception(), Superseded)


async def test_checkpoint_covers_and_deletes_then_restore(tmp_path: Path, objects: FlakyStore) -> None:
    wal = WalEnv(tmp_path / "wal", 64 * 1024 * 1024)
    loop = asyncio.get_running_loop()
    s = Shipper(wal, objects, loop, durability="local", interval=3600)
    committer = GroupCommitter(wal, loop, on_abort=lambda: None, on_commit=lambda txn: None,
                               on_durable=lambda news: None, on_logged=s.on_logged)
    committer.start()
    try:
        await s.prepare(committer.seq)  # no checkpoint in the store yet: one at 0
        assert (await list_log(objects)).checkpoints[0][0] == 0

        async def put(i: int) -> None:
            await committer.submit(lambda txn: txn.put(b"s%03d" % i, b"x" * 100, db=wal.streams))

        for i in range(5):
            await put(i)
        assert await s.ship_once() == 5
        for i in range(5, 8):
            await put(i)
        assert await s.ship_once() == 3
        assert [r.key for r in (await list_log(objects)).segments] == [segment_key(1, 5), segment_key(6, 8)]
        assert await s.checkpoint() == 8
        listing = await list_log(objects)
        assert [c[0] for c in listing.checkpoints] == [8] and listing.segments == []  # covered: deleted
        for i in range(8, 12):
            await put(i)
        await s.ship_once()
        before = dump(wal)
        # a restart with the local WAL ahead of the store: StoreAhead is for the other way round
        with pytest.raises(StoreAhead):
            await s.prepare(3)
    finally:
        await loop.run_in_executor(None, committer.stop)
        wal.close()
    assert await restore(objects, tmp_path / "restored", 64 * 1024 * 1024) == 12
    again = WalEnv(tmp_path / "restored", 64 * 1024 * 1024)
    try:
        assert dump(again) == before
    finally:
        again.close()


async def test_restore_refuses_a_gap(tmp_path: Path, objects: FlakyStore) -> None:
    """More segments after a missing one than failed pipelined uploads could leave: a gap."""
    await objects.put(segment_key(1, 1), encode([commit(1)]))
    for i in range(3, 3 + ORPHANS_MAX + 1):
        await objects.put(segment_key(i, i), encode([commit(i)]))
    with pytest.raises(RestoreError, match="gap: no segment holds commit 2"):
        await restore(objects, tmp_path / "restored", 64 * 1024 * 1024)
    assert not (tmp_path / "restored").exists()  # nothing half-restored left behind


async def test_restore_ends_the_log_at_a_hole_and_deletes_the_orphans(tmp_path: Path, objects: FlakyStore) -> None:
    """Uploads in flight: segment 2 failed, 3 and 4 landed (never acknowledged). The log ends
    at 1; the orphans go, so that the next owner's segments 2.. cannot collide with them."""
    await objects.put(segment_key(1, 1), encode([commit(1)], epoch=1))
    await objects.put(segment_key(3, 3), encode([commit(3)], epoch=1))
    await objects.put(segment_key(4, 5), encode([commit(4), commit(5)], epoch=1))
    await objects.put(segment_key(6, 6), encode([commit(6)], epoch=0))  # an older owner's late write
    assert await restore(objects, tmp_path / "r", 64 * 1024 * 1024) == 1
    assert [r.key for r in (await list_log(objects)).segments] == [segment_key(1, 1)]


async def logged_burst(s: Shipper, seqs: range, spacing: float) -> None:
    """Log commits `seqs`, one every `spacing` seconds, and wait until every one is acknowledged."""
    gates = []
    for i in seqs:
        gates.append(s.on_logged(commit(i)))
        await asyncio.sleep(spacing)
    await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(g) for g in gates if g)), 10)


class SlowStore(FlakyStore):
    """PUTs of log segments take `delay` seconds; the one under `fail_key` fails once."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.delay = 0.1
        self.fail_key = ""
        self.in_flight = 0
        self.most_in_flight = 0

    async def put(self, key: str, data: bytes, **kw: Any) -> str:
        if not key.startswith("log/"):
            return await super().put(key, data, **kw)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if key == self.fail_key:
                self.fail_key = ""
                raise ObjectStoreUnavailable("the store is down (test)")
            return await super().put(key, data, **kw)
        finally:
            self.in_flight -= 1


async def test_uploads_in_flight_acknowledge_in_commit_order(tmp_path: Path, wal: WalEnv) -> None:
    objects = SlowStore(tmp_path / "objects")
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    s._segments.put_seconds = objects.delay  # a far store (a near one gets one upload at a time)
    s.start()
    try:
        gates = []
        for i in range(1, 7):
            gates.append(s.on_logged(commit(i)))
            await asyncio.sleep(0.03)  # each commit while the previous PUTs are in flight (> HOLD_MAX apart)
        order: list[int] = []
        def note(i: int) -> Callable[[ConcurrentFuture[None]], None]:
            def done(_: ConcurrentFuture[None]) -> None:
                order.append(i)
            return done

        for i, g in enumerate(gates):
            assert g is not None
            g.add_done_callback(note(i))
        await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(g) for g in gates if g)), 5)
        assert order == sorted(order) and objects.most_in_flight > 1
        # a failed PUT in the middle: the ones after it wait, everything from it is cut again
        objects.fail_key = segment_key(8, 8)
        more = []
        for i in range(7, 12):
            more.append(s.on_logged(commit(i)))
            await asyncio.sleep(0.03)
        await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(g) for g in more if g)), 10)
        assert s.upload_failures == 1 and s.shipped_seq == 11
    finally:
        await s.stop()
    # the log restores every commit (overlapping re-cut segments are harmless)
    assert await restore(objects, tmp_path / "r", 64 * 1024 * 1024) == 11


async def test_commits_arriving_while_uploads_are_in_flight_share_segments(tmp_path: Path, wal: WalEnv) -> None:
    """With a segment PUT in flight, the next segment waits a share of a PUT's recent latency
    for more commits to join it (each PUT costs CPU on both sides, and money on S3), while a
    commit with nothing in flight goes at once. Before, each commit went alone while fewer than
    `--log-uploads` PUTs were in flight: 4 segments of one commit each at every burst."""
    objects = SlowStore(tmp_path / "objects")
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    s.start()
    try:
        for i in range(1, 4):  # one at a time: each alone, and the PUT's latency is learnt
            gate = s.on_logged(commit(i))
            assert gate is not None
            await asyncio.wait_for(asyncio.wrap_future(gate), 5)
        await logged_burst(s, range(4, 34), 0.002)  # a burst: a commit every 2 ms while PUTs take 100 ms
        assert s.shipped_seq == 33
    finally:
        await s.stop()
    spans = [(ref.first, ref.last) for ref in (await list_log(objects)).segments]
    assert spans[:4] == [(1, 1), (2, 2), (3, 3), (4, 4)]  # nothing in flight: at once, alone
    burst = spans[4:]
    assert all(last - first >= 1 for first, last in burst), spans  # the rest in shared segments
    assert len(burst) <= 10 and objects.most_in_flight > 1, spans
    assert await restore(objects, tmp_path / "r", 64 * 1024 * 1024) == 33


async def test_a_near_store_gets_one_upload_at_a_time(tmp_path: Path, wal: WalEnv) -> None:
    """A store that answers a PUT within NEAR_PUT_SECONDS (a local directory, MinIO or moto near
    by) gets one segment upload at a time, whatever --log-uploads: the commits gather while the
    PUT before runs, in fewer, larger segments (4 in flight cost about twice the CPU per append
    on both sides, for no more appends/s: docs/bench.md). A store further away gets up to
    --log-uploads (the tests above: 100 ms PUTs, more than one in flight)."""
    objects = SlowStore(tmp_path / "objects")
    objects.delay = 0.002
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store", uploads=4)
    s.start()
    try:
        await logged_burst(s, range(1, 61), 0.0005)  # a commit every 0.5 ms: several arrive during each PUT
        assert s.shipped_seq == 60
    finally:
        await s.stop()
    assert objects.most_in_flight == 1
    spans = [(ref.first, ref.last) for ref in (await list_log(objects)).segments]
    assert len(spans) < 40, spans  # shared segments
    assert await restore(objects, tmp_path / "r", 64 * 1024 * 1024) == 60


async def restored_keys(objects: FlakyStore, path: Path) -> tuple[int, list[bytes]]:
    """A restore of the log into `path`: the seq it reached and the keys of the streams database."""
    seq = await restore(objects, path, 64 * 1024 * 1024)
    w = WalEnv(path, 64 * 1024 * 1024)
    try:
        return seq, [k for k, _ in dump(w)["streams"]]
    finally:
        w.close()


async def test_restore_prefers_the_newer_epoch(tmp_path: Path, objects: FlakyStore) -> None:
    """A superseded owner's late segment (epoch 1) loses to the new owner's (epoch 2)."""
    await objects.put(segment_key(1, 1), encode([commit(1)], epoch=1))
    await objects.put(segment_key(2, 3), encode([commit(2, b"old"), commit(3, b"old")], epoch=1))
    await objects.put(segment_key(2, 2), encode([commit(2, b"new")], epoch=2))
    assert await restored_keys(objects, tmp_path / "r") == (2, [b"k1", b"new2"])


async def test_restore_takes_the_newer_epoch_at_every_commit_it_holds(tmp_path: Path, objects: FlakyStore) -> None:
    """A superseded owner's late re-cut segment (epoch 1, commits 1-3: its upload of commit 1
    landed but the answer was lost, and the re-cut arrived after the takeover) reaches past
    where the new owner (epoch 2) restored to. The new owner's commits 2 and 3 win: choosing
    the old segment for commit 1 must not carry its 2 and 3 along."""
    await objects.put(segment_key(1, 1), encode([commit(1)], epoch=1))
    await objects.put(segment_key(2, 2), encode([commit(2, b"new")], epoch=2))
    await objects.put(segment_key(3, 3), encode([commit(3, b"new")], epoch=2))
    await objects.put(segment_key(1, 3), encode([commit(1), commit(2, b"old"), commit(3, b"old")], epoch=1))
    assert await restored_keys(objects, tmp_path / "r") == (3, [b"k1", b"new2", b"new3"])


async def test_a_full_queue_is_dropped_for_a_checkpoint(
        tmp_path: Path, wal: WalEnv, objects: FlakyStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipper_mod, "MAX_QUEUED_BYTES", 10)
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    objects.fail_puts = 1
    gate: ConcurrentFuture[None] | None = s.on_logged(commit(1))
    with pytest.raises(ObjectStoreUnavailable):
        await s.ship_once()
    assert await s.checkpoint() == 0  # this WAL never saw commit 1: the copy says 0
    assert s.queued == 0 and gate is not None and isinstance(gate.exception(), Unavailable)


async def test_the_loop_checkpoints_periodically(tmp_path: Path, objects: FlakyStore) -> None:
    wal = WalEnv(tmp_path / "wal", 64 * 1024 * 1024)
    loop = asyncio.get_running_loop()
    s = Shipper(wal, objects, loop, durability="local", interval=0.05, checkpoint_interval=0.3)
    committer = GroupCommitter(wal, loop, on_abort=lambda: None, on_commit=lambda txn: None,
                               on_durable=lambda news: None, on_logged=s.on_logged)
    committer.start()
    try:
        await s.prepare(committer.seq)
        s.start()
        for i in range(3):
            await committer.submit(lambda txn, i=i: txn.put(b"s%d" % i, b"x", db=wal.streams))
        for _ in range(100):
            listing = await list_log(objects)  # (what it covers is deleted after the upload)
            # (the count too: the shipper counts a deletion once the store's answer is back,
            # which may be after the listing already shows it gone)
            if s.last_checkpoint_seq == 3 and len(listing.checkpoints) == 1 and not listing.segments \
                    and s.objects_deleted >= 2:
                break
            await asyncio.sleep(0.05)
        assert [c[0] for c in listing.checkpoints] == [3] and listing.segments == []
        assert s.checkpoints_uploaded == 2 and s.objects_deleted >= 2  # the one at start, then this
    finally:
        await s.stop()
        await loop.run_in_executor(None, committer.stop)
        wal.close()


async def test_resume_after_a_fence_checkpoints_what_the_log_missed(tmp_path: Path, objects: FlakyStore) -> None:
    wal = WalEnv(tmp_path / "wal", 64 * 1024 * 1024)
    loop = asyncio.get_running_loop()
    s = Shipper(wal, objects, loop, durability="store")
    committer = _committer(wal, s)
    try:
        await s.prepare(committer.seq)
        s.start()
        await committer.submit(lambda txn: txn.put(b"a", b"1", db=wal.streams))
        s.fence("lease lapsed (test)")
        with pytest.raises(Unavailable):  # its gate failed: answered 503, but committed locally
            await committer.submit(lambda txn: txn.put(b"b", b"2", db=wal.streams))
        assert s.shipped_seq == 1 and committer.seq == 2
        await s.resume(committer.seq)
        assert s.last_checkpoint_seq == 2 and s.shipped_seq == 2  # commit 2 is in the store now
        await committer.submit(lambda txn: txn.put(b"c", b"3", db=wal.streams))
        assert s.shipped_seq == 3
        before = dump(wal)
    finally:
        await s.stop()
        await loop.run_in_executor(None, committer.stop)
        wal.close()
    assert await restore(objects, tmp_path / "restored", 64 * 1024 * 1024) == 3
    again = WalEnv(tmp_path / "restored", 64 * 1024 * 1024)
    try:
        assert dump(again) == before
    finally:
        again.close()


# --- store mode: the segment is uploaded while LMDB commits (before_commit) ------------------


class _Commits:
    """An LMDB environment whose write transactions' commits can be held (until `release` is
    set) or fail (the first `fail` of them, as with EIO from fdatasync: LMDB aborts the
    transaction, nothing it did is stored)."""

    def __init__(self, env: Any, fail: int = 0) -> None:
        self._env = env
        self.fail = fail
        self.release = threading.Event()
        self.release.set()
        self.holding = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, write: bool = False, **kw: Any) -> Any:
        txn = self._env.begin(write=write, **kw)
        return _HeldCommit(txn, self) if write else txn


class _HeldCommit:
    def __init__(self, txn: Any, env: _Commits) -> None:
        self.txn, self.env = txn, env

    def __enter__(self) -> Any:
        return self.txn

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.txn.abort()
            return
        self.env.holding.set()
        self.env.release.wait(10)
        if self.env.fail > 0:
            self.env.fail -= 1
            self.txn.abort()
            raise lmdb.DiskError("injected: the commit failed")
        self.txn.commit()


async def _early_setup(tmp_path: Path, objects: FlakyStore, env_fail: int = 0) -> tuple[WalEnv, Shipper, GroupCommitter,
                                                                                       _Commits]:
    wal = WalEnv(tmp_path / "wal", 64 * 1024 * 1024)
    loop = asyncio.get_running_loop()
    s = Shipper(wal, objects, loop, durability="store")
    committer = GroupCommitter(wal, loop, on_abort=lambda: None, on_commit=lambda txn: None,
                               on_durable=lambda news: None, on_logged=s.on_logged)
    committer.start()
    await s.prepare(committer.seq)
    s.start()
    held = _Commits(wal.env, env_fail)
    wal.env = held  # type: ignore[assignment]
    return wal, s, committer, held


async def _teardown(wal: WalEnv, s: Shipper, committer: GroupCommitter, held: _Commits) -> None:
    held.release.set()
    await s.stop()
    await asyncio.get_running_loop().run_in_executor(None, committer.stop)
    wal.env = held._env
    wal.close()


async def test_store_mode_uploads_the_segment_while_lmdb_commits(tmp_path: Path, objects: FlakyStore) -> None:
    """The segment of a commit is in the store before LMDB's commit returns (the two run at
    once); the write is acknowledged only once both are done."""
    wal, s, committer, held = await _early_setup(tmp_path, objects)
    try:
        held.release.clear()
        fut = committer.submit(lambda txn: txn.put(b"a", b"1", db=wal.streams))
        await asyncio.get_running_loop().run_in_executor(None, held.holding.wait, 5)
        for _ in range(200):  # the PUT lands while the commit is held
            if s.shipped_seq == 1:
                break
            await asyncio.sleep(0.01)
        assert segment_key(1, 1) in objects.put_keys and s.shipped_seq == 1
        await asyncio.sleep(0.05)
        assert not fut.done()  # not acknowledged: LMDB has not committed it yet
        held.release.set()
        await asyncio.wait_for(fut, 5)
        assert committer.seq == 1 and s.early_commits == 1
        with wal.env.begin() as txn:
            assert txn.get(b"a", db=wal.streams) == b"1"
    finally:
        await _teardown(wal, s, committer, held)


async def test_a_commit_failing_after_its_upload_began_is_applied_again(tmp_path: Path, objects: FlakyStore) -> None:
    """LMDB fails to commit a write-set the log already took: the committer writes the same
    write-set again, the write is acknowledged, and the WAL matches the log."""
    wal, s, committer, held = await _early_setup(tmp_path, objects, env_fail=1)
    try:
        await asyncio.wait_for(committer.submit(lambda txn: txn.put(b"a", b"1", db=wal.streams)), 5)
        await asyncio.wait_for(committer.submit(lambda txn: txn.put(b"b", b"2", db=wal.streams)), 5)
        assert committer.recommits == 1 and committer.seq == 2 and not s.fenced
        wal.env = held._env
        restored = tmp_path / "restored"
        assert await restore(objects, restored, 64 * 1024 * 1024) == 2
        again = WalEnv(restored, 64 * 1024 * 1024)
        try:
            assert dump(again) == dump(wal)
        finally:
            again.close()
    finally:
        await _teardown(wal, s, committer, held)


async def test_a_handed_over_commit_that_cannot_be_written_stops_acknowledging(
        tmp_path: Path, objects: FlakyStore) -> None:
    """The commit fails, and so does writing its write-set again: the log may hold a commit
    the WAL lacks, so the write answers 503, every later one too, and the shipper stops. A
    restart on that data dir finds the store's log ahead of its WAL and restores from the
    store (the commit's effect then shows: it was never acknowledged, as after any 503)."""
    wal, s, committer, held = await _early_setup(tmp_path, objects, env_fail=2)
    try:
        held.release.clear()  # the commit fails only once its segment landed
        fut = committer.submit(lambda txn: txn.put(b"a", b"1", db=wal.streams))
        for _ in range(200):
            if s.shipped_seq == 1:
                break
            await asyncio.sleep(0.01)
        held.release.set()
        with pytest.raises(Unavailable) as e:
            await asyncio.wait_for(fut, 5)
        assert "acknowledges nothing more" in e.value.message
        with pytest.raises(Unavailable):
            committer.submit(lambda txn: txn.put(b"b", b"2", db=wal.streams))
        for _ in range(100):
            if s.fenced:
                break
            await asyncio.sleep(0.01)
        assert s.fenced and committer.seq == 0
    finally:
        await _teardown(wal, s, committer, held)
    # The segment of commit 1 landed (the shipper began before LMDB failed): the log is ahead.
    assert (await list_log(objects)).shipped_seq == 1
    wal_dir = tmp_path / "wal"
    assert await drop_wal_behind_log(objects, wal_dir, 64 * 1024 * 1024)
    assert not wal_dir.exists()
    assert await restore(objects, wal_dir, 64 * 1024 * 1024) == 1
    w = WalEnv(wal_dir, 64 * 1024 * 1024)
    try:
        assert [k for k, _ in dump(w)["streams"]] == [b"a"]
    finally:
        w.close()
    assert not await drop_wal_behind_log(objects, wal_dir, 64 * 1024 * 1024)  # caught up: kept


async def test_a_commit_whose_segment_landed_while_lmdb_synced_needs_our_lease_still(
        wal: WalEnv, objects: FlakyStore) -> None:
    """Handed over before its LMDB commit, a commit's segment may land first: it is
    acknowledged when LMDB returns, no gate, but only if the lease still holds then (a process
    frozen during the fsync must not answer once another ingester may own the prefix)."""
    own = Ownership(objects, "me", lease_seconds=5)
    await own.acquire()
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store", ownership=own)
    assert s.before_commit(commit(1)) and s.before_commit(commit(2))
    assert await s.ship_once() == 2 and s.shipped_seq == 2
    assert s.on_logged(commit(1)) is None  # landed, lease held: deliver now
    await own.release()  # our lease is over from here on
    late = s.on_logged(commit(2))
    assert late is not None and isinstance(late.exception(), Superseded)
    assert s.queued == 0 and objects.put_keys.count(segment_key(1, 2)) == 1  # queued once, not again


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The ship queue's monotonic clock, moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(ship_queue.time, "monotonic", lambda: now[0])
    return now


async def test_local_mode_stops_acknowledging_once_the_log_is_max_lag_behind(
        wal: WalEnv, objects: FlakyStore, clock: list[float]) -> None:
    """A store failing in local mode: commits are acknowledged (no gate) while the oldest one
    the store lacks is younger than max_lag, then answer 503 (queued all the same); once the
    store has them all, acknowledged again. What a lost disk takes stays within the bound."""
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="local", interval=0.5, max_lag=3.0)
    objects.fail_puts = 2
    assert s.on_logged(commit(1)) is None
    clock[0] += 2.9
    assert s.on_logged(commit(2)) is None  # 2.9 s behind: within the bound
    with pytest.raises(ObjectStoreUnavailable):
        await s.ship_once()
    clock[0] += 0.2
    gate = s.on_logged(commit(3))
    assert gate is not None and isinstance(gate.exception(), Unavailable)
    assert "3.1 s behind (--max-ship-lag 3 s)" in str(gate.exception())
    assert s.queued == 3 and s.lag_seconds() == pytest.approx(3.1)
    with pytest.raises(ObjectStoreUnavailable):
        await s.ship_once()
    assert await s.ship_once() == 3  # the store is back: everything in one segment
    assert s.lag_seconds() == 0 and s.on_logged(commit(4)) is None
    # no bound (0): acknowledged however far behind
    unbounded = Shipper(wal, objects, asyncio.get_running_loop(), durability="local", max_lag=0.0)
    assert unbounded.on_logged(commit(5)) is None
    clock[0] += 3600
    assert unbounded.on_logged(commit(6)) is None and unbounded.lag_seconds() == pytest.approx(3600)


@pytest.mark.parametrize(("steps", "lag"), [
    # (what happens to the queue, in order), the lag after it (commit n arrives at second n)
    (["append 1", "append 2", "append 3"], 9.0),  # now is second 10: the oldest arrived at 1
    (["append 1", "append 2", "advance 1"], 8.0),  # the oldest left arrived at 2 (not "now")
    (["append 1", "append 2", "advance 2"], 0.0),
    (["append 1", "drop", "append 3"], 9.0),  # dropped for a checkpoint: not in the store yet
    (["append 1", "drop", "append 3", "advance 3"], 0.0),  # the checkpoint covers them
    (["append 1", "append 2", "drop", "advance 1"], 9.0),  # a segment of 1 landed; 2 waits for the checkpoint
    (["append 1", "drop", "advance 1", "append 4"], 6.0),
])
def test_the_lag_counts_from_the_oldest_commit_the_store_lacks(
        steps: list[str], lag: float, clock: list[float]) -> None:
    q = ShipQueue()
    for step in steps:
        op, _, arg = step.partition(" ")
        if op == "append":
            clock[0] = float(arg)
            q.append(commit(int(arg)))
        elif op == "advance":
            q.advance(int(arg))
        else:
            q.drop(lambda: Unavailable("dropped"))
    assert q.lag_seconds(now=10.0) == lag


async def test_an_outcome_that_committed_nothing_waits_for_the_commit_it_relies_on(
        wal: WalEnv, objects: FlakyStore, clock: list[float]) -> None:
    """A producer's retry of an append refused with 503 is a duplicate: its batch commits
    nothing. It was acknowledged (204) at once though the store still lacked the append, and a
    lost disk then lost it. Now it gets what an outcome of the last commit would: in store mode
    503 while uploads fail, a gate until a segment covers the commit, nothing once it is in."""
    s = Shipper(wal, objects, asyncio.get_running_loop(), durability="store")
    hook = s.on_logged
    objects.fail_puts = GATE_ATTEMPTS
    gate = hook(commit(1))
    for _ in range(GATE_ATTEMPTS):
        with pytest.raises(ObjectStoreUnavailable):
            await s.ship_once()
    assert gate is not None and isinstance(gate.exception(), Unavailable)  # the append: 503
    retry = hook.caught_up(1)  # its retry, a duplicate: 503 too (it was a 204)
    assert retry is not None and isinstance(retry.exception(), Unavailable)
    s.failures_in_a_row = 0  # (as after a landed upload elsewhere: the store answers again)
    retry = hook.caught_up(1)
    assert retry is not None and not retry.done()  # waits for the segment holding commit 1
    assert await s.ship_once() == 1
    assert retry.done() and retry.exception() is None
    assert hook.caught_up(1) is None  # in the store: acknowledged at once
    # local mode: refused while the log is too far behind, as a new append would be
    local = Shipper(wal, objects, asyncio.get_running_loop(), durability="local", max_lag=3.0)
    objects.fail_puts = 1
    assert local.on_logged(commit(1)) is None
    clock[0] += 3.5
    refused = local.on_logged.caught_up(1)
    assert refused is not None and "--max-ship-lag" in str(refused.exception())
    with pytest.raises(ObjectStoreUnavailable):
        await local.ship_once()
    assert await local.ship_once() == 1 and local.on_logged.caught_up(1) is None


async def test_through_the_committer_after_a_restart(tmp_path: Path, objects: FlakyStore) -> None:
    """With a real committer in store mode: a batch that writes nothing is refused while the
    write it follows is refused, and answered once that is in the store; after a restart,
    what the store's log holds already needs no wait (a batch committing nothing answers at
    once, it does not wait for an upload that never comes)."""
    loop = asyncio.get_running_loop()
    for attempt in (1, 2):
        wal = WalEnv(tmp_path / "wal", 64 * 1024 * 1024)
        s = Shipper(wal, objects, loop, durability="store")
        committer = _committer(wal, s)
        try:
            await s.prepare(committer.seq)
            if attempt == 1:
                objects.fail_puts = 100
                s.start()
                with pytest.raises(Unavailable):  # the store is down: 503 (the WAL has it)
                    await committer.submit(lambda txn, db=wal.streams: txn.put(b"s1", b"x", db=db))
                with pytest.raises(Unavailable, match="did not reach the object store"):  # was: acknowledged
                    await committer.submit(lambda txn: "a duplicate")
                objects.fail_puts = 0  # the store is back: the retries are answered once it has the write
                for _ in range(200):
                    try:
                        assert await asyncio.wait_for(committer.submit(lambda txn: "a duplicate"), 10) == "a duplicate"
                        break
                    except Unavailable:
                        await asyncio.sleep(0.05)
                else:
                    pytest.fail("the retry was never acknowledged after the store came back")
                assert s.shipped_seq == committer.seq == 1
            else:
                assert committer.seq == 1 and s.queued == 0
                assert await asyncio.wait_for(committer.submit(lambda txn: "at once"), 2) == "at once"
        finally:
            await s.stop()
            await loop.run_in_executor(None, committer.stop)
            wal.close()


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_ship_lag": 0.5, "ship_interval": 1.0}, "between --ship-interval (1 s) and 86400"),
    ({"max_ship_lag": -1.0}, "must be 0 (no bound)"),
    ({"max_ship_lag": 3.0, "durability": "store"}, "applies only to --durability local with a --store"),
    ({"max_ship_lag": 3.0, "store": None}, "applies only to --durability local with a --store"),
])
def test_max_ship_lag_is_refused_by_name_where_it_cannot_apply(
        tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    from shared.config import ConfigError, IngesterConfig

    with pytest.raises(ConfigError, match="max-ship-lag") as e:
        IngesterConfig(**{"data_dir": tmp_path, "store": "file:///tmp/x", **kw})
    assert message in str(e.value)
    assert IngesterConfig(data_dir=tmp_path, store="file:///tmp/x").ship_lag_bound == 5.0
    assert IngesterConfig(data_dir=tmp_path, store="file:///tmp/x", ship_interval=4).ship_lag_bound == 12.0


@pytest.mark.parametrize(("args", "env", "said"), [
    (["--ship-interval", "2"], {}, "--ship-interval (DS3_SHIP_INTERVAL) is ignored: it applies only to "
                                   "--durability local with a --store (here: no --store)"),
    (["--store", "STORE", "--durability", "store"], {"DS3_SHIP_INTERVAL": "2"},
     "--ship-interval (DS3_SHIP_INTERVAL) is ignored: it applies only to --durability local with a --store "
     "(here: --durability store)"),
    (["--store", "STORE", "--log-uploads", "2"], {}, "--log-uploads (DS3_LOG_UPLOADS) is ignored"),
    (["--store", "STORE", "--ship-interval", "2"], {}, None),
])
def test_a_log_setting_that_cannot_apply_is_named_at_start(
        tmp_path: Path, args: list[str], env: dict[str, str], said: str | None) -> None:
    """A --ship-interval given to an ingester in store mode (or without a store) used to be
    taken silently: the user believed it shaped what a lost disk loses."""
    from tests import procs

    p = procs.ingester(tmp_path / "d", *[a.replace("STORE", (tmp_path / "s").as_uri()) for a in args])
    p.env.update(env)
    p.start()
    p.stop()
    log = p.log_path.read_text()
    if said is None:
        assert "is ignored" not in log, log
    else:
        assert log.count(said) == 1, log
