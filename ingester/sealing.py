"""Moving sealed history to the object store, off the write path.

- Uploader: for each rolled chunk, read its records (read transaction, thread pool), encode
  the chunk object, PUT it, and only then ask the writer to mark it sealed; its records then
  leave the WAL a bounded step per commit (drop_records). A crash anywhere before the mark
  re-uploads the same bytes after restart (the object is a pure function of the records), so
  nothing is lost and nothing is half-visible; a chunk once marked is never encoded again.
- Cleaner: deletes the objects of removed streams (their uids are recorded in the WAL in
  the same transaction as the removal, so a crash cannot leak them).
- Publisher (ingester/publisher.py): writes stream descriptors (create, close, delete) for
  readers.

Each loop retries with capped exponential backoff while the store is down; appends keep
being acknowledged from the WAL meanwhile (until --wal-max-bytes, then 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal

from prometheus_client import Histogram

from ingester.backoff import Backoff
from ingester.publisher import Publisher
from ingester.records import SEALED, ChunkRef, StreamMeta
from ingester.store import Store
from ingester.wal import GroupCommitter
from shared import chunks, keys
from shared.descriptor import Descriptor
from shared.errors import ObjectNotFound
from shared.objectstore.base import ObjectStore
from shared.tasks import spawn

log = logging.getLogger("ds3.sealing")
CHUNK_CONTENT_TYPE = "application/vnd.ds3.chunk"
UPLOAD_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Sealer:
    def __init__(
        self,
        store: Store,
        committer: GroupCommitter,
        objects: ObjectStore,
        run_read: Callable[..., Awaitable[Any]],
        uploads: int = 4,
    ) -> None:
        self.store = store
        self.committer = committer
        self.objects = objects
        self._run_read = run_read
        self._uploads = uploads
        self._queue: asyncio.Queue[ChunkRef] = asyncio.Queue()
        self._gc: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.publisher = Publisher(store, committer, objects)
        self._tasks: list[asyncio.Task[None]] = []
        self._drops: set[asyncio.Task[None]] = set()  # enqueue_drops
        self._drop_turn = asyncio.Lock()  # drop_records: one step in flight
        self.uploaded = 0
        self.upload_failures = 0
        self.in_flight = 0
        self.gc_deleted = 0  # objects of removed streams deleted
        # Collected by ingester.metrics at scrape time.
        self.upload_seconds = Histogram(
            "ds3_seal_upload_seconds", "Time to seal one chunk: read it from the WAL, encode, PUT, mark it sealed "
            "(successful attempts; its records leave the WAL afterwards).", buckets=UPLOAD_SECONDS_BUCKETS, registry=None,
        )

    # --- feeding -------------------------------------------------------------------------

    def enqueue_chunks(self, refs: list[ChunkRef]) -> None:
        for ref in refs:
            self._queue.put_nowait(ref)

    def enqueue_drops(self, sids: list[int]) -> None:
        """Drop these streams' records of sealed chunks, each in a task of its own: after an
        upload, and at start for drops a restart interrupted (Store.load_drops). A drop that
        fails is left to the stream's next seal or the next start (both find it)."""
        for sid in sids:
            spawn(self.drop_records(sid), self._drops, "dropping sealed records from the WAL (the stream's next "
                  "seal, or the next start, goes on with it)", logger=log)

    def enqueue_removed(self, items: list[tuple[str, str]]) -> None:
        for item in items:
            self._gc.put_nowait(item)

    def enqueue_descriptors(self, changes: dict[str, Descriptor | None]) -> None:
        self.publisher.enqueue(changes)

    @property
    def backlog(self) -> int:
        return self._queue.qsize() + self.in_flight

    def start(self) -> None:
        for i in range(self._uploads):
            self._tasks.append(asyncio.create_task(self._upload_loop(), name=f"ds3-upload-{i}"))
        self._tasks.append(asyncio.create_task(self._gc_loop(), name="ds3-gc"))
        self._tasks.append(asyncio.create_task(self.publisher.run(), name="ds3-publish"))

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._drops]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    # --- uploads -------------------------------------------------------------------------

    async def upload(self, ref: ChunkRef) -> bool:
        """One attempt: encode, PUT, confirm. False if the stream is gone."""
        found = await self._run_read(self._read_chunk, ref)
        if found is None:
            return False
        if found != SEALED:  # (sealed by an attempt whose record drops failed: never PUT again)
            key, body = found
            await self.objects.put(key, body, content_type=CHUNK_CONTENT_TYPE)
            if not await self.committer.submit(lambda txn: self.store.mark_sealed(txn, ref)):
                return False
        self.enqueue_drops([ref.sid])  # (a task of its own: the next upload need not wait for it)
        return True

    async def drop_records(self, sid: int) -> None:
        """Drop a stream's records of sealed chunks from the WAL, a bounded step per commit
        (Store.drop_sealed_records), one step in flight for all streams (their turns in
        order): appends committed alongside wait for one step, not for a whole chunk's
        records, nor for a step of every stream that sealed at the same time."""
        more = True
        while more:
            async with self._drop_turn:
                more = await self.committer.submit(partial(self.store.drop_sealed_records, sid=sid))

    def _read_chunk(self, ref: ChunkRef) -> tuple[str, bytes] | Literal["sealed"] | None:
        """The chunk's object key and body; SEALED if it is confirmed already (its records
        may be partly dropped: never encode it again); None if the stream is gone."""
        with self.store.wal.env.begin(buffers=False) as txn:
            got = self.store.chunk_records(txn, ref)
            meta_raw = txn.get(ref.path.encode(), db=self.store.wal.streams)
        if got is None:
            return None
        info, records = got
        if info.state == SEALED:
            return SEALED
        content_type = StreamMeta.decode(meta_raw).content_type if meta_raw is not None else ""
        header = chunks.ChunkHeader(
            sid=ref.sid if info.header_sid is None else info.header_sid, chunk=ref.chunk, start=info.start, end=info.end, content_type=content_type,
            records=len(records), closed=info.closed, created_at=info.sealed_at, path=ref.path,
        )
        return keys.chunk_key(ref.uid, ref.chunk), chunks.encode_chunk(header, records)

    async def _upload_loop(self) -> None:
        backoff = Backoff()
        while True:
            ref = await self._queue.get()
            self.in_flight += 1
            try:
                while True:
                    try:
                        started = time.perf_counter()
                        await self.upload(ref)
                        self.upload_seconds.observe(time.perf_counter() - started)
                        self.uploaded += 1
                        backoff.reset()
                        break
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        self.upload_failures += 1
                        log.warning("upload of %s chunk %d failed (%s); retrying in %.1fs",
                                    ref.path, ref.chunk, e, backoff.delay)
                        await backoff.sleep()
            finally:
                self.in_flight -= 1

    # --- garbage ---------------------------------------------------------------------------

    async def _gc_loop(self) -> None:
        backoff = Backoff()
        while True:
            uid, path = await self._gc.get()
            while True:
                try:
                    # Descriptor first: once it is gone no reader locates the chunks any more.
                    await self._delete_descriptor_if(path, uid)
                    self.gc_deleted += await self.objects.delete_prefix(keys.chunk_prefix(uid))
                    self.gc_deleted += await self.objects.delete_prefix(keys.snapshot_prefix(uid))
                    await self.committer.submit(partial(self.store.gc_done, uid=uid))
                    backoff.reset()
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.warning("deleting objects of removed stream %s failed (%s)", uid, e)
                    await backoff.sleep()

    async def _delete_descriptor_if(self, path: str, uid: str) -> None:
        key = keys.descriptor_key(path)
        try:
            current = Descriptor.decode(await self.objects.get(key))
        except ObjectNotFound:
            return
        if current.uid == uid:
            await self.objects.delete(key)

    # --- descriptors -------------------------------------------------------------------------

    async def published(self, path: str, timeout: float) -> bool:
        """Wait (bounded) until the path's descriptor change has reached the store, so a
        create or delete is visible to every reader once it is acknowledged."""
        return await self.publisher.published(path, timeout)
