"""Deletes objects that a committed change made unreachable (superseded snapshots, chunks
before the earliest retained offset), then clears their `del:` entries in the WAL.

The entries are written in the same transaction as the change (ingester.retention), so a
crash between the commit and the deletes only delays them: they are loaded again at start.
Failures back off (capped) and retry; deleting a missing object is not an error."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial

from ingester import retention
from ingester.backoff import Backoff
from ingester.store import Store
from ingester.wal import GroupCommitter
from shared.objectstore.base import ObjectStore

log = logging.getLogger("ds3.reaper")
BATCH = 256


class ObjectReaper:
    def __init__(self, store: Store, committer: GroupCommitter, objects: ObjectStore) -> None:
        self.store = store
        self.committer = committer
        self.objects = objects
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.deleted = 0

    def enqueue(self, object_keys: list[str]) -> None:
        for key in object_keys:
            self._queue.put_nowait(key)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="ds3-reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def run_once(self) -> int:
        """Delete what is queued now (at most BATCH keys); for tests and the loop."""
        batch = [await self._queue.get()]
        while len(batch) < BATCH and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        try:
            for key in batch:
                await self.objects.delete(key)
        except BaseException:
            for key in batch:  # all of them again: deletes are idempotent
                self._queue.put_nowait(key)
            raise
        await self.committer.submit(partial(retention.deleted, self.store, object_keys=batch))
        self.deleted += len(batch)
        return len(batch)

    async def _loop(self) -> None:
        backoff = Backoff()
        while True:
            try:
                await self.run_once()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("deleting unreachable objects failed (%s); retrying in %.1fs", e, backoff.delay)
                await backoff.sleep()
