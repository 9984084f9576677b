"""Replaying the commit log (ingester/replay.py): a realistic sequence of writes through the
real store operations, its commits captured by the on_logged hook, replayed into an empty
WAL, must give every database byte for byte: after the whole log, after every commit, after
a prefix and then the rest, through encoded segments, and twice over."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lmdb
import pytest

from ingester import retention
from ingester.journal import FOLD_RECORDS
from ingester.listing import _cursor_secret
from ingester.records import ChunkRef
from ingester.replay import ReplayGap, replay
from ingester.store_sealing import descriptor_of
from ingester.wal import WalEnv
from ingester.writes import AppendRequest, SealPolicy
from shared import keys, offsets
from shared.buckets import internal_path
from shared.config import MiB
from shared.errors import Conflict, ProducerSeqGap, StaleProducerEpoch, Unavailable
from shared.logsegment import DB_IDS, DELETE, FOLD, PUT, Commit, decode, encode
from tests.wal_harness import JSON, TEXT, Clock, Harness, ShadowLog, dump, fork

Dump = dict[str, list[tuple[bytes, bytes]]]


class Recorder(ShadowLog):
    """Keeps every commit and the WAL's databases right after it (the hook runs on the writer
    thread before the next batch starts, so a read sees exactly that commit)."""

    def __init__(self) -> None:
        super().__init__()
        self.wal: WalEnv | None = None
        self.states: list[Dump] = []

    def __call__(self, commit: Commit) -> None:
        super().__call__(commit)
        assert self.wal is not None
        self.states.append(dump(self.wal))


def rolled(h: Harness, path: str | None = None) -> list[ChunkRef]:
    """Chunks rolled so far (on_durable runs on the loop: let it)."""
    h.loop.run_until_complete(asyncio.sleep(0))
    return [ref for news in h.durable for ref in news.rolled if path is None or ref.path == path]


def scenario(h: Harness, clock: Clock) -> None:
    """Every kind of write the store makes: creates, appends (journaled and direct), producers,
    Stream-Seq, close, TTL, touches, expiry, journal folds, rolled and sealed chunks, published
    descriptors, forks and soft deletes, deletes and re-creates, buckets, snapshots and their
    garbage, the listing secret, and batches with refused and broken operations."""
    h.create("a")
    h.append("a", b"hello ")
    h.append("a", b"world", seq="001")
    h.create("j", JSON, body=b"[1,2]")
    h.append("j", b'[{"x":1},"y"]', JSON)
    h.create("big")
    h.append("big", b"B" * 5000)  # larger than a journal entry: straight to records
    h.append("big", b"small")
    h.append("big", b"C" * 3000)  # folds the stream's journal first
    # idempotent producers
    h.create("p")
    h.append("p", b"0", producer=("w", 0, 0))
    h.append("p", b"1", producer=("w", 0, 1))
    h.append("p", b"1", producer=("w", 0, 1))  # duplicate: no write
    with pytest.raises(ProducerSeqGap):
        h.append("p", b"3", producer=("w", 0, 3))
    h.append("p", b"e1", producer=("w", 1, 0))
    with pytest.raises(StaleProducerEpoch):
        h.append("p", b"old", producer=("w", 0, 2))
    h.append("p", b"last", producer=("w", 1, 1), close=True)
    h.append("a", b"", close=True)
    # TTLs, renewals, expiry
    h.create("t", ttl=10)
    h.append("t", b"x")
    h.create("t2", ttl=1000)
    clock.now += 5
    h.store.touches["t2"] = clock.now
    h.run(h.store.fold_touches)
    clock.now += 100
    h.run(h.store.sweep_expired)
    h.create("t")  # the expired path, created again
    # a journal fold in one batch
    h.create("bulk")
    req = AppendRequest("bulk", TEXT, b"m", None)
    h.run(lambda txn: [h.store.append(txn, req) for _ in range(FOLD_RECORDS + 10)])
    # sealing: chunks rolled above (8-byte seals) are confirmed, descriptors published
    refs = rolled(h)
    assert len(refs) > 3
    for ref in refs[: len(refs) // 2]:
        h.run(partial(h.store.mark_sealed, ref=ref))
    sealed = sorted({ref.sid for ref in refs[: len(refs) // 2]})
    h.run(partial(h.store.drop_sealed_records, sid=sealed[0], limit=2))  # one stream's: partly dropped
    for sid in sealed[1:]:  # the others' in steps of two
        while h.run(partial(h.store.drop_sealed_records, sid=sid, limit=2)):
            pass
    for path in ("a", "j"):  # (written as the streams are now: their marks go)
        meta = h.meta(path)
        assert h.run(partial(h.store.published, path=path, written=None if meta is None else descriptor_of(meta)))
    h.run(h.store.seal_aged)
    # forks: the source deleted while the fork reads it (soft), then the fork (both go)
    h.create("src")
    src = h.append("src", b"abcdefghij")
    fork(h, "f", "src", offset=src.stream.tail_offset)
    h.append("f", b"fork's own")
    h.delete("src")
    with pytest.raises(Conflict):
        h.create("src")
    h.delete("f")
    for uid, _path in h.run(h.store.load_gc)[:2]:
        h.run(partial(h.store.gc_done, uid=uid))
    h.delete("big")
    h.create("big", JSON, body=b"[]")  # same path, new incarnation
    # buckets
    h.run(lambda txn: h.store.buckets.create(txn, "b1", clock.now))
    inner = internal_path("b1", "s1")
    h.create(inner)
    h.append(inner, b"in a bucket")

    def delete_bucket(txn: lmdb.Transaction) -> None:
        h.store.buckets.delete(txn, "b1", lambda path: h.store.expire_due(txn, path))

    with pytest.raises(Conflict):
        h.run(delete_bucket)
    h.create(internal_path("b1", "short"), ttl=1)
    clock.now += 2
    with pytest.raises(Conflict):
        h.run(delete_bucket)  # expires "short" (a write that stands), then refuses: s1 is there
    h.delete(inner)
    h.run(delete_bucket)
    # a snapshot of "bulk", making its sealed chunks garbage, then their deletion
    meta = h.meta("bulk")
    assert meta is not None
    tail = h.append("bulk", b"z", close=True).stream.tail_offset
    for ref in rolled(h, "bulk"):
        h.run(partial(h.store.mark_sealed, ref=ref))
        while h.run(partial(h.store.drop_sealed_records, sid=ref.sid)):
            pass
    snap = retention.SnapshotRequest("bulk", meta.sid, tail, offsets.parse(tail).position, JSON, 3,
                                     f"snapshots/{meta.uid[:2]}/{meta.uid}/{tail}.0000")
    assert h.run(partial(retention.publish, h.store, req=snap)) == []  # (no snapshot before it to retire)
    # the chunks it gave up, queued for the reaper (which gets them with the commit's news)
    garbage = [k for k in h.run(partial(retention.pending, h.store)) if k.startswith(keys.chunk_prefix(meta.uid))]
    assert garbage
    h.run(partial(retention.deleted, h.store, object_keys=garbage[:1]))
    # the listing cursor's secret
    h.run(partial(_cursor_secret, h.wal))
    # time goes by: last-append times folded in
    h.run(h.store.fold_last_writes)


async def broken_batch(h: Harness) -> None:
    """One batch with a broken operation (the batch runs again without it) and a refused one."""
    h.create("x")
    started, release = threading.Event(), threading.Event()

    def blocker(txn: lmdb.Transaction) -> None:
        started.set()
        release.wait(10)

    def append(body: bytes) -> Callable[[lmdb.Transaction], Any]:
        return lambda txn: h.store.append(txn, AppendRequest("x", TEXT, body, None))

    def broken(txn: lmdb.Transaction) -> None:
        h.store.append(txn, AppendRequest("x", TEXT, b"BROKEN", None))
        raise RuntimeError("bug")

    first = h.committer.submit(blocker)
    await asyncio.to_thread(started.wait, 10)
    futures = [h.committer.submit(op) for op in (append(b"1"), broken, append(b"2"))]
    futures.append(h.committer.submit(lambda txn: h.store.delete(txn, "never")))
    release.set()
    await first
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert isinstance(results[1], Unavailable)
    assert h.contents("x") == b"12"


PATHS = ("a", "j", "p", "t", "t2", "big", "bulk", "x", "src", "f", internal_path("b1", "s1"))


def reads(h: Harness) -> dict[str, str]:
    """What a catch-up read from the start of each stream answers (messages in the WAL, or
    the sealed chunk to fetch, or the refusal)."""
    out: dict[str, str] = {}
    for path in PATHS:
        try:
            res = h.reads.read_sync(path, offsets.START, 1 << 20)
            meta = dataclasses.replace(res.meta, chunk_opened_at=None)  # set from the reader's clock
            out[path] = repr((res.messages, res.next_offset, res.sealed, meta))
        except Exception as e:
            out[path] = repr(e)
    return out


def record(tmp_path: Path) -> tuple[Recorder, Dump, dict[str, str]]:
    """Run the scenario on a logging WAL: (its commits and states, its final databases, the
    streams' contents)."""
    clock = Clock()
    rec = Recorder()
    loop = asyncio.new_event_loop()
    h = Harness(tmp_path / "original", clock, loop=loop, seal=SealPolicy(8, 3600, 1 << 30), on_logged=rec)
    rec.wal = h.wal
    try:
        scenario(h, clock)
        loop.run_until_complete(broken_batch(h))
        contents = reads(h)
        final = dump(h.wal)
    finally:
        h.close()
        loop.close()
    return rec, final, contents


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Recorder, Dump, dict[str, str]]:
    return record(tmp_path_factory.mktemp("replay"))


def test_the_scenario_touches_every_database(recorded: tuple[Recorder, Dump, dict[str, str]]) -> None:
    rec, final, _ = recorded
    written = {db for c in rec.commits for db, _op, _k, _v in c.writes}
    assert written == set(DB_IDS.values())
    ops = {op for c in rec.commits for _db, op, _k, _v in c.writes}
    assert ops == {PUT, DELETE, FOLD}  # puts, deletes, and the journal's folds
    assert [c.seq for c in rec.commits] == list(range(1, len(rec.commits) + 1))
    assert all(any(state[name] for state in rec.states) for name in DB_IDS)  # each held data at some point
    assert all(final[name] for name in ("streams", "journal", "jtail", "producers", "chunks", "sys"))


def test_replay_from_empty_gives_every_database(tmp_path: Path, recorded: tuple[Recorder, Dump, dict[str, str]]) -> None:
    rec, final, contents = recorded
    wal = WalEnv(tmp_path / "replayed", 64 * MiB)
    try:
        assert replay(wal, rec.commits) == len(rec.commits)
        assert dump(wal) == final
        assert replay(wal, rec.commits) == 0  # everything again: skipped, nothing changes
        assert dump(wal) == final
    finally:
        wal.close()
    # and the replayed WAL serves the same streams, and takes writes from the next seq on
    again = Harness(tmp_path / "replayed", Clock(), on_logged=ShadowLog())
    try:
        assert reads(again) == contents
        assert again.committer.seq == len(rec.commits)
        again.append("x", b"3")
        assert again.committer.seq == len(rec.commits) + 1
    finally:
        again.close()


def test_every_commit_reproduces_its_state(tmp_path: Path, recorded: tuple[Recorder, Dump, dict[str, str]]) -> None:
    rec, _, _ = recorded
    wal = WalEnv(tmp_path / "replayed", 64 * MiB)
    try:
        for commit, state in zip(rec.commits, rec.states, strict=True):
            assert replay(wal, [commit]) == 1
            assert dump(wal) == state, f"after commit {commit.seq}"
    finally:
        wal.close()


@pytest.mark.parametrize("split", [1, 7, 0.5, -1])
def test_a_prefix_then_the_rest(tmp_path: Path, recorded: tuple[Recorder, Dump, dict[str, str]],
                                split: float) -> None:
    rec, final, _ = recorded
    n = int(len(rec.commits) * split) if isinstance(split, float) else split % len(rec.commits)
    wal = WalEnv(tmp_path / "replayed", 64 * MiB)
    try:
        assert replay(wal, rec.commits[:n]) == n
        assert dump(wal) == rec.states[n - 1]
        # the rest, overlapping what was applied (a segment uploaded twice): skipped
        assert replay(wal, rec.commits[max(0, n - 3):]) == len(rec.commits) - n
        assert dump(wal) == final
    finally:
        wal.close()


def test_replay_through_segments(tmp_path: Path, recorded: tuple[Recorder, Dump, dict[str, str]]) -> None:
    rec, final, _ = recorded
    blobs = [encode(rec.commits[i : i + 5], epoch=1) for i in range(0, len(rec.commits), 5)]
    assert blobs == [encode(rec.commits[i : i + 5], epoch=1) for i in range(0, len(rec.commits), 5)]
    wal = WalEnv(tmp_path / "replayed", 64 * MiB)
    try:
        for i, blob in enumerate(blobs):
            replay(wal, decode(blob).commits)
            if i == 2:
                replay(wal, decode(blobs[1]).commits)  # an old segment again: nothing happens
        assert dump(wal) == final
    finally:
        wal.close()


def test_a_missing_commit_is_refused_and_applies_nothing(
    tmp_path: Path, recorded: tuple[Recorder, Dump, dict[str, str]]
) -> None:
    rec, _, _ = recorded
    wal = WalEnv(tmp_path / "replayed", 64 * MiB)
    try:
        empty = dump(wal)
        with pytest.raises(ReplayGap, match="commit 2 does not follow commit 0"):
            replay(wal, rec.commits[1:])
        assert dump(wal) == empty
        replay(wal, rec.commits[:3])
        with pytest.raises(ReplayGap, match="commit 6 does not follow commit 4"):
            replay(wal, [*rec.commits[3:4], *rec.commits[4 + 1 :]])
        assert dump(wal) == rec.states[2]  # the refused call applied nothing, not even commit 4
    finally:
        wal.close()
