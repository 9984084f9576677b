"""The shipper's checkpoints: a compacted copy of the LMDB env (env.copy, in a thread) uploaded
as `checkpoint/<seq>-<epoch>.mdb`; then segments entirely at or below its seq and older
checkpoints are deleted.

Taken every --checkpoint-interval (if anything was shipped since), at start when the store
does not cover the local WAL (write-sets live only in memory: after a crash the local seq can
be ahead of the shipped log), and when the queue outgrows MAX_QUEUED_BYTES while the store is
down (the queue is then dropped: the checkpoint covers it). The copy is read into memory for
the upload (ObjectStore.put takes bytes).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

import lmdb

from ingester.log_hook import NOT_SHIPPED
from ingester.logstore import CHECKPOINT_DIR, checkpoint_key, parse_checkpoint_key
from shared.errors import ObjectStoreError, PreconditionFailed, Unavailable
from shared.logsegment import LOG_DIR, parse_segment_key

if TYPE_CHECKING:
    from ingester.shipper import Shipper

log = logging.getLogger("ds3.shipper")

CHECKPOINT_SEGMENTS: Final = 5000  # segments since the last checkpoint that call for one early ...
CHECKPOINT_MIN_SECONDS: Final = 30.0  # ... but no more often than this


class Checkpoints:
    def __init__(self, shipper: Shipper, interval: float) -> None:
        self.shipper = shipper
        self.interval = interval
        self.needed = False  # the queue outgrew MAX_QUEUED_BYTES: drop it for a checkpoint
        self._lock = asyncio.Lock()
        self._last_at = time.monotonic()
        self._shipped_since = 0  # bytes of segments uploaded since the last checkpoint
        self._segments_since = 0
        # metrics
        self.uploaded = 0
        self.bytes = 0
        self.objects_deleted = 0
        self.last_seq = 0

    def shipped(self, size: int) -> None:
        """A segment of `size` bytes landed."""
        self._shipped_since += size
        self._segments_since += 1

    def due(self) -> bool:
        """Every checkpoint_interval if anything was shipped since; sooner (but at most every
        CHECKPOINT_MIN_SECONDS) once CHECKPOINT_SEGMENTS segments accumulated: they bound what
        a recovery fetches."""
        if self._shipped_since == 0:
            return False
        since = time.monotonic() - self._last_at
        return since >= self.interval or (
            self._segments_since >= CHECKPOINT_SEGMENTS and since >= CHECKPOINT_MIN_SECONDS)

    async def take(self) -> int:
        """Copy the whole env, upload it, delete what it covers; returns its commit seq."""
        shipper = self.shipper
        async with self._lock:
            if self.needed:  # the queue was dropped for this checkpoint: it covers them
                shipper.queue.drop(lambda: Unavailable(NOT_SHIPPED, 5))
            epoch = shipper.check_owner()
            started = time.monotonic()
            seq, body = await asyncio.to_thread(self._copy_env)
            shipper.check_owner()
            key = checkpoint_key(seq, epoch)
            try:
                await shipper.objects.put(key, body, content_type="application/octet-stream", if_absent=True)
            except PreconditionFailed:
                pass  # the same commit seq and epoch: the same state (a retry whose answer was lost)
            self.needed = False
            self._last_at = time.monotonic()
            self._shipped_since = 0
            self._segments_since = 0
            self.uploaded += 1
            self.bytes += len(body)
            self.last_seq = seq
            log.info("checkpoint of the WAL at commit %d uploaded (%d bytes, %.2f s)", seq, len(body),
                     time.monotonic() - started)
            shipper.advance(seq)
            await self._delete_covered(seq, key)
            return seq

    def _copy_env(self) -> tuple[int, bytes]:
        """A compacted copy of the env (one read transaction: consistent) and its commit seq."""
        wal = self.shipper.wal
        with tempfile.TemporaryDirectory(prefix="ds3-checkpoint-", dir=self.wal_dir_parent()) as tmp:
            wal.env.copy(tmp, compact=True)
            copy = lmdb.open(tmp, readonly=True, lock=False, max_dbs=16, subdir=True)
            try:
                sys_db = copy.open_db(b"sys", create=False)
                with copy.begin() as txn:
                    raw = txn.get(b"commit_seq", db=sys_db)
            finally:
                copy.close()
            seq = int.from_bytes(raw, "big") if raw is not None else 0
            return seq, (Path(tmp) / "data.mdb").read_bytes()

    def wal_dir_parent(self) -> str:
        return str(Path(self.shipper.wal.env.path()).parent)

    async def _delete_covered(self, seq: int, keep: str) -> None:
        """Segments entirely at or below `seq` and older checkpoints than `keep`."""
        objects = self.shipper.objects
        doomed: list[str] = []
        async for info in objects.list(LOG_DIR):
            rng = parse_segment_key(info.key)
            if rng is not None and rng[1] <= seq:
                doomed.append(info.key)
        async for info in objects.list(CHECKPOINT_DIR):
            parsed = parse_checkpoint_key(info.key)
            if parsed is not None and info.key != keep and parsed[0] <= seq:
                doomed.append(info.key)
        for key in doomed:
            try:
                await objects.delete(key)
                self.objects_deleted += 1
            except ObjectStoreError as e:  # the next checkpoint deletes it
                log.warning("could not delete %s: %s", key, e)
                return
