"""The group committer when LMDB fails: a commit that does not happen changes nothing, not
even what the event loop does after a commit (no objects deleted for a delete that failed)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import lmdb
import pytest

from ingester.store import AppendRequest, SealPolicy
from shared.config import MiB
from shared.errors import Unavailable
from tests.wal_harness import Clock, Harness


class FailingCommits:
    """An LMDB environment whose write transactions fail to commit, as with EIO from
    fdatasync: LMDB aborts the transaction, so nothing it did is stored."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, write: bool = False, **kw: Any) -> Any:
        txn = self._env.begin(write=write, **kw)
        return _FailingCommit(txn) if write else txn


class _FailingCommit:
    def __init__(self, txn: lmdb.Transaction) -> None:
        self.txn = txn

    def __enter__(self) -> lmdb.Transaction:
        return self.txn

    def __exit__(self, exc_type: object, *rest: object) -> bool:
        self.txn.abort()
        if exc_type is None:
            raise lmdb.DiskError("injected: the commit failed")
        return False


async def test_a_delete_whose_commit_fails_deletes_no_objects(tmp_path: Path, clock: Clock) -> None:
    """Before: the batch's news (here: the deleted stream's objects to remove) reached
    on_durable although the commit failed, and the GC loop deleted the sealed chunks of a
    stream that still exists."""
    h = Harness(tmp_path / "wal", clock, loop=asyncio.get_running_loop(), seal=SealPolicy(1024, 60.0, 64 * MiB))
    try:
        h.create("s")
        h.append("s", b"kept")
        meta = h.meta("s")
        assert meta is not None
        real = h.wal.env
        h.wal.env = FailingCommits(real)  # type: ignore[assignment]
        with pytest.raises(Unavailable):
            await h.committer.submit(lambda txn: h.store.delete(txn, "s"))
        h.wal.env = real
        await h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("s", "text/plain", b"+more", None)))  # a commit that works
        removed = [r for news in h.durable for r in news.removed]
        assert removed == [], "objects queued for deletion by a delete that was never committed"
        after = h.meta("s")
        assert after is not None and after.uid == meta.uid
        assert h.contents("s") == b"kept+more"
        await h.committer.submit(lambda txn: h.store.delete(txn, "s"))  # and a real delete still works
        assert [r for news in h.durable for r in news.removed] == [(meta.uid, "s")]
    finally:
        h.close()
