"""The journal (ingester/journal.py): appends land in commit order and are folded into
`records` in bulk. Whatever mix of folded and journaled records a stream has, readers,
forks, sealing, deletion and restarts must see exactly the bytes that were acknowledged."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import pytest

from ingester.chain import Sealed
from ingester.journal import FOLD_RECORDS, HEADER, JOURNAL_MAX_MESSAGE
from ingester.records import SID, ChunkRef, Record, decode_record, encode_record, record_key
from ingester.writes import AppendRequest, SealPolicy
from shared import offsets
from shared.errors import BadRequest, Unavailable
from tests.wal_harness import JSON, Clock, Harness, fork


def sid_of(h: Harness, path: str) -> int:
    meta = h.meta(path)
    assert meta is not None
    return meta.sid


def placement(h: Harness, path: str) -> tuple[int, int]:
    """(messages in `records`, messages in the journal) of one stream."""
    sid = sid_of(h, path)
    with h.wal.env.begin(buffers=False) as txn:
        journaled = sum(1 for _k, v in txn.cursor(h.wal.journal) if SID.unpack(v[8:16])[0] == sid)
    return len(h.keys(h.wal.records, sid)), journaled


def fold(h: Harness) -> int:
    return h.run(h.store.journal.fold)


def read_from(h: Harness, path: str, position: int, max_bytes: int = 1 << 20) -> bytes:
    return h.contents(path, max_bytes, position=position)


@pytest.mark.parametrize(("prev", "sid", "end", "chunk", "flags", "data"), [
    (0, 1, 1, 0, 0, b"x"),
    (41, 7, 2**40, 10**12 - 1, 1, b"{\"a\":1},"),
    (2**64 - 1, 2**64 - 1, 2**64 - 1, 2**64 - 1, 255, b""),
    (5, 3, 1000, 9, 0, bytes(range(256)) * 4),
])
def test_a_journal_value_carries_its_records_entry_at_fixed_offsets(
    prev: int, sid: int, end: int, chunk: int, flags: int, data: bytes
) -> None:
    """The fold moves records by slicing: bytes 8-24 must be the `records` key, 24- its value."""
    value = HEADER.pack(prev, sid, end, chunk, flags) + data
    assert value[8:24] == record_key(sid, end)
    assert value[24:] == encode_record(chunk, flags, data)
    assert decode_record(value[8:24], value[24:]) == Record(end, chunk, flags, data)


def test_interleaved_appends_are_journaled_read_back_and_folded(h: Harness) -> None:
    streams = [f"s{i}" for i in range(6)]
    expected = {s: b"" for s in streams}
    for s in streams:
        h.create(s)
    for round_ in range(5):
        for s in streams:
            body = f"{s}:{round_};".encode()
            h.append(s, body)
            expected[s] += body
    assert all(placement(h, s) == (0, 5) for s in streams)
    assert {s: h.contents(s) for s in streams} == expected
    assert fold(h) == 30
    assert all(placement(h, s) == (5, 0) for s in streams)
    assert {s: h.contents(s) for s in streams} == expected
    for s in streams:  # new appends go to the journal again, after the folded ones
        h.append(s, b"+")
        expected[s] += b"+"
    assert all(placement(h, s) == (5, 1) for s in streams)
    assert {s: h.contents(s) for s in streams} == expected


def test_a_full_journal_is_folded_by_the_commit_that_fills_it(h: Harness) -> None:
    h.create("j", JSON)
    items = list(range(FOLD_RECORDS + 3))
    h.append("j", json.dumps(items).encode(), JSON)
    assert placement(h, "j") == (len(items), 0)
    h.append("j", b"[1]", JSON)
    assert placement(h, "j") == (len(items), 1)
    assert json.loads(b"[" + h.contents("j").rstrip(b",") + b"]") == [*items, 1]


def test_a_large_message_folds_its_stream_first_and_order_holds(h: Harness) -> None:
    h.create("s")
    h.create("other")
    h.append("s", b"a")
    h.append("other", b"x")
    h.append("s", b"b")
    big = b"B" * (JOURNAL_MAX_MESSAGE + 1)
    h.append("s", big)
    assert placement(h, "s") == (3, 0)
    assert placement(h, "other") == (0, 1)  # only the big message's stream was folded
    h.append("s", b"c")
    assert placement(h, "s") == (3, 1)
    assert h.contents("s") == b"ab" + big + b"c"
    assert h.contents("other") == b"x"


def test_reads_from_every_position_across_folded_and_journaled_records(h: Harness) -> None:
    h.create("s")
    pieces = [b"one", b"two!", b"three", b"4", b"fives"]
    for p in pieces[:3]:
        h.append("s", p)
    fold(h)
    for p in pieces[3:]:
        h.append("s", p)
    assert placement(h, "s") == (3, 2)
    whole = b"".join(pieces)
    for position in range(len(whole) + 1):
        assert read_from(h, "s", position) == whole[position:], position
        assert read_from(h, "s", position, max_bytes=1) == whole[position:], position


def test_json_boundaries_are_known_in_the_journal(h: Harness) -> None:
    h.create("j", JSON)
    h.append("j", b'[{"a":1},{"b":2}]', JSON)
    fold(h)
    h.append("j", b'[{"c":3},{"d":4}]', JSON)
    whole = h.contents("j")
    ends = [i + 1 for i, ch in enumerate(whole) if ch == ord(",")]
    for position in range(len(whole)):
        if position in (0, *ends):
            read_from(h, "j", position)
        else:
            with pytest.raises(BadRequest):
                read_from(h, "j", position)


def test_forks_read_journaled_source_records_with_sub_offsets(h: Harness) -> None:
    h.create("src")
    h.append("src", b"hello")
    fold(h)
    h.append("src", b"world")
    h.append("src", b"again")
    at_world = h.reads.read_sync("src", offsets.START, 5).next_offset  # the offset the stream issued after "hello"
    assert offsets.parse(at_world).position == 5
    fork(h, "f", "src", offset=at_world)
    fork(h, "g", "src", offset=at_world, sub=3)  # three bytes into "world", which is journaled
    h.append("f", b"!")
    assert h.contents("f") == b"hello!"
    assert h.contents("g") == b"hellowor"
    assert h.contents("src") == b"helloworldagain"


def test_deleting_a_stream_drops_its_journal_records_and_keeps_the_others(h: Harness) -> None:
    for s in ("a", "b", "c"):
        h.create(s)
    for i in range(4):
        for s in ("a", "b", "c"):
            h.append(s, f"{s}{i}".encode())
    sid_b = sid_of(h, "b")
    h.delete("b")
    assert h.stored(sid_b) == 0
    assert h.contents("a") == b"a0a1a2a3"
    assert h.contents("c") == b"c0c1c2c3"
    h.create("b")
    h.append("b", b"new")
    assert h.contents("b") == b"new"
    assert fold(h) == 9


def test_the_journal_survives_a_restart_and_serials_keep_rising(tmp_path: Path, clock: Clock) -> None:
    h = Harness(tmp_path / "wal", clock)
    h.create("s")
    h.append("s", b"12")
    h.append("s", b"34")
    h.close()
    h = Harness(tmp_path / "wal", clock)
    try:
        assert h.contents("s") == b"1234"
        res = h.append("s", b"56")
        assert offsets.parse(res.stream.tail_offset).position == 6
        assert placement(h, "s") == (0, 3)
        fold(h)
        assert h.contents("s") == b"123456"
    finally:
        h.close()


def test_an_aborted_batch_leaves_the_journal_consistent(h: Harness) -> None:
    h.create("s")
    h.append("s", b"kept")

    def append_then_fail(txn: lmdb.Transaction) -> None:
        h.store.append(txn, AppendRequest("s", "text/plain", b"lost", None))
        raise RuntimeError("boom")

    with pytest.raises(Unavailable):
        h.run(append_then_fail)
    h.append("s", b"+more")
    assert h.contents("s") == b"kept+more"
    assert placement(h, "s") == (0, 2)


def test_sealing_uploads_journaled_records_and_drops_them(tmp_path: Path, clock: Clock) -> None:
    h = Harness(tmp_path / "wal", clock, seal=SealPolicy(seal_bytes=6, seal_age=3600, wal_max_bytes=1 << 30))
    try:
        h.create("s")
        h.append("s", b"abc")
        h.append("s", b"def")  # the chunk reaches 6 bytes and rolls
        h.append("s", b"ghi")
        meta = h.meta("s")
        assert meta is not None
        ref = ChunkRef("s", meta.sid, meta.uid, meta.first_chunk)
        got = h.run(lambda txn: h.store.chunk_records(txn, ref))
        assert got is not None
        info, records = got
        assert (info.start, info.end) == (0, 6)
        assert [(end, data) for end, _flags, data in records] == [(3, b"abc"), (6, b"def")]
        assert h.run(lambda txn: h.store.mark_sealed(txn, ref))
        assert placement(h, "s") == (3, 0)  # folded, "ghi" too; the sealed chunk's records go next
        assert read_from(h, "s", 0) == b"abcdefghi"
        assert h.run(lambda txn: h.store.drop_sealed_records(txn, meta.sid)) is False  # all of them, done
        assert placement(h, "s") == (1, 0)  # the sealed chunk's records are gone
        res = h.reads.read_sync("s", offsets.START, 1 << 20)
        assert isinstance(res.sealed, Sealed) and (res.sealed.start, res.sealed.end) == (0, 6)
        assert read_from(h, "s", 6) == b"ghi"
    finally:
        h.close()
