"""A snapshot PUT whose caller goes away (the client disconnects: aiohttp cancels the
handler) while the WAL commit that publishes it waits in the queue: the commit's outcome
decides what happens to the blob, not the cancellation."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import lmdb
import pytest

from ingester.reaper import ObjectReaper
from ingester.snapshots import Snapshots
from shared.errors import NotFound
from shared.objectstore.local import LocalStore
from tests.wal_harness import Clock, Harness


class Parts:
    def __init__(self, tmp_path: Path, clock: Clock) -> None:
        self.h = Harness(tmp_path / "wal", clock, loop=asyncio.get_running_loop())
        self.objects = LocalStore(tmp_path / "objects")
        self.reaper = ObjectReaper(self.h.store, self.h.committer, self.objects)  # not started: see queued()
        self.snapshots = Snapshots(self.h.store, self.h.committer, self.h.reads, self.objects, None,
                                   self._published, self.reaper.enqueue, 1 << 20)

    async def _published(self, path: str) -> None:
        """(no store: nothing for readers to see)"""

    def queued(self) -> list[str]:
        """The object keys given to the reaper."""
        return [self.reaper._queue.get_nowait() for _ in range(self.reaper._queue.qsize())]

    async def publish_cancelled_in_commit(self, offset: str, delete_first: bool = False) -> None:
        """Publish a snapshot at `offset`, cancelled while its commit waits behind a blocked
        writer (behind a DELETE of the stream when `delete_first`: then the commit fails)."""
        started, release = threading.Event(), threading.Event()

        def block(txn: lmdb.Transaction) -> None:
            started.set()
            release.wait(10)

        blocked = self.h.committer.submit(block)
        await asyncio.to_thread(started.wait, 10)
        deleted = self.h.committer.submit(lambda txn: self.h.store.delete(txn, "s")) if delete_first else None
        queued = self.h.committer._queue.qsize()
        task = asyncio.create_task(self.snapshots.publish("s", offset, "application/octet-stream", b"snap"))
        while self.h.committer._queue.qsize() == queued:  # until the blob is stored and its commit queued
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await blocked
        if deleted is not None:
            await deleted
        for _ in range(20):  # the abandoned commit's outcome is handled on the loop, a delete or two later
            await asyncio.sleep(0.01)


async def test_a_publish_cancelled_during_its_commit_keeps_the_committed_blob(tmp_path: Path, clock: Clock) -> None:
    """Before: the commit went through, then the cancel path deleted the blob the committed
    snapshot points to (its reads were 404 from then on), and what it superseded never
    reached the reaper."""
    p = Parts(tmp_path, clock)
    try:
        p.h.create("s")
        first = p.h.append("s", b"one").stream.tail_offset
        await p.snapshots.publish("s", first, "application/octet-stream", b"first")
        first_meta = p.h.meta("s")
        assert first_meta is not None and first_meta.snapshot_key is not None
        second = p.h.append("s", b"two").stream.tail_offset
        await p.publish_cancelled_in_commit(second)
        meta = p.h.meta("s")
        assert meta is not None and meta.snapshot_offset == second and meta.snapshot_key is not None
        assert await p.objects.get(meta.snapshot_key) == b"snap", "the committed snapshot's blob was deleted"
        assert first_meta.snapshot_key in p.queued(), "the superseded snapshot was not given to the reaper"
    finally:
        p.h.close()


async def test_a_publish_cancelled_during_a_failing_commit_deletes_its_blob(tmp_path: Path, clock: Clock) -> None:
    """The other outcome: the commit fails (the stream was deleted first), so nothing points
    at the uploaded blob and it is deleted."""
    p = Parts(tmp_path, clock)
    try:
        p.h.create("s")
        offset = p.h.append("s", b"one").stream.tail_offset
        await p.publish_cancelled_in_commit(offset, delete_first=True)
        assert p.h.meta("s") is None
        assert [o.key async for o in p.objects.list()] == [], "an orphaned snapshot blob was left behind"
        with pytest.raises(NotFound):
            await p.snapshots.latest("s")
    finally:
        p.h.close()
