"""A sealed chunk's records leave the WAL in bounded steps (Store.drop_sealed_records), not in
the commit that marks the chunk sealed: that one commit used to delete tens of thousands of
records and held every append batched with it for up to half a second.

What a user would notice if these broke: a read at some offset of a chunk being dropped
returning other bytes, or nothing; records of a chunk whose object is not in the store yet
deleted (its only copy); a chunk object overwritten with a partial body after a retry; sealed
records left in the WAL for good after a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ingester import move_ops
from ingester.chain import Sealed
from ingester.records import ChunkRef, encode_record, record_key
from ingester.sealing import Sealer
from ingester.writes import SealPolicy
from shared.errors import Unavailable
from shared.objectstore import open_store
from shared.placement import Ingester
from tests.wal_harness import Clock, Harness

MESSAGE = 10  # bytes per message
PER_CHUNK = 25  # messages per sealed chunk


def _harness(tmp_path: Path, clock: Clock) -> Harness:
    return Harness(tmp_path / "wal", clock,
                   seal=SealPolicy(seal_bytes=MESSAGE * PER_CHUNK, seal_age=3600, wal_max_bytes=1 << 30))


def _fill(h: Harness, path: str, chunks: int) -> tuple[bytes, list[ChunkRef]]:
    """`chunks` rolled chunks of PER_CHUNK messages each, and one message in the open chunk."""
    h.create(path)
    for i in range(chunks * PER_CHUNK + 1):
        h.append(path, b"%09d|" % i)
    meta = h.meta(path)
    assert meta is not None
    refs = [ChunkRef(path, meta.sid, meta.uid, meta.first_chunk + c) for c in range(chunks)]
    return h.contents(path), refs


async def _until(done: Callable[[], bool]) -> None:
    """Give the sealer's tasks up to 5 s to get there."""
    for _ in range(500):
        if done():
            return
        await asyncio.sleep(0.01)


def _read_at(h: Harness, path: str, position: int) -> bytes | Sealed:
    res = h.reads.read_sync(path, h.offset_at(path, position), 1 << 20)
    return res.sealed if res.sealed is not None else b"".join(res.messages)


def _check_reads(h: Harness, path: str, content: bytes, sealed_end: int) -> None:
    """Every message boundary reads as before: from the WAL, the same bytes to the end; or,
    where the records are gone, a pointer into the sealed chunk holding that position."""
    for position in range(0, len(content), MESSAGE):
        got = _read_at(h, path, position)
        if isinstance(got, Sealed):
            assert position < sealed_end and got.start == position and position < got.end <= sealed_end
        else:
            assert got == content[position:], position


def test_a_sealed_chunks_records_go_in_bounded_steps_and_every_offset_reads_the_same(
    tmp_path: Path, clock: Clock
) -> None:
    h = _harness(tmp_path, clock)
    try:
        content, refs = _fill(h, "s", 1)
        sid = refs[0].sid
        assert h.run(lambda txn: h.store.mark_sealed(txn, refs[0]))
        assert h.stored(sid) == PER_CHUNK + 1  # marked sealed: nothing dropped in that commit
        _check_reads(h, "s", content, PER_CHUNK * MESSAGE)
        left = [h.stored(sid)]
        while h.run(lambda txn: h.store.drop_sealed_records(txn, sid, limit=10)):
            left.append(h.stored(sid))
            _check_reads(h, "s", content, PER_CHUNK * MESSAGE)
        left.append(h.stored(sid))
        assert left == [26, 16, 6, 1]  # ten a step, then the rest; the open chunk's message stays
        _check_reads(h, "s", content, PER_CHUNK * MESSAGE)
        assert _read_at(h, "s", PER_CHUNK * MESSAGE) == content[PER_CHUNK * MESSAGE:]
        assert h.run(lambda txn: h.store.drop_sealed_records(txn, sid)) is False  # nothing more
    finally:
        h.close()


def test_a_drop_stops_at_a_chunk_not_confirmed_yet(tmp_path: Path, clock: Clock) -> None:
    """Uploads may land out of order: the second chunk's confirmation must not take the
    first chunk's records, still the only copy of them."""
    h = _harness(tmp_path, clock)
    try:
        content, refs = _fill(h, "s", 2)
        sid = refs[0].sid
        assert h.run(lambda txn: h.store.mark_sealed(txn, refs[1]))
        assert h.run(lambda txn: h.store.drop_sealed_records(txn, sid)) is False
        assert h.stored(sid) == 2 * PER_CHUNK + 1
        assert h.contents("s") == content
        assert h.run(lambda txn: h.store.mark_sealed(txn, refs[0]))
        while h.run(lambda txn: h.store.drop_sealed_records(txn, sid, limit=7)):
            pass
        assert h.stored(sid) == 1  # both chunks' records, in one run of steps
        _check_reads(h, "s", content, 2 * PER_CHUNK * MESSAGE)
    finally:
        h.close()


def test_a_drop_a_restart_interrupted_is_found_and_finished(tmp_path: Path, clock: Clock) -> None:
    h = _harness(tmp_path, clock)
    try:
        content, refs = _fill(h, "s", 1)
        _fill(h, "other", 1)  # rolled, not confirmed: nothing to drop there
        sid = refs[0].sid
        assert h.run(h.store.load_drops) == []
        assert h.run(lambda txn: h.store.mark_sealed(txn, refs[0]))
        h.run(lambda txn: h.store.drop_sealed_records(txn, sid, limit=3))
    finally:
        h.close()
    h = _harness(tmp_path, clock)  # the restart
    try:
        assert h.run(h.store.load_drops) == [sid]
        objects = open_store(f"file://{tmp_path / 'objects'}")
        sealer = Sealer(h.store, h.committer, objects, h.reads.run)

        async def start_then_wait() -> None:  # (as the service does, on its loop)
            sealer.enqueue_drops(h.run(h.store.load_drops))
            await _until(lambda: h.stored(sid) == 1)

        h.loop.run_until_complete(start_then_wait())
        assert h.stored(sid) == 1
        assert h.run(h.store.load_drops) == []
        _check_reads(h, "s", content, PER_CHUNK * MESSAGE)
        h.loop.run_until_complete(sealer.stop())
    finally:
        h.close()


def test_an_upload_retried_after_its_mark_committed_never_puts_the_chunk_again(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark commits but its caller gets an error (in store durability, a segment upload
    that fails turns a committed write's answer into a 503): the upload loop retries. The
    chunk is sealed and its records may be partly dropped by then: encoding it again would
    PUT a partial body over the object (or, with every record gone, fail for ever)."""
    h = _harness(tmp_path, clock)
    try:
        content, refs = _fill(h, "s", 1)
        sid = refs[0].sid
        objects = open_store(f"file://{tmp_path / 'objects'}")
        puts: list[tuple[str, bytes]] = []
        put = objects.put

        async def counting_put(key: str, data: bytes, **kw: Any) -> str:
            puts.append((key, data))
            return await put(key, data, **kw)

        monkeypatch.setattr(objects, "put", counting_put)
        mark = h.store.mark_sealed

        def mark_then_fail(txn: Any, ref: ChunkRef) -> bool:
            mark(txn, ref)
            h.store.drop_sealed_records(txn, sid, limit=10)  # and some records gone already
            raise Unavailable("the commit log did not reach the store")

        monkeypatch.setattr(h.store, "mark_sealed", mark_then_fail)
        sealer = Sealer(h.store, h.committer, objects, h.reads.run)
        with pytest.raises(Unavailable):
            h.loop.run_until_complete(sealer.upload(refs[0]))
        assert 1 < h.stored(sid) < PER_CHUNK + 1
        monkeypatch.setattr(h.store, "mark_sealed", mark)

        async def retry_then_wait() -> bool:
            done = await sealer.upload(refs[0])  # the upload loop's retry
            await _until(lambda: h.stored(sid) == 1)
            return done

        assert h.loop.run_until_complete(retry_then_wait())
        assert len(puts) == 1  # the chunk was not encoded again from what was left of it
        key, body = puts[0]
        assert h.loop.run_until_complete(objects.get(key)) == body
        assert h.stored(sid) == 1  # the drop went on, in a task of its own
        _check_reads(h, "s", content, PER_CHUNK * MESSAGE)
        h.loop.run_until_complete(sealer.stop())
    finally:
        h.close()


def test_a_failed_drop_is_finished_by_the_streams_next_seal(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = _harness(tmp_path, clock)
    try:
        content, refs = _fill(h, "s", 2)
        sid = refs[0].sid
        objects = open_store(f"file://{tmp_path / 'objects'}")
        drop = h.store.drop_sealed_records
        failing = [True]

        def drop_or_fail(txn: Any, sid: int, limit: int = 1024) -> bool:
            if failing[0]:
                raise OSError("disk trouble")
            return drop(txn, sid, limit=limit)

        monkeypatch.setattr(h.store, "drop_sealed_records", drop_or_fail)
        sealer = Sealer(h.store, h.committer, objects, h.reads.run)

        async def upload_then_settle(ref: ChunkRef) -> None:
            assert await sealer.upload(ref)
            await _until(lambda: not sealer._drops)

        h.loop.run_until_complete(upload_then_settle(refs[0]))
        assert h.stored(sid) == 2 * PER_CHUNK + 1  # the drop failed: the first chunk's records are still here
        _check_reads(h, "s", content, 2 * PER_CHUNK * MESSAGE)
        failing[0] = False
        h.loop.run_until_complete(upload_then_settle(refs[1]))
        assert h.stored(sid) == 1  # both chunks' records
        _check_reads(h, "s", content, 2 * PER_CHUNK * MESSAGE)
        h.loop.run_until_complete(sealer.stop())
    finally:
        h.close()

def test_a_stream_moved_while_its_sealed_records_are_dropped_takes_none_of_them(tmp_path: Path, clock: Clock) -> None:
    h = _harness(tmp_path, clock)
    other = Harness(tmp_path / "other", clock,
                    seal=SealPolicy(seal_bytes=MESSAGE * PER_CHUNK, seal_age=3600, wal_max_bytes=1 << 30))
    try:
        content, refs = _fill(h, "s", 2)
        sid = refs[0].sid
        for ref in refs:
            assert h.run(lambda txn, ref=ref: h.store.mark_sealed(txn, ref))
        h.run(lambda txn: h.store.drop_sealed_records(txn, sid, limit=30))  # the first chunk's, and 5 more
        assert h.stored(sid) == 2 * PER_CHUNK + 1 - 30
        export = h.run(lambda txn: move_ops.freeze_export(h.store, txn, "s", Ingester("b", "http://b"), 1, "a"))
        assert export is not None
        assert [end for end, *_ in export.streams[0].records] == [len(content)]  # the open chunk's only
        other.run(lambda txn: move_ops.import_moved(other.store, txn, export))
        _check_reads(other, "s", content, 2 * PER_CHUNK * MESSAGE)
    finally:
        other.close()
        h.close()


def test_a_record_past_its_chunks_end_stops_a_drop_instead_of_spinning(tmp_path: Path, clock: Clock) -> None:
    """Never written so; but a drop runs on the writer thread, where a loop that cannot
    advance would stop every write of the ingester."""
    h = _harness(tmp_path, clock)
    try:
        _content, refs = _fill(h, "s", 1)
        sid = refs[0].sid
        assert h.run(lambda txn: h.store.mark_sealed(txn, refs[0]))
        h.run(lambda txn: h.store.drop_sealed_records(txn, sid))  # a clean WAL: the open chunk's record left
        assert h.stored(sid) == 1
        bad_end = PER_CHUNK * MESSAGE + 5  # before the open chunk's record, tagged as the sealed chunk's
        h.run(lambda txn: txn.put(record_key(sid, bad_end), encode_record(refs[0].chunk, 0, b"x"), db=h.wal.records))
        assert h.stored(sid) == 2
        assert h.run(lambda txn: h.store.drop_sealed_records(txn, sid)) is False
    finally:
        h.close()


@pytest.mark.parametrize("folded", [0, 10, PER_CHUNK, PER_CHUNK + 1])
def test_a_chunks_records_for_its_upload_come_whole_from_records_and_journal(
    tmp_path: Path, clock: Clock, folded: int
) -> None:
    """The uploader reads `records` entries straight off the cursor, then what is still
    journaled: the chunk is the same whichever part of it was folded."""
    h = _harness(tmp_path, clock)
    try:
        h.create("s")
        for i in range(2 * PER_CHUNK + 1):
            if i == folded:
                h.run(lambda txn: h.store.journal.fold(txn))
            h.append("s", b"%09d|" % i)
        meta = h.meta("s")
        assert meta is not None
        content = h.contents("s")
        for c in range(2):
            ref = ChunkRef("s", meta.sid, meta.uid, meta.first_chunk + c)
            got = h.run(lambda txn, ref=ref: h.store.chunk_records(txn, ref))
            assert got is not None
            info, records = got
            lo = c * PER_CHUNK * MESSAGE
            assert (info.start, info.end) == (lo, lo + PER_CHUNK * MESSAGE)
            assert [end for end, _flags, _data in records] == [lo + (k + 1) * MESSAGE for k in range(PER_CHUNK)]
            assert b"".join(data for _end, _flags, data in records) == content[lo:lo + PER_CHUNK * MESSAGE]
    finally:
        h.close()
