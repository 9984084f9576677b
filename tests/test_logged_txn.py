"""The commit log's foundation: the recording transaction (ingester/logged_txn.py) and the
GroupCommitter's commit seq and on_logged hook (ingester/wal.py).

The write-set must be exactly what LMDB committed: every write method records what it did
and nothing it refused; an aborted attempt's writes never reach it; writes an operation
made before a DS3Error are committed, so they stay in it. The hook runs after the commit
and before any outcome is delivered; a gate it returns holds deliveries, in commit order."""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future as ConcurrentFuture
from pathlib import Path
from typing import Any

import lmdb
import pytest

from ingester.journal import HEADER, JournalWriter
from ingester.logged_txn import LoggedTxn, UnloggedDatabase
from ingester.replay import apply
from ingester.wal import COMMIT_SEQ, WalEnv
from ingester.writes import AppendRequest, AppendResult, CreateRequest
from shared.config import MiB
from shared.errors import Conflict, NotFound, Unavailable
from shared.logsegment import CLEAR, DB_IDS, DELETE, FOLD, PUT, Commit, Write
from tests.wal_harness import TEXT, Clock, FailingCommits, Harness, ShadowLog, dump

SYS, STREAMS, RECORDS = DB_IDS["sys"], DB_IDS["streams"], DB_IDS["records"]
JOURNAL, JTAIL = DB_IDS["journal"], DB_IDS["jtail"]


@pytest.fixture
def wal(tmp_path: Path) -> Iterator[WalEnv]:
    w = WalEnv(tmp_path / "wal", 16 * MiB)
    with w.env.begin(write=True) as txn:
        for k in (b"a", b"b", b"c", b"d"):
            txn.put(k, k.upper(), db=w.records)
    yield w
    w.close()


def run(wal: WalEnv, op: Callable[[Any], object]) -> tuple[object, list[Write]]:
    """Run `op` on a LoggedTxn and commit: (its result, the write-set)."""
    with wal.env.begin(write=True) as raw:
        logged = LoggedTxn(raw, wal.log_ids)
        result = op(logged)
    return result, logged.writes


def r(key: bytes, value: bytes | None = None) -> Write:
    return (RECORDS, PUT, key, value) if value is not None else (RECORDS, DELETE, key, b"")


def _journal_then_fold(txn: Any, wal: WalEnv) -> int:
    """Two streams' messages into the journal, then a fold: the journal's puts are logged, the
    fold is one FOLD write (replay folds the same journal into the same records)."""
    writer = JournalWriter(wal)
    writer.append(txn, 7, 3, 0, 0, b"abc")
    writer.append(txn, 9, 1, 0, 0, b"x")
    writer.append(txn, 7, 5, 0, 0, b"de")
    return writer.fold(txn)


def _journal_puts() -> list[Write]:
    def j(serial: int, prev: int, sid: int, end: int, data: bytes) -> list[Write]:
        key = struct.pack(">Q", serial)
        return [(JOURNAL, PUT, key, HEADER.pack(prev, sid, end, 0, 0) + data),
                (JTAIL, PUT, struct.pack(">Q", sid), key)]
    return j(1, 0, 7, 3, b"abc") + j(2, 0, 9, 1, b"x") + j(3, 1, 7, 5, b"de")


def _drop_prefix(txn: Any, wal: WalEnv) -> int:
    cur = txn.cursor(wal.records)
    cur.set_range(b"b")
    n = 0
    while cur.key()[:1] in (b"b", b"c") and cur.delete():
        n += 1
    return n


# name, operation (txn, wal) -> result, expected result, expected write-set
CASES: list[tuple[str, Callable[[Any, WalEnv], object], object, list[Write]]] = [
    ("put", lambda t, w: t.put(b"e", b"E", db=w.records), True, [r(b"e", b"E")]),
    ("put overwrites", lambda t, w: t.put(b"a", b"X", db=w.records), True, [r(b"a", b"X")]),
    ("put refused (overwrite=False)", lambda t, w: t.put(b"a", b"X", overwrite=False, db=w.records), False, []),
    ("put appends", lambda t, w: t.put(b"z", b"Z", append=True, db=w.records), True, [r(b"z", b"Z")]),
    ("append out of order refused", lambda t, w: t.put(b"0", b"Z", append=True, db=w.records), False, []),
    ("put positional flags", lambda t, w: t.put(b"f", b"F", True, True, False, w.records), True, [r(b"f", b"F")]),
    ("put memoryview", lambda t, w: t.put(memoryview(b"g"), bytearray(b"G"), db=w.records), True, [r(b"g", b"G")]),
    ("put empty value", lambda t, w: t.put(b"h", b"", db=w.sys), True, [(SYS, PUT, b"h", b"")]),
    ("delete", lambda t, w: t.delete(b"a", db=w.records), True, [r(b"a")]),
    ("delete missing", lambda t, w: t.delete(b"nope", db=w.records), False, []),
    ("replace", lambda t, w: t.replace(b"a", b"X", db=w.records), b"A", [r(b"a", b"X")]),
    ("replace new", lambda t, w: t.replace(b"q", b"Q", db=w.records), None, [r(b"q", b"Q")]),
    ("pop", lambda t, w: t.pop(b"b", db=w.records), b"B", [r(b"b")]),
    ("pop missing", lambda t, w: t.pop(b"nope", db=w.records), None, []),
    ("drop (empty the db)", lambda t, w: t.drop(w.records, delete=False), None, [(RECORDS, CLEAR, b"", b"")]),
    ("journal fold", _journal_then_fold, 3, [*_journal_puts(), (JOURNAL, FOLD, b"", b"")]),
    ("cursor put", lambda t, w: t.cursor(w.records).put(b"e", b"E"), True, [r(b"e", b"E")]),
    ("cursor put refused", lambda t, w: t.cursor(w.records).put(b"a", b"E", overwrite=False), False, []),
    ("cursor replace", lambda t, w: t.cursor(w.records).replace(b"c", b"C2"), b"C", [r(b"c", b"C2")]),
    ("cursor pop", lambda t, w: t.cursor(w.records).pop(b"c"), b"C", [r(b"c")]),
    ("cursor pop missing", lambda t, w: t.cursor(w.records).pop(b"x"), None, []),
    ("cursor delete (a prefix)", _drop_prefix, 2, [r(b"b"), r(b"c")]),
    ("cursor delete unpositioned", lambda t, w: t.cursor(w.records).delete(), False, []),
    ("putmulti", lambda t, w: t.cursor(w.records).putmulti(iter([(b"a", b"1"), (b"e", b"2")])), (2, 2),
     [r(b"a", b"1"), r(b"e", b"2")]),
    ("putmulti without overwrite", lambda t, w: t.cursor(w.records).putmulti([(b"a", b"1"), (b"e", b"2")],
                                                                             overwrite=False),
     (2, 1), [r(b"e", b"2")]),
    ("putmulti appending", lambda t, w: t.cursor(w.records).putmulti([(b"0", b"1"), (b"y", b"2")], append=True),
     (2, 1), [r(b"y", b"2")]),
    ("reads pass through", lambda t, w: (t.get(b"a", db=w.records), t.stat(w.records)["entries"],
                                         [bytes(k) for k, _ in t.cursor(w.records)],
                                         t.cursor(w.records).set_range(b"bb"), t.id() > 0),
     (b"A", 4, [b"a", b"b", b"c", b"d"], True, True), []),
    ("in order", lambda t, w: (t.put(b"k", b"1", db=w.sys), t.delete(b"k", db=w.sys), t.put(b"k", b"2", db=w.sys)),
     (True, True, True), [(SYS, PUT, b"k", b"1"), (SYS, DELETE, b"k", b""), (SYS, PUT, b"k", b"2")]),
]


@pytest.mark.parametrize(("name", "op", "result", "writes"), CASES, ids=[c[0] for c in CASES])
def test_recorded_writes(wal: WalEnv, name: str, op: Callable[[Any, WalEnv], object], result: object,
                         writes: list[Write]) -> None:
    before = dump(wal)
    got, recorded = run(wal, lambda t: op(t, wal))
    assert got == result
    assert recorded == writes
    assert all(type(k) is bytes and type(v) is bytes for _db, _op, k, v in recorded)
    # the write-set applied to the state before gives the state after
    after = dump(wal)
    with wal.env.begin(write=True) as txn:
        for name, pairs in before.items():
            txn.drop(getattr(wal, name), delete=False)
            for k, v in pairs:
                txn.put(k, v, db=getattr(wal, name))
        apply(txn, wal, Commit(1, recorded))
        txn.delete(COMMIT_SEQ, db=wal.sys)
    assert dump(wal) == after


def test_unknown_databases_are_refused(wal: WalEnv, tmp_path: Path) -> None:
    with pytest.raises(UnloggedDatabase):
        run(wal, lambda t: t.put(b"k", b"v"))  # the default (main) database
    other = wal.env.open_db(b"streams")  # the same database, but a handle WalEnv does not own
    with pytest.raises(UnloggedDatabase):
        run(wal, lambda t: t.put(b"k", b"v", db=other))
    with pytest.raises(UnloggedDatabase):
        run(wal, lambda t: t.drop(wal.records))  # removing the database itself
    _, writes = run(wal, lambda t: t.get(b"a"))  # reads of the default database are fine
    assert writes == []


# --- the committer ------------------------------------------------------------------------


def seq_in(h: Harness) -> int:
    with h.wal.env.begin() as txn:
        return h.wal.commit_seq(txn)


def test_commit_seq_rises_per_writing_commit_and_survives_a_restart(tmp_path: Path, clock: Clock) -> None:
    shadow = ShadowLog()
    h = Harness(tmp_path / "wal", clock, on_logged=shadow)
    try:
        assert h.committer.seq == 0
        h.create("s")
        h.append("s", b"a")
        assert [c.seq for c in shadow.commits] == [1, 2]
        assert seq_in(h) == h.committer.seq == 2
        # the seq is written by the commit itself, as its last write
        assert shadow.commits[-1].writes[-1] == (SYS, PUT, COMMIT_SEQ, struct.pack(">Q", 2))
        # a batch that wrote nothing has no seq (and the hook never hears of it)
        with pytest.raises(NotFound):
            h.append("nope", b"x")
        h.run(lambda txn: txn.get(b"s", db=h.wal.streams))
        assert [c.seq for c in shadow.commits] == [1, 2]
    finally:
        h.close()
    again = Harness(tmp_path / "wal", clock, on_logged=shadow)
    try:
        assert again.committer.seq == 2
        again.append("s", b"b")
        assert [c.seq for c in shadow.commits] == [1, 2, 3]
        assert again.contents("s") == b"ab"
    finally:
        again.close()
    reopened = WalEnv(tmp_path / "wal", 64 * MiB)
    try:
        shadow.verify(reopened)
        with pytest.raises(AssertionError):  # the check does see a difference
            ShadowLog().verify(reopened)
    finally:
        reopened.close()


def test_without_a_log_operations_get_the_raw_transaction_and_no_seq(h: Harness) -> None:
    if h.shadow is not None:
        pytest.skip("DS3_TEST_SHADOW_LOG is set: this harness logs")
    seen: list[object] = []
    h.run(lambda txn: seen.append(type(txn)))
    h.create("s")
    assert seen == [lmdb.Transaction]
    assert seq_in(h) == 0 and h.committer.seq == 0


async def test_rollback_granularity_is_the_batch_attempt(tmp_path: Path, clock: Clock) -> None:
    """A batch in which one operation writes and then fails unexpectedly runs again without
    it: nothing it wrote is in the write-set. One that writes and then raises a DS3Error
    (which the committer does not roll back) keeps its write, in LMDB and in the write-set."""
    shadow = ShadowLog()
    h = Harness(tmp_path / "wal", clock, loop=asyncio.get_running_loop(), on_logged=shadow)
    try:
        h.create("s")
        started, release = threading.Event(), threading.Event()

        def blocker(txn: lmdb.Transaction) -> None:
            started.set()
            release.wait(10)

        def append(body: bytes) -> Callable[[lmdb.Transaction], AppendResult]:
            req = AppendRequest("s", TEXT, body, None)
            return lambda txn: h.store.append(txn, req)

        def broken(txn: lmdb.Transaction) -> None:
            h.store.append(txn, AppendRequest("s", TEXT, b"BROKEN", None))
            txn.put(b"pub:/broken", b"", db=h.wal.sys)
            raise RuntimeError("bug in an operation")

        def refused_after_writing(txn: lmdb.Transaction) -> None:
            txn.put(b"pub:/kept", b"", db=h.wal.sys)
            raise Conflict("refused, but its write stands")

        first = h.committer.submit(blocker)
        await asyncio.to_thread(started.wait, 10)
        futures = [h.committer.submit(op) for op in (append(b"a"), broken, refused_after_writing, append(b"b"))]
        release.set()
        await first
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert [type(x) for x in results] == [AppendResult, Unavailable, Conflict, AppendResult]
        batch = shadow.commits[-1]
        assert batch.seq == 2  # one commit for the whole batch (the blocker's own made none)
        flat = repr(batch.writes)
        assert "BROKEN" not in flat and b"pub:/broken" not in {w[2] for w in batch.writes}
        assert (SYS, PUT, b"pub:/kept", b"") in batch.writes
        with h.wal.env.begin() as txn:
            assert txn.get(b"pub:/kept", db=h.wal.sys) == b""
            assert txn.get(b"pub:/broken", db=h.wal.sys) is None
        assert h.contents("s") == b"ab"
        shadow.verify(h.wal)
    finally:
        h.close()


def test_a_failed_commit_logs_nothing_and_keeps_the_seq(tmp_path: Path, clock: Clock) -> None:
    shadow = ShadowLog()
    h = Harness(tmp_path / "wal", clock, on_logged=shadow)
    try:
        h.create("s")
        real = h.wal.env
        h.wal.env = FailingCommits(real)  # type: ignore[assignment]
        with pytest.raises(Unavailable):
            h.append("s", b"lost")
        h.wal.env = real
        h.append("s", b"kept")
        assert [c.seq for c in shadow.commits] == [1, 2]
        assert h.contents("s") == b"kept"
        shadow.verify(h.wal)
    finally:
        h.close()


def test_the_hook_runs_after_the_commit_and_before_delivery(tmp_path: Path, clock: Clock) -> None:
    loop = asyncio.new_event_loop()
    events: list[str] = []

    def hook(commit: Commit) -> None:
        with h.wal.env.begin() as txn:  # committed: a new reader sees it
            assert h.wal.commit_seq(txn) == commit.seq
        events.append(f"logged {commit.seq}")

    h = Harness(tmp_path / "wal", clock, loop=loop, on_logged=hook)
    try:
        h.create("s")
        assert events == ["logged 1"]

        async def scenario() -> None:
            h.committer.submit_callback(lambda txn: h.store.append(txn, AppendRequest("s", TEXT, b"x", None)),
                                        lambda value, ok: events.append(f"delivered {ok}"))
            await h.committer.submit(lambda txn: None)

        loop.run_until_complete(scenario())
        assert events == ["logged 1", "logged 2", "delivered True"]
    finally:
        h.close()
        loop.close()


class Gates:
    """An on_logged hook returning a gate per commit, opened by the test."""

    def __init__(self) -> None:
        self.gates: dict[int, ConcurrentFuture[None]] = {}
        self.ready = threading.Event()

    def __call__(self, commit: Commit) -> ConcurrentFuture[None]:
        gate: ConcurrentFuture[None] = ConcurrentFuture()
        self.gates[commit.seq] = gate
        self.ready.set()
        return gate


async def test_a_gate_holds_deliveries_in_commit_order(tmp_path: Path, clock: Clock) -> None:
    """A future --durability store: outcomes wait for the upload of their commit, and a
    commit with nothing to upload (a duplicate, a refusal, a read) waits for the ones before."""
    gates = Gates()
    h = Harness(tmp_path / "wal", clock, loop=asyncio.get_running_loop(), on_logged=gates)
    try:
        create = h.committer.submit(lambda txn: h.store.create(txn, _create("s")))
        await asyncio.to_thread(gates.ready.wait, 10)
        await asyncio.sleep(0.05)
        assert not create.done()
        gates.gates[1].set_result(None)
        await asyncio.wait_for(create, 10)

        got: list[str] = []
        a = h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("s", TEXT, b"a", None)))
        a.add_done_callback(lambda f: got.append("a"))
        while 2 not in gates.gates:
            await asyncio.sleep(0.01)
        refused = h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("nope", TEXT, b"x", None)))
        refused.add_done_callback(lambda f: got.append("refused"))
        b = h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("s", TEXT, b"b", None)))
        b.add_done_callback(lambda f: got.append("b"))
        while 3 not in gates.gates:
            await asyncio.sleep(0.01)
        gates.gates[3].set_result(None)  # the later upload finishes first: nothing goes out yet
        await asyncio.sleep(0.05)
        assert got == [] and h.committer.seq == 3
        gates.gates[2].set_result(None)
        await asyncio.wait_for(asyncio.gather(a, b, refused, return_exceptions=True), 10)
        assert got == ["a", "refused", "b"]
        assert isinstance(refused.exception(), NotFound)
        # nothing gated any more: a commit's outcome goes out as soon as its gate opens
        c = h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("s", TEXT, b"c", None)))
        while 4 not in gates.gates:
            await asyncio.sleep(0.01)
        gates.gates[4].set_result(None)
        await asyncio.wait_for(c, 10)
        assert h.contents("s") == b"abc"
    finally:
        for g in gates.gates.values():
            if not g.done():
                g.set_result(None)
        h.close()


async def test_a_failed_gate_or_hook_turns_successes_into_503(tmp_path: Path, clock: Clock) -> None:
    outcome: dict[str, Any] = {"mode": "gate"}

    def hook(commit: Commit) -> ConcurrentFuture[None] | None:
        if outcome["mode"] == "raise":
            raise RuntimeError("the shipper is broken")
        gate: ConcurrentFuture[None] = ConcurrentFuture()
        gate.set_exception(OSError("upload failed"))
        return gate

    h = Harness(tmp_path / "wal", clock, loop=asyncio.get_running_loop(), on_logged=hook)
    try:
        with pytest.raises(Unavailable, match="did not reach the object store"):
            await h.committer.submit(lambda txn: h.store.create(txn, _create("s")))
        outcome["mode"] = "raise"
        with pytest.raises(Unavailable, match="did not reach the object store"):
            await h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("s", TEXT, b"a", None)))
        with pytest.raises(NotFound):  # a refusal stays what it was
            await h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("nope", TEXT, b"a", None)))
        # the commits stand (the WAL has them; a retry of the append is a second append)
        assert h.committer.seq == 2 and h.contents("s") == b"a"
    finally:
        h.close()


def _create(path: str) -> CreateRequest:
    return CreateRequest(path=path, content_type=TEXT)
