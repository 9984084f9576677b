"""A standby following the store's log (ingester/log_follow.py), driven step by step over a
local store with segments written as owners would: what it builds is always what a restore of
the same log builds, it only reads the store while following, and at a takeover it keeps the
followed WAL only when a restore would build the same one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ingester.log_follow import LogFollower
from ingester.logstore import checkpoint_key, list_log, restore
from ingester.wal import WalEnv
from shared.logsegment import DB_IDS, PUT, Commit, encode, segment_key
from shared.objectstore import LocalStore
from tests.wal_harness import dump

MAP = 64 * 1024 * 1024
STREAMS = DB_IDS["streams"]


def commit(seq: int, tag: bytes = b"k") -> Commit:
    return Commit(seq, [(STREAMS, PUT, tag + b"%d" % seq, b"v%d" % seq)])


async def put(objects: LocalStore, first: int, last: int, epoch: int, tag: bytes = b"k") -> None:
    await objects.put(segment_key(first, last), encode([commit(s, tag) for s in range(first, last + 1)], epoch=epoch))


def wal_dump(path: Path) -> dict[str, Any]:
    w = WalEnv(path, MAP)
    try:
        return dump(w)
    finally:
        w.close()


async def restored(objects: LocalStore, path: Path) -> dict[str, Any]:
    """What a restore of the log as it is now builds (a copy of the store: restore deletes orphans)."""
    await restore(objects, path, MAP)
    return wal_dump(path)


@pytest.fixture
def objects(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "objects")


async def test_it_follows_the_log_as_segments_land(tmp_path: Path, objects: LocalStore) -> None:
    f = LogFollower(objects, tmp_path / "wal", MAP)
    await put(objects, 1, 2, epoch=1)
    assert await f.step() == 2 and f.seq == 2 and f.restores == 1
    await put(objects, 3, 3, epoch=1)
    await put(objects, 5, 6, epoch=1)  # 4 is still uploading: the chain waits for it
    assert await f.step() == 1 and f.seq == 3
    await put(objects, 4, 4, epoch=1)
    assert await f.step() == 3 and f.seq == 6 and f.restores == 1  # extended, not restored again
    assert wal_dump(tmp_path / "wal") == await restored(objects, tmp_path / "r")


async def test_a_takeover_replays_only_what_landed_since(tmp_path: Path, objects: LocalStore) -> None:
    f = LogFollower(objects, tmp_path / "wal", MAP)
    await put(objects, 1, 3, epoch=1)
    await f.step()
    await put(objects, 4, 5, epoch=1)
    await put(objects, 7, 7, epoch=1)  # an orphan: 6 never landed (never acknowledged in store mode)
    done = await f.take_over()
    assert done.startswith("followed the log to commit 3; 2 more"), done
    assert f.seq == 5
    assert [r.key for r in (await list_log(objects)).segments] == [segment_key(1, 3), segment_key(4, 5)]
    assert wal_dump(tmp_path / "wal") == await restored(objects, tmp_path / "r")


async def test_following_deletes_nothing(tmp_path: Path, objects: LocalStore) -> None:
    f = LogFollower(objects, tmp_path / "wal", MAP)
    await put(objects, 1, 1, epoch=1)
    await put(objects, 3, 3, epoch=1)  # beyond a hole: the owner's business, not a standby's
    await f.step()
    await f.step()
    assert len((await list_log(objects)).segments) == 2 and f.seq == 1


async def test_a_newer_epoch_over_followed_commits_makes_the_takeover_restore(tmp_path: Path,
                                                                              objects: LocalStore) -> None:
    """The follower took commit 2 from a superseded owner's late write (epoch 1) before the new
    owner's segment for it (epoch 2) landed: a restore takes the new owner's, so the takeover
    does not keep the followed WAL."""
    f = LogFollower(objects, tmp_path / "wal", MAP)
    await put(objects, 1, 1, epoch=1)
    await put(objects, 2, 2, epoch=1, tag=b"old")
    await f.step()
    assert f.seq == 2
    await put(objects, 2, 3, epoch=2, tag=b"new")
    done = await f.take_over()
    assert done.startswith("restored the whole log") and "epoch 2" in done, done
    expected = await restored(objects, tmp_path / "r")
    assert [k for k, _ in expected["streams"]] == [b"k1", b"new2", b"new3"]
    assert wal_dump(tmp_path / "wal") == expected


async def test_a_same_epoch_re_cut_over_followed_commits_is_kept(tmp_path: Path, objects: LocalStore) -> None:
    """An owner's re-cut segment (its answer was lost: the same commits again, reaching
    further) changes nothing a restore would build up to where the follower is."""
    f = LogFollower(objects, tmp_path / "wal", MAP)
    await put(objects, 1, 2, epoch=1)
    await f.step()
    await put(objects, 2, 4, epoch=1)
    done = await f.take_over()
    assert done.startswith("followed the log to commit 2; 2 more"), done
    assert wal_dump(tmp_path / "wal") == await restored(objects, tmp_path / "r")


async def test_a_new_checkpoint_restores_from_it(tmp_path: Path, objects: LocalStore) -> None:
    """The owner checkpointed (and may drop the segments it covers, or have commits only it
    holds): a step restores from it, and so does a takeover that finds it first."""
    owner = tmp_path / "owner"
    await put(objects, 1, 2, epoch=1)
    await restore(objects, owner, MAP)  # the owner's WAL at commit 2, checkpointed
    f = LogFollower(objects, tmp_path / "wal", MAP)
    await f.step()
    data = (owner / "data.mdb").read_bytes()
    await objects.put(checkpoint_key(2, 1), data)
    await put(objects, 3, 3, epoch=1)
    assert await f.step() == 1 and f.restores == 2 and f.seq == 3  # from the checkpoint: commit 3 replayed
    await restore(objects, tmp_path / "owner3", MAP)  # the owner's WAL at commit 3, checkpointed
    await objects.put(checkpoint_key(3, 1), (tmp_path / "owner3" / "data.mdb").read_bytes())
    await objects.delete(segment_key(1, 2))  # what the checkpoint covers goes
    done = await f.take_over()
    assert done.startswith("restored the whole log") and "checkpointed" in done and f.seq == 3, done
    assert wal_dump(tmp_path / "wal") == wal_dump(tmp_path / "owner3")


async def test_a_failed_step_leaves_a_usable_chain_or_none(tmp_path: Path, objects: LocalStore) -> None:
    """A segment that cannot be read fails the step; the next takeover restores the whole log
    (nothing half-applied is kept)."""
    f = LogFollower(objects, tmp_path / "wal", MAP)
    await put(objects, 1, 1, epoch=1)
    await f.step()
    await objects.put(segment_key(2, 2), b"not a segment")
    with pytest.raises(Exception, match="prelude"):
        await f.step()
    assert f.chain is None
    await objects.delete(segment_key(2, 2))
    await put(objects, 2, 2, epoch=1)
    done = await f.take_over()
    assert done.startswith("restored the whole log") and f.seq == 2, done
