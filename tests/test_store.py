"""The write path (ingester/store.py on the WAL writer, ingester/wal.py) against a real LMDB,
without HTTP: idempotent producers, Stream-Seq, closing, content types, TTL/expiry, forks,
and a batch with one failing operation. Every refused write must leave nothing behind."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest

from ingester.writes import AppendRequest, AppendResult, CreateResult
from shared import offsets
from shared.errors import (
    BadRequest,
    Conflict,
    Gone,
    NotFound,
    ProducerSeqGap,
    StaleProducerEpoch,
    StreamClosed,
    Unavailable,
)
from tests.wal_harness import JSON, TEXT, Clock, Harness, fork


def offset_of(result: AppendResult | CreateResult) -> offsets.Offset:
    return offsets.parse(result.stream.tail_offset)


# --- basics ---------------------------------------------------------------------------------


def test_create_append_read(h: Harness) -> None:
    r = h.create("s")
    assert r.created and offsets.parse(r.stream.tail_offset).position == 0
    a1 = h.append("s", b"hello ")
    a2 = h.append("s", b"world")
    assert offset_of(a1) < offset_of(a2)
    assert offset_of(a2).position == 11
    assert h.contents("s") == b"hello world"
    again = h.create("s")
    assert not again.created and again.stream.tail_offset == a2.stream.tail_offset


def test_append_to_missing_stream_is_not_found_and_creates_nothing(h: Harness) -> None:
    with pytest.raises(NotFound):
        h.append("nope", b"x")
    assert h.meta("nope") is None


def test_create_conflicting_config_changes_nothing(h: Harness) -> None:
    h.create("s", TEXT, ttl=60)
    h.append("s", b"x")
    before = h.snapshot("s")
    for kw in ({"ttl": 61}, {"ttl": None}, {"closed": True}):
        with pytest.raises(Conflict):
            h.create("s", TEXT, **kw)
    with pytest.raises(Conflict):
        h.create("s", JSON, ttl=60)
    assert h.snapshot("s") == before


def test_create_with_invalid_json_body_creates_nothing(h: Harness) -> None:
    with pytest.raises(BadRequest):
        h.create("j", JSON, body=b"[1,")
    assert h.meta("j") is None
    r = h.create("j", JSON, body=b"[]")
    assert r.created and h.contents("j") == b""


# --- idempotent producers ----------------------------------------------------------------------


def test_new_producer_starts_at_seq_zero(h: Harness) -> None:
    h.create("s")
    r = h.append("s", b"a", producer=("p", 0, 0))
    assert (r.duplicate, r.producer_epoch, r.producer_seq) == (False, 0, 0)
    assert h.contents("s") == b"a"


def test_new_producer_with_nonzero_seq_is_a_gap(h: Harness) -> None:
    h.create("s")
    with pytest.raises(ProducerSeqGap) as e:
        h.append("s", b"a", producer=("p", 0, 3))
    assert (e.value.expected, e.value.received) == (0, 3)
    assert h.contents("s") == b""
    assert h.append("s", b"a", producer=("p", 0, 0)).producer_seq == 0  # state was not created


def test_seq_gap_reports_expected_and_received_and_stores_nothing(h: Harness) -> None:
    h.create("s")
    h.append("s", b"a", producer=("p", 0, 0))
    before = h.snapshot("s")
    with pytest.raises(ProducerSeqGap) as e:
        h.append("s", b"b", producer=("p", 0, 2))
    assert (e.value.expected, e.value.received) == (1, 2)
    assert h.snapshot("s") == before
    assert not h.append("s", b"b", producer=("p", 0, 1)).duplicate


def test_duplicate_is_acknowledged_and_writes_nothing(h: Harness) -> None:
    h.create("s")
    h.append("s", b"a", producer=("p", 0, 0))
    last = h.append("s", b"b", producer=("p", 0, 1))
    before = h.snapshot("s")
    for seq in (0, 1):
        r = h.append("s", b"b" if seq else b"a", producer=("p", 0, seq))
        assert r.duplicate
        assert r.producer_epoch == 0
        assert r.producer_seq == 1  # the highest accepted seq, for pipelining clients
        assert r.stream.tail_offset == last.stream.tail_offset
    assert h.snapshot("s") == before
    assert h.contents("s") == b"ab"


def test_stale_epoch_is_fenced_with_the_current_epoch(h: Harness) -> None:
    h.create("s")
    h.append("s", b"a", producer=("p", 0, 0))
    h.append("s", b"b", producer=("p", 2, 0))
    before = h.snapshot("s")
    for seq in (0, 1, 5):
        with pytest.raises(StaleProducerEpoch) as e:
            h.append("s", b"zombie", producer=("p", 1, seq))
        assert e.value.current_epoch == 2
    assert h.snapshot("s") == before


def test_new_epoch_must_start_at_seq_zero(h: Harness) -> None:
    h.create("s")
    h.append("s", b"a", producer=("p", 0, 0))
    before = h.snapshot("s")
    with pytest.raises(BadRequest) as e:
        h.append("s", b"b", producer=("p", 1, 1))
    assert "Producer-Seq 0" in e.value.message
    assert h.snapshot("s") == before
    # the old epoch's state is untouched
    assert not h.append("s", b"b", producer=("p", 0, 1)).duplicate


def test_epoch_bump_with_seq_zero_restarts_the_sequence(h: Harness) -> None:
    h.create("s")
    for seq in range(3):
        h.append("s", bytes([65 + seq]), producer=("p", 0, seq))
    r = h.append("s", b"X", producer=("p", 1, 0))
    assert (r.duplicate, r.producer_epoch, r.producer_seq) == (False, 1, 0)
    assert not h.append("s", b"Y", producer=("p", 1, 1)).duplicate
    assert h.append("s", b"Y", producer=("p", 1, 1)).duplicate
    with pytest.raises(StaleProducerEpoch):
        h.append("s", b"D", producer=("p", 0, 3))
    assert h.contents("s") == b"ABCXY"


def test_producers_are_independent_per_id_and_per_stream(h: Harness) -> None:
    h.create("s")
    h.create("t")
    h.append("s", b"1", producer=("p", 0, 0))
    h.append("s", b"2", producer=("p", 0, 1))
    assert not h.append("s", b"3", producer=("q", 0, 0)).duplicate
    assert not h.append("t", b"4", producer=("p", 0, 0)).duplicate
    assert h.contents("s") == b"123"
    assert h.contents("t") == b"4"


def test_producer_state_survives_reopening_the_wal(tmp_path: Path, clock: Clock) -> None:
    first = Harness(tmp_path / "wal", clock)
    try:
        first.create("s")
        first.append("s", b"a", producer=("p", 3, 0))
        first.append("s", b"b", producer=("p", 3, 1))
    finally:
        first.close()
    again = Harness(tmp_path / "wal", clock)
    try:
        r = again.append("s", b"b", producer=("p", 3, 1))
        assert r.duplicate and r.producer_seq == 1
        with pytest.raises(StaleProducerEpoch) as e:
            again.append("s", b"z", producer=("p", 2, 0))
        assert e.value.current_epoch == 3
        with pytest.raises(ProducerSeqGap) as gap:
            again.append("s", b"c", producer=("p", 3, 5))
        assert gap.value.expected == 2
        assert not again.append("s", b"c", producer=("p", 3, 2)).duplicate
        assert again.contents("s") == b"abc"
    finally:
        again.close()


# --- Stream-Seq ---------------------------------------------------------------------------------


def test_stream_seq_regression_is_a_conflict_and_stores_nothing(h: Harness) -> None:
    h.create("s")
    h.append("s", b"1", seq="9")
    before = h.snapshot("s")
    for seq in ("9", "8", "10", "0", "", "8zzz"):  # "10" < "9": byte-wise, not numeric
        with pytest.raises(Conflict):
            h.append("s", b"x", seq=seq)
    assert h.snapshot("s") == before
    h.append("s", b"2", seq="9a")
    h.append("s", b"3")  # no Stream-Seq: no check
    h.append("s", b"4", seq="a")
    assert h.contents("s") == b"1234"


def test_stream_seq_regression_does_not_advance_the_producer(h: Harness) -> None:
    h.create("s")
    h.append("s", b"1", producer=("p", 0, 0), seq="b")
    with pytest.raises(Conflict):
        h.append("s", b"2", producer=("p", 0, 1), seq="a")
    r = h.append("s", b"2", producer=("p", 0, 1), seq="c")
    assert not r.duplicate  # seq 1 was not consumed by the refused append
    assert h.contents("s") == b"12"


# --- closing -------------------------------------------------------------------------------------


def test_append_to_closed_stream_reports_the_final_offset(h: Harness) -> None:
    h.create("s")
    h.append("s", b"abc")
    closed = h.append("s", b"d", close=True)
    assert closed.stream.closed and not closed.duplicate
    before = h.snapshot("s")
    with pytest.raises(StreamClosed) as e:
        h.append("s", b"x")
    assert e.value.final_offset == closed.stream.tail_offset
    with pytest.raises(StreamClosed):
        h.append("s", b"x", close=True)  # append-and-close is not idempotent without a producer
    assert h.snapshot("s") == before
    assert h.contents("s") == b"abcd"


def test_close_only_twice_is_a_duplicate(h: Harness) -> None:
    h.create("s")
    h.append("s", b"abc")
    first = h.append("s", b"", close=True)
    second = h.append("s", b"", close=True)
    assert first.stream.closed and not first.duplicate
    assert second.stream.closed and second.duplicate
    assert first.stream.tail_offset == second.stream.tail_offset


def test_close_by_producer_then_same_tuple_is_a_duplicate(h: Harness) -> None:
    h.create("s")
    h.append("s", b"a", producer=("p", 0, 0))
    r = h.append("s", b"end", producer=("p", 0, 1), close=True)
    assert r.stream.closed and not r.duplicate
    retry = h.append("s", b"end", producer=("p", 0, 1), close=True)
    assert retry.duplicate and retry.stream.closed
    assert (retry.producer_epoch, retry.producer_seq) == (0, 1)
    with pytest.raises(StreamClosed):
        h.append("s", b"more", producer=("p", 0, 2))
    with pytest.raises(StreamClosed):
        h.append("s", b"a", producer=("p", 0, 0))  # an older tuple did not close it
    assert h.contents("s") == b"aend"


def test_created_closed_stream_refuses_appends(h: Harness) -> None:
    h.create("s", closed=True, body=b"final")
    with pytest.raises(StreamClosed) as e:
        h.append("s", b"x")
    assert offsets.parse(e.value.final_offset).position == 5
    assert h.contents("s") == b"final"


# --- content types ----------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [JSON, "text/html", "application/octet-stream", None])
def test_content_type_mismatch_is_a_conflict(h: Harness, content_type: str | None) -> None:
    h.create("s", TEXT)
    h.append("s", b"a")
    before = h.snapshot("s")
    with pytest.raises(Conflict):
        h.append("s", b"1", content_type)
    assert h.snapshot("s") == before


@pytest.mark.parametrize("content_type", ["text/plain", "TEXT/Plain", "text/plain; charset=utf-8"])
def test_content_type_match_ignores_case_and_parameters(h: Harness, content_type: str) -> None:
    h.create("s", TEXT)
    h.append("s", b"a", content_type)
    assert h.contents("s") == b"a"


def test_close_only_ignores_content_type(h: Harness) -> None:
    h.create("s", TEXT)
    assert h.append("s", b"", JSON, close=True).stream.closed


# --- TTL and expiry -------------------------------------------------------------------------------


def test_ttl_expires_after_ttl_seconds_of_inactivity(h: Harness, clock: Clock) -> None:
    h.create("s", ttl=10, body=b"x")
    clock.now += 9.9
    h.append("s", b"y")  # renews: the deadline is now +10 from here
    clock.now += 9.9
    h.append("s", b"z")
    clock.now += 10
    with pytest.raises(NotFound):
        h.append("s", b"late")
    r = h.create("s", ttl=10)
    assert r.created and offsets.parse(r.stream.tail_offset).position == 0


def test_ttl_is_renewed_by_reads(h: Harness, clock: Clock) -> None:
    h.create("s", ttl=10, body=b"x")
    h.create("t", ttl=10, body=b"x")
    clock.now += 8
    h.store.touches["s"] = clock.now  # what a read records
    clock.now += 5  # 13 s after create, 5 s after the read
    assert not h.append("s", b"y").duplicate
    with pytest.raises(NotFound):
        h.append("t", b"y")


def test_sweep_deletes_expired_streams_and_their_records(h: Harness, clock: Clock) -> None:
    h.create("gone", ttl=10)
    h.append("gone", b"abc", producer=("p", 0, 0))
    h.append("gone", b"def", producer=("p", 0, 1))
    h.create("kept", ttl=10, body=b"k")
    h.create("forever", body=b"f")
    meta = h.meta("gone")
    assert meta is not None
    sid = meta.sid
    assert h.stored(sid) == 2
    assert len(h.keys(h.wal.producers, sid)) == 1
    clock.now += 5
    h.append("kept", b"k")
    assert h.run(h.store.sweep_expired) == 0
    clock.now += 5.5
    assert h.run(h.store.sweep_expired) == 1
    assert h.meta("gone") is None
    assert h.stored(sid) == 0
    assert h.keys(h.wal.producers, sid) == []
    assert h.meta("kept") is not None and h.meta("forever") is not None
    clock.now += 10
    assert h.run(h.store.sweep_expired) == 1
    assert h.meta("kept") is None
    assert h.meta("forever") is not None


def test_expires_at_is_not_renewed(h: Harness, clock: Clock) -> None:
    h.create("s", expires_at=clock.now + 10, expires_at_text="whenever", body=b"x")
    clock.now += 5
    h.append("s", b"y")
    h.store.touches["s"] = clock.now
    clock.now += 5
    with pytest.raises(NotFound):
        h.append("s", b"z")
    assert h.run(h.store.sweep_expired) == 0  # already removed when the append found it expired
    assert h.meta("s") is None


def test_expires_at_sweep(h: Harness, clock: Clock) -> None:
    h.create("s", expires_at=clock.now + 10, body=b"x")
    clock.now += 10
    assert h.run(h.store.sweep_expired) == 1
    assert h.meta("s") is None


def test_recreate_after_delete_never_sees_old_records(h: Harness) -> None:
    h.create("s")
    h.append("s", b"old data", producer=("p", 0, 0))
    h.append("s", b"", close=True)
    old = h.meta("s")
    assert old is not None
    h.delete("s")
    assert h.meta("s") is None
    assert h.stored(old.sid) == 0
    with pytest.raises(NotFound):
        h.delete("s")
    r = h.create("s")
    assert r.created and not r.stream.closed
    new = h.meta("s")
    assert new is not None and new.sid != old.sid
    assert h.contents("s") == b""
    # the producer's old state died with the old stream
    assert not h.append("s", b"new", producer=("p", 0, 0)).duplicate
    assert h.contents("s") == b"new"


# --- forks ---------------------------------------------------------------------------------------------


def test_fork_reads_source_prefix_then_its_own(h: Harness) -> None:
    h.create("src", body=b"abc")
    h.append("src", b"def")
    f = fork(h, "f", "src")
    assert f.created and f.stream.content_type == TEXT
    assert offsets.parse(f.stream.tail_offset).position == 6
    h.append("f", b"XYZ")
    h.append("src", b"ghi")
    assert h.contents("f") == b"abcdefXYZ"
    assert h.contents("src") == b"abcdefghi"
    assert h.contents("f", max_bytes=1) == b"abcdefXYZ"  # page by page across the fork point
    src = h.meta("src")
    assert src is not None and src.refcount == 1


def test_fork_at_an_offset(h: Harness) -> None:
    a = h.create("src", body=b"abc")
    h.append("src", b"def")
    fork(h, "f", "src", offset=a.stream.tail_offset)
    assert h.contents("f") == b"abc"


def test_fork_offsets_sort_after_inherited_ones(h: Harness) -> None:
    h.create("src", body=b"abc")
    f = fork(h, "f", "src")
    own = h.append("f", b"d")
    assert offsets.parse(f.stream.tail_offset) < offsets.parse(own.stream.tail_offset)
    assert f.stream.tail_offset < own.stream.tail_offset


def test_delete_source_with_forks_is_a_soft_delete(h: Harness) -> None:
    h.create("src", body=b"abc")
    fork(h, "f1", "src")
    fork(h, "f2", "src")
    h.delete("src")
    meta = h.meta("src")
    assert meta is not None and meta.soft_deleted and meta.refcount == 2
    with pytest.raises(Gone):
        h.append("src", b"x")
    with pytest.raises(Gone):
        h.delete("src")
    with pytest.raises(Conflict):
        h.create("src")
    with pytest.raises(Conflict):
        fork(h, "f3", "src")
    assert h.contents("f1") == b"abc"
    h.append("f1", b"1")
    assert h.contents("f1") == b"abc1"
    h.delete("f1")
    meta = h.meta("src")
    assert meta is not None and meta.soft_deleted and meta.refcount == 1
    assert h.contents("f2") == b"abc"
    h.delete("f2")  # the last fork: the source goes too, records and all
    assert h.meta("src") is None
    assert h.stored(meta.sid) == 0
    assert h.create("src").created


def test_cascade_through_a_chain_of_forks(h: Harness) -> None:
    h.create("a", body=b"1")
    fork(h, "b", "a")
    h.append("b", b"2")
    fork(h, "c", "b")
    h.append("c", b"3")
    assert h.contents("c") == b"123"
    sids = {p: m.sid for p in "abc" if (m := h.meta(p)) is not None}
    h.delete("a")
    h.delete("b")
    assert h.contents("c") == b"123"
    h.delete("c")
    for p in "abc":
        assert h.meta(p) is None
        assert h.stored(sids[p]) == 0


def test_fork_sub_offset_bytes(h: Harness) -> None:
    h.create("src")
    h.append("src", b"hello")
    h.append("src", b"world")
    fork(h, "f", "src", offset=str(offsets.ZERO), sub=3)
    assert h.contents("f") == b"hel"
    fork(h, "g", "src", offset=str(offsets.ZERO), sub=5)
    assert h.contents("g") == b"hello"
    before = h.snapshot("src")
    with pytest.raises(BadRequest):
        fork(h, "x", "src", offset=str(offsets.ZERO), sub=6)  # more than that append
    with pytest.raises(BadRequest):
        fork(h, "x", "src", sub=1)  # a sub-offset needs an offset
    assert h.meta("x") is None
    assert h.snapshot("src") == before


def test_fork_sub_offset_json_messages(h: Harness) -> None:
    h.create("src", JSON)
    h.append("src", b"[1, 2, 3]", JSON)
    h.append("src", b"[4, 5]", JSON)
    fork(h, "f", "src", offset=str(offsets.ZERO), sub=2)
    assert h.contents("f") == b"1,2,"
    with pytest.raises(BadRequest):
        fork(h, "x", "src", offset=str(offsets.ZERO), sub=4)  # that append had 3 messages
    assert h.meta("x") is None


def test_fork_refusals_change_nothing(h: Harness) -> None:
    h.create("src", JSON, body=b'[{"a": 1}]')
    before = h.snapshot("src")
    with pytest.raises(NotFound):
        fork(h, "x", "missing")
    with pytest.raises(BadRequest):
        fork(h, "x", "src", offset=offsets.encode(0, 999))  # beyond the tail
    with pytest.raises(BadRequest):
        fork(h, "x", "src", offset=offsets.encode(0, 3))  # inside a JSON message
    with pytest.raises(Conflict):
        fork(h, "x", "src", content_type=TEXT)
    assert h.meta("x") is None
    assert h.snapshot("src") == before
    meta = h.meta("src")
    assert meta is not None and meta.refcount == 0


def test_fork_inherits_the_source_ttl(h: Harness, clock: Clock) -> None:
    h.create("src", ttl=10, body=b"x")
    fork(h, "f", "src")
    meta = h.meta("f")
    assert meta is not None and meta.ttl == 10
    clock.now += 11
    with pytest.raises(NotFound):
        h.append("f", b"y")


def test_expired_source_with_forks_is_gone_but_forks_still_read_it(h: Harness, clock: Clock) -> None:
    h.create("src", ttl=10, body=b"abc")
    fork(h, "f", "src", ttl=1000)
    clock.now += 11
    assert h.run(h.store.sweep_expired) == 1
    meta = h.meta("src")
    assert meta is not None and meta.soft_deleted
    with pytest.raises(Gone):
        h.append("src", b"x")
    assert h.contents("f") == b"abc"


# --- group commit: one bad operation in a batch ----------------------------------------------------------


async def test_unexpected_exception_fails_only_its_operation(tmp_path: Path, clock: Clock) -> None:
    h = Harness(tmp_path / "wal", clock, loop=asyncio.get_running_loop())
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
            h.store.append(txn, AppendRequest("s", TEXT, b"BROKEN", None))  # mutates, then fails
            raise RuntimeError("bug in an operation")

        first = h.committer.submit(blocker)
        await asyncio.to_thread(started.wait, 10)
        # everything below queues behind the blocker and runs as one batch
        futures: list[asyncio.Future[Any]] = [
            h.committer.submit(append(b"a")),
            h.committer.submit(broken),
            h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("nope", TEXT, b"x", None))),
            h.committer.submit(append(b"b")),
        ]
        release.set()
        await asyncio.wait_for(first, 10)
        results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)
        assert isinstance(results[0], AppendResult)
        assert isinstance(results[1], Unavailable)
        assert isinstance(results[2], NotFound)
        assert isinstance(results[3], AppendResult)
        assert offsets.parse(results[3].stream.tail_offset).position == 2
        assert h.committer.last_batch_size == 4
        assert h.contents("s") == b"ab"  # exactly once each, nothing of the broken op
        # the writer carries on
        assert offsets.parse(h.append("s", b"c").stream.tail_offset).position == 3
        assert h.contents("s") == b"abc"
    finally:
        h.close()


def test_a_value_that_cannot_be_stored_fails_alone_and_the_writer_survives(h: Harness) -> None:
    """aiohttp hands header bytes that are not UTF-8 over as lone surrogates; an append that
    carries one (here in Stream-Seq) must fail by itself, not take the writer thread down."""
    h.create("s")
    outcome: list[object] = []

    def bad() -> None:
        try:
            outcome.append(h.append("s", b"x", seq="a\udcff"))
        except Exception as e:
            outcome.append(e)

    t = threading.Thread(target=bad, daemon=True)
    t.start()
    t.join(5)
    assert outcome, "the append never completed: the WAL writer thread died"
    assert isinstance(outcome[0], BadRequest | Unavailable)
    done: list[object] = []
    t2 = threading.Thread(target=lambda: done.append(h.append("s", b"ok")), daemon=True)
    t2.start()
    t2.join(5)
    assert done, "writes after the bad one never complete"
    assert h.contents("s") == b"ok"


def test_callback_deliveries_arrive_on_the_loop_and_one_broken_callback_spares_the_rest(
    tmp_path: Path, clock: Clock
) -> None:
    """GroupCommitter.submit_callback (the fast lane's path): every outcome, success or refusal,
    reaches its callback on the event loop after the commit; a callback that raises is logged
    and the batch's other callbacks and futures still get theirs."""
    loop = asyncio.new_event_loop()
    h = Harness(tmp_path / "wal", clock, loop=loop)
    try:
        h.create("s")
        got: list[tuple[str, object, bool, bool]] = []

        def recorder(name: str, explode: bool = False) -> Callable[[Any, bool], None]:
            def deliver(value: Any, ok: bool) -> None:
                got.append((name, value, ok, threading.current_thread() is threading.main_thread()))
                if explode:
                    raise RuntimeError("a broken answer")
            return deliver

        def req(body: bytes, path: str = "s") -> AppendRequest:
            return AppendRequest(path, TEXT, body, None)

        async def scenario() -> AppendResult:
            h.committer.submit_callback(lambda txn: h.store.append(txn, req(b"a")), recorder("first", explode=True))
            h.committer.submit_callback(lambda txn: h.store.append(txn, req(b"x", "missing")), recorder("refused"))
            fut = h.committer.submit(lambda txn: h.store.append(txn, req(b"b")))
            h.committer.submit_callback(lambda txn: h.store.append(txn, req(b"c")), recorder("last"))
            result = await fut
            for _ in range(100):
                if len(got) == 3:
                    break
                await asyncio.sleep(0.01)
            return result

        middle = loop.run_until_complete(scenario())
        assert offsets.parse(middle.stream.tail_offset).position == 2
        names = [g[0] for g in got]
        assert names == ["first", "refused", "last"]
        first, refused, last = got
        assert first[2] and isinstance(first[1], AppendResult) and first[3]
        assert not refused[2] and isinstance(refused[1], NotFound)
        assert last[2] and isinstance(last[1], AppendResult)
        assert offsets.parse(last[1].stream.tail_offset).position == 3
        assert h.contents("s") == b"abc"
    finally:
        h.close()
        loop.close()


def test_an_aborted_batch_keeps_the_age_of_open_chunks(tmp_path: Path, clock: Clock) -> None:
    """Found by QA: every aborted batch (a full map, a failed commit) reloaded each stream's
    metadata and restarted its open chunk's age, so while clients retried a full WAL every few
    seconds nothing ever aged into a seal and the backlog never drained."""
    from ingester.writes import SealPolicy

    h = Harness(tmp_path / "wal", clock, seal=SealPolicy(seal_bytes=1 << 20, seal_age=10, wal_max_bytes=1 << 30))
    try:
        h.create("s")
        h.append("s", b"open chunk")
        clock.now += 6

        def fails(txn: lmdb.Transaction) -> None:
            raise RuntimeError("the commit failed")

        with pytest.raises(Unavailable, match="nothing was stored"):
            h.run(fails)
        clock.now += 4.5  # 10.5 s after the chunk's first record, 4.5 s after the abort
        assert h.run(h.store.seal_aged) == 1
    finally:
        h.close()
