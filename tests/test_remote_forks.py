"""The WAL side of forks across ingesters (ingester/remote_forks.py), on two real WALs with no
HTTP between them: `a` holds the source, `b` the forks; the pin, the export and the install are
the calls the two ingesters make for each other (tests/test_cross_forks.py runs them over HTTP).
With DS3_TEST_SHADOW_LOG=1 every commit here is also replayed from the commit log and compared."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ingester import remote_forks
from ingester.remote_forks import PinnedSource
from ingester.writes import CreateRequest, CreateResult
from tests.wal_harness import TEXT, Clock, Harness


@pytest.fixture
def ab(tmp_path: Path, clock: Clock) -> tuple[Harness, Harness]:
    a, b = Harness(tmp_path / "a", clock), Harness(tmp_path / "b", clock)
    yield a, b
    b.close()
    a.close()


def pin(a: Harness, source: str, fork_uid: str, offset: str | None = None) -> PinnedSource:
    req = CreateRequest(path="fork", content_type=None, fork_from=source, fork_offset=offset)
    scratch = a.run(lambda txn: remote_forks.pin(a.store, txn, req, fork_uid))
    uid = a.meta(source).uid  # type: ignore[union-attr]
    pinned = a.run(lambda txn: remote_forks.export(a.store, txn, source, uid, scratch))
    return PinnedSource.decode(pinned.encode())  # as it crosses the wire


def fork_on_b(b: Harness, path: str, source: str, fork_uid: str, pinned: PinnedSource) -> CreateResult:
    return b.create(path, None, fork_from=source, uid=fork_uid, remote_source=pinned)


def test_a_fork_on_b_reads_the_chain_it_was_exported(ab: tuple[Harness, Harness]) -> None:
    a, b = ab
    a.create("root")
    for n in range(5):
        a.append("root", f"r{n}.".encode())
    a.create("mid", None, fork_from="root")  # a local fork on a: the exported chain has two levels
    a.append("mid", b"m.")
    pinned = pin(a, "mid", "f1")
    assert [lv.has_source for lv in pinned.levels] == [True, False]
    res = fork_on_b(b, "fork", "mid", "f1", pinned)
    assert res.created and res.stream.tail_offset == a.meta("mid").tail_offset  # type: ignore[union-attr]
    assert b.contents("fork") == a.contents("mid") == b"r0.r1.r2.r3.r4.m."
    b.append("fork", b"own")
    a.append("mid", b"later")
    assert b.contents("fork") == b"r0.r1.r2.r3.r4.m.own"
    assert b.contents("fork", position=3) == b"r1.r2.r3.r4.m.own"
    meta = b.meta("fork")
    assert meta is not None and meta.fork_source == "mid" and meta.fork_source_key == remote_forks.shadow_key(
        a.meta("mid").uid)  # type: ignore[union-attr]


def test_a_pin_counts_once_and_its_release_removes_a_deleted_source(ab: tuple[Harness, Harness]) -> None:
    a, _b = ab
    a.create("src")
    a.append("src", b"data")
    pin(a, "src", "f1")
    pin(a, "src", "f1")  # the answer was lost and B asked again
    assert a.meta("src").refcount == 1  # type: ignore[union-attr]
    pin(a, "src", "f2")
    assert a.meta("src").refcount == 2  # type: ignore[union-attr]
    a.delete("src")
    assert a.meta("src").soft_deleted  # type: ignore[union-attr]
    assert a.run(lambda txn: remote_forks.release(a.store, txn, "f1"))
    assert not a.run(lambda txn: remote_forks.release(a.store, txn, "f1"))  # released already
    assert a.meta("src") is not None
    assert a.run(lambda txn: remote_forks.release(a.store, txn, "f2"))
    assert a.meta("src") is None  # the last reader gone: removed for good


def test_forks_share_a_shadow_until_the_last_one_goes(ab: tuple[Harness, Harness], clock: Clock) -> None:
    a, b = ab
    a.create("src")
    first = a.append("src", b"one.").stream.tail_offset
    a.append("src", b"two.")
    p1 = pin(a, "src", "f1", offset=first)
    fork_on_b(b, "fork1", "src", "f1", p1)
    p2 = pin(a, "src", "f2")  # later position: the shadow grows
    fork_on_b(b, "fork2", "src", "f2", p2)
    shadow = b.meta(remote_forks.shadow_key(a.meta("src").uid))  # type: ignore[union-attr]
    assert shadow is not None and shadow.refcount == 2 and shadow.tail == len(b"one.two.")
    assert b.contents("fork1") == b"one." and b.contents("fork2") == b"one.two."
    no_releases = b.run(lambda txn: remote_forks.pending_releases(b.store, txn, clock.now))
    assert no_releases == []

    b.delete("fork1")
    assert b.contents("fork2") == b"one.two."
    assert b.run(lambda txn: remote_forks.pending_releases(b.store, txn, clock.now)) == [("f1", "src")]
    b.delete("fork2")
    assert b.meta(shadow.path) is None
    assert b.keys(b.wal.records, shadow.sid) == [] and b.keys(b.wal.chunks, shadow.sid) == []
    assert sorted(b.run(lambda txn: remote_forks.pending_releases(b.store, txn, clock.now))) == [
        ("f1", "src"), ("f2", "src")]
    b.run(lambda txn: remote_forks.released(b.store, txn, "f1"))
    assert b.run(lambda txn: remote_forks.pending_releases(b.store, txn, clock.now)) == [("f2", "src")]


def test_an_unused_pin_is_released_after_the_grace(ab: tuple[Harness, Harness], clock: Clock) -> None:
    a, b = ab
    a.create("src")
    a.append("src", b"x")
    b.run(lambda txn: remote_forks.queue_release(b.store, txn, "f1", "src", clock.now))
    b.run(lambda txn: remote_forks.queue_release(b.store, txn, "f2", "src", clock.now))
    pinned = pin(a, "src", "f1")
    fork_on_b(b, "fork", "src", "f1", pinned)  # f1 is used: its intent is dropped with the create
    assert b.run(lambda txn: remote_forks.pending_releases(b.store, txn, clock.now)) == []
    clock.now += remote_forks.INTENT_GRACE
    assert b.run(lambda txn: remote_forks.pending_releases(b.store, txn, clock.now)) == [("f2", "src")]


def test_a_recreate_is_idempotent_and_a_refused_one_changes_nothing(ab: tuple[Harness, Harness]) -> None:
    a, b = ab
    a.create("src")
    a.append("src", b"abc")
    fork_on_b(b, "fork", "src", "f1", pin(a, "src", "f1"))
    again = fork_on_b(b, "fork", "src", "f2", pin(a, "src", "f2"))
    assert not again.created
    b.create("plain", TEXT)
    before = b.meta("plain")
    with pytest.raises(Exception, match="different configuration"):
        fork_on_b(b, "plain", "src", "f3", pin(a, "src", "f3"))
    assert b.meta("plain") == before
    assert b.meta(remote_forks.shadow_key(a.meta("src").uid)).refcount == 1  # type: ignore[union-attr]


def test_the_export_carries_records_byte_for_byte() -> None:
    from ingester.records import ChunkInfo, Record

    level = remote_forks.Level("u" * 32, TEXT, 5, 10, 6, 0, False, [(5, ChunkInfo(0, 4, 1, False, 1.0, "sealed"))],
                               [Record(7, 6, 1, b"\x00\xff\n"), Record(10, 6, 0, b"abc")])
    p = PinnedSource("src", "u" * 32, 10, 6, TEXT, None, None, None, None, "", 0, None, [level])
    assert PinnedSource.decode(p.encode()) == p
    assert orjson.loads(p.encode())["levels"][0]["records"][0][3] == "AP8K"
