"""The writer operations of a move (ingester/moves.py) on two real WALs, without HTTP: freeze +
export on the old owner, the move format's round trip, import on the new owner, the drop. Both
WALs log their commits and are checked by replay when closed (freeze, import and drop are
ordinary logged commits, so `--durability store` keeps them)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from ingester import remote_forks
from ingester.move_ops import drop_moved, freeze_export, frozen_error, import_moved
from ingester.records import SEALING, ChunkInfo, StreamMeta
from ingester.writes import SealPolicy
from shared import moveformat
from shared.errors import Conflict, Misdirected
from shared.placement import Ingester
from tests.wal_harness import Clock, Harness, ShadowLog

B = Ingester("b", "http://127.0.0.1:2")
SEAL = SealPolicy(seal_bytes=8, seal_age=3600, wal_max_bytes=1 << 30)


def frozen_guard(path: str, meta: StreamMeta | None) -> None:
    """Store.guard as a cluster member has it, minus the ownership part."""
    if meta is not None and meta.moved_to is not None:
        raise frozen_error(meta)


def test_freeze_export_import_drop_keeps_everything(tmp_path: Path, clock: Clock) -> None:
    logs = (ShadowLog(), ShadowLog())
    a = Harness(tmp_path / "a", clock, seal=SEAL, on_logged=logs[0])
    b = Harness(tmp_path / "b", clock, seal=SEAL, on_logged=logs[1])
    try:
        a.store.guard = b.store.guard = frozen_guard
        b.create("other")  # b's sids differ from a's
        a.create("s", ttl=3600)
        for seq in range(4):  # 5-byte appends over 8-byte chunks: rolled (`sealing`) chunks and an open one
            a.append("s", b"m%03d;" % seq, producer=("p", 1, seq), seq=f"{seq:04d}")
        before, sid_a = a.contents("s"), a.meta("s").sid  # type: ignore[union-attr]
        export = a.run(functools.partial(freeze_export, a.store, key="s", to=B, generation=2, me="a"))
        assert export is not None
        again = a.run(functools.partial(freeze_export, a.store, key="s", to=B, generation=2, me="a"))
        body = moveformat.encode(export)
        assert moveformat.encode(again) == body  # asked again (a lost answer): the same export
        # frozen: no write lands on a any more, reads say where it went
        with pytest.raises(Misdirected):
            a.append("s", b"late", producer=("p", 1, 4))
        with pytest.raises(Misdirected):
            a.contents("s")
        c = Ingester("c", "http://127.0.0.1:3")
        with pytest.raises(Conflict, match="was moved to ingester b"):
            a.run(functools.partial(freeze_export, a.store, key="s", to=c, generation=3, me="a"))

        got = moveformat.decode(body)
        b.run(functools.partial(import_moved, b.store, export=got))
        meta = b.meta("s")
        assert meta is not None and meta.sid != sid_a and meta.uid == export.streams[0].meta["uid"]
        assert meta.moved_to is None and meta.ttl == 3600 and meta.stream_seq == "0003"
        assert b.contents("s") == before == b"m000;m001;m002;m003;"
        # the rolled chunks come back `sealing`, to be uploaded with the header a's sid named
        with b.wal.env.begin() as txn:
            infos = [ChunkInfo.decode(txn.get(k, db=b.wal.chunks)) for k in b.keys(b.wal.chunks, meta.sid)]
        assert len(infos) == 2 and all(i.state == SEALING and i.header_sid == sid_a for i in infos)
        # producer state: the last acknowledged append again is a duplicate, the next one lands
        assert b.append("s", b"m003;", producer=("p", 1, 3), seq="0004").duplicate
        assert not b.append("s", b"m004;", producer=("p", 1, 4), seq="0004").duplicate
        assert b.contents("s") == before + b"m004;"
        # the drop leaves no trace of the stream on a, and no object for the gc to delete
        assert a.run(functools.partial(drop_moved, a.store, key="s", owned_here=False)) == 1
        assert a.meta("s") is None and a.stored(sid_a) == 0 and a.keys(a.wal.producers, sid_a) == []
        with a.wal.env.begin() as txn:
            assert not any(bytes(k).startswith(b"gc:") for k, _ in txn.cursor(a.wal.sys))
        assert a.run(functools.partial(drop_moved, a.store, key="s", owned_here=False)) == 0  # idempotent
        assert a.run(functools.partial(freeze_export, a.store, key="s", to=B, generation=2, me="a")) is None
    finally:
        a.close()  # replays each WAL's log into an empty one and compares
        b.close()


def test_buckets_move_whole_and_forks_move_with_their_pins(tmp_path: Path, clock: Clock) -> None:
    a = Harness(tmp_path / "a", clock, on_logged=ShadowLog())
    b = Harness(tmp_path / "b", clock, on_logged=ShadowLog())
    try:
        a.run(lambda txn: a.store.buckets.create(txn, "bk", clock.now))
        for n in range(2):
            a.create(f"\x00b/bk/s{n}")
            a.append(f"\x00b/bk/s{n}", b"x%d" % n)
        export = a.run(functools.partial(freeze_export, a.store, key="\x00b/bk/", to=B, generation=2, me="a"))
        assert export is not None and export.bucket is not None and export.bucket["streams"] == 2
        b.run(functools.partial(import_moved, b.store, export=moveformat.decode(moveformat.encode(export))))
        assert [b.contents(f"\x00b/bk/s{n}") for n in range(2)] == [b"x0", b"x1"]
        assert a.run(functools.partial(drop_moved, a.store, key="\x00b/bk/", owned_here=False)) == 2
        with a.wal.env.begin() as txn:
            assert txn.get(b"bk", db=a.wal.buckets) is None
        with b.wal.env.begin() as txn:
            assert txn.get(b"bk", db=b.wal.buckets) is not None
        # a bucket holding a source and its fork moves whole: they stay a local pair there
        a.run(lambda txn: a.store.buckets.create(txn, "pair", clock.now))
        a.create("\x00b/pair/src")
        a.append("\x00b/pair/src", b"S")
        a.create("\x00b/pair/fork", None, fork_from="\x00b/pair/src")
        a.append("\x00b/pair/fork", b"F")
        export = a.run(functools.partial(freeze_export, a.store, key="\x00b/pair/", to=B, generation=2, me="a"))
        assert export is not None and all(m.source is None for m in export.streams)
        b.run(functools.partial(import_moved, b.store, export=moveformat.decode(moveformat.encode(export))))
        assert b.contents("\x00b/pair/fork") == b"SF"
        fork_b, src_b = b.meta("\x00b/pair/fork"), b.meta("\x00b/pair/src")
        assert fork_b is not None and src_b is not None
        assert fork_b.fork_source_key is None and fork_b.fork_source_sid == src_b.sid and src_b.refcount == 1
        # a source moving alone: the fork staying here then reads a shadow of it, and the new
        # owner holds the fork's pin (its release goes there)
        a.create("src")
        a.append("src", b"S1")
        a.create("fork", None, fork_from="src")
        a.append("fork", b"F1")
        src_uid, fork_uid = a.meta("src").uid, a.meta("fork").uid  # type: ignore[union-attr]
        export = a.run(functools.partial(freeze_export, a.store, key="src", to=B, generation=2, me="a"))
        assert export is not None and export.streams[0].pins == [fork_uid]
        b.run(functools.partial(import_moved, b.store, export=moveformat.decode(moveformat.encode(export))))
        a.run(functools.partial(drop_moved, a.store, key="src", owned_here=False))
        assert a.meta("src") is None and a.contents("fork") == b"S1F1"
        assert a.meta("fork").fork_source_key == remote_forks.shadow_key(src_uid)  # type: ignore[union-attr]
        assert b.meta("src").refcount == 1  # type: ignore[union-attr]
        assert b.run(lambda txn: remote_forks.pins_of(b.store, txn, src_uid)) == [fork_uid]
        # ... and the fork moving after it: it takes the shadow's chain along, a drops its shadow
        export = a.run(functools.partial(freeze_export, a.store, key="fork", to=B, generation=2, me="a"))
        assert export is not None and export.streams[0].source is not None
        b.run(functools.partial(import_moved, b.store, export=moveformat.decode(moveformat.encode(export))))
        a.run(functools.partial(drop_moved, a.store, key="fork", owned_here=False))
        assert b.contents("fork") == b"S1F1"
        assert a.meta(remote_forks.shadow_key(src_uid)) is None
        # nothing held: None (the new owner goes on as usual)
        assert a.run(functools.partial(freeze_export, a.store, key="nope", to=B, generation=2, me="a")) is None
    finally:
        a.close()
        b.close()


def test_a_damaged_move_body_is_refused() -> None:
    export = moveformat.MoveExport("k", 2, "a", None, [moveformat.MovedStream({"path": "k"}, 7, [], [],
                                                                             [(3, 1, 1, b"abc")])])
    body = moveformat.encode(export)
    assert moveformat.decode(body).streams[0].records == [(3, 1, 1, b"abc")]
    for bad, why in [(body[:-1], "CRC"), (body[:20] + b"x" + body[21:], "CRC"), (b"nope" * 4, "magic")]:
        with pytest.raises(moveformat.MoveFormatError, match=why):
            moveformat.decode(bad)
