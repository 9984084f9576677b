"""The ingester's moving parts wired together: WAL, writer, reads, wake-ups, housekeeping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import lmdb

from ingester.live import Notifier
from ingester.reads import ReadResult, Reads
from ingester.records import StreamMeta
from ingester.store import AppendRequest, AppendResult, CreateRequest, CreateResult, Store
from ingester.wal import GroupCommitter, WalEnv
from shared import offsets
from shared.config import IngesterConfig

log = logging.getLogger("ds3.ingester")
T = TypeVar("T")


class IngesterService:
    def __init__(self, config: IngesterConfig) -> None:
        self.config = config
        self.wal = WalEnv(config.wal_dir, config.wal_map_size)
        self.store = Store(self.wal)
        self.notifier = Notifier()
        self.reads = Reads(self.wal, self.store.touches, threads=config.read_threads)
        self._committer: GroupCommitter | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def committer(self) -> GroupCommitter:
        assert self._committer is not None, "service not started"
        return self._committer

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._committer = GroupCommitter(
            self.wal, loop, on_abort=self.store.reset, on_commit=self.store.flush, on_durable=self.notifier.bump
        )
        self._committer.start()
        n = await self.committer.submit(self.store.load_expiry_index)
        log.info("write-ahead log open at %s (%d streams with an expiry)", self.config.wal_dir, n)
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="ds3-housekeeping"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.notifier.wake_all()
        if self._committer is not None:
            with contextlib.suppress(Exception):
                await self.committer.submit(self.store.fold_touches)
            await asyncio.get_running_loop().run_in_executor(None, self.committer.stop)
        self.reads.close()
        self.wal.close()

    # --- writes ------------------------------------------------------------------------

    def _submit(self, fn: Callable[[lmdb.Transaction], T]) -> asyncio.Future[T]:
        return self.committer.submit(fn)

    async def create(self, req: CreateRequest) -> CreateResult:
        return await self._submit(lambda txn: self.store.create(txn, req))

    async def append(self, req: AppendRequest) -> AppendResult:
        return await self._submit(lambda txn: self.store.append(txn, req))

    async def delete(self, path: str) -> None:
        await self._submit(lambda txn: self.store.delete(txn, path))

    # --- reads -------------------------------------------------------------------------

    async def head(self, path: str) -> StreamMeta:
        return await self.reads.head(path)

    async def read(self, path: str, start: offsets.Offset | str, *, renew: bool = True) -> ReadResult:
        res = await self.reads.read(path, start, self.config.max_read_bytes)
        if renew and res.meta.ttl is not None:
            self.store.touches[path] = time.time()
        return res

    def touch(self, meta: StreamMeta) -> None:
        if meta.ttl is not None:
            self.store.touches[meta.path] = time.time()

    # --- housekeeping ------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        """Expire streams and persist TTL renewals; back off (capped) when the WAL fails."""
        delay = self.config.sweep_interval
        last_fold = time.monotonic()
        while True:
            await asyncio.sleep(delay)
            try:
                await self._submit(self.store.sweep_expired)
                if time.monotonic() - last_fold > 5:
                    await self._submit(self.store.fold_touches)
                    last_fold = time.monotonic()
                delay = self.config.sweep_interval
            except Exception:
                log.exception("housekeeping failed")
                delay = min(delay * 2, 60.0)
