"""Snapshots and bootstrap on the ingester (extensions §2-3).

A snapshot blob goes to the object store (or, with no store configured, to a local
directory under the data dir) before the WAL commit that makes it visible, so appends never
wait on the upload. Bootstrap streams the snapshot and then every retained message, one
multipart part each, from the WAL and from sealed chunks; memory stays within one read
page (--max-read-bytes) whatever the history's size."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from ingester import retention
from ingester.reads import Reads
from ingester.records import StreamMeta
from ingester.store import Store
from ingester.wal import GroupCommitter
from shared import chunks, extensions, keys, offsets
from shared import protocol as P
from shared.chunkstore import ChunkReader
from shared.errors import BadRequest, Conflict, NotFound, ObjectNotFound, Retained
from shared.objectstore.base import ObjectStore
from shared.tasks import spawn


@dataclass(frozen=True, slots=True)
class SnapshotBlob:
    meta: StreamMeta
    offset: str
    content_type: str
    size: int
    body: AsyncIterator[bytes]


class Snapshots:
    def __init__(
        self, store: Store, committer: GroupCommitter, reads: Reads, objects: ObjectStore,
        chunk_reader: ChunkReader | None, published: Callable[[str], Awaitable[None]],
        reap: Callable[[list[str]], None], max_read_bytes: int,
    ) -> None:
        self.store = store
        self.committer = committer
        self.reads = reads
        self.objects = objects
        self.chunk_reader = chunk_reader
        self.published = published  # IngesterService.published: readers see the path's descriptor
        self.reap = reap  # IngesterService.reap_when_stored
        self.max_read_bytes = max_read_bytes
        self._cleanups: set[asyncio.Task[None]] = set()  # blob deletes of abandoned publishes

    # --- publish / delete -----------------------------------------------------------------

    async def publish(self, path: str, offset_text: str | None, content_type: str | None, body: bytes) -> None:
        off = extensions.snapshot_offset(offset_text)
        if content_type is None or not content_type.strip():
            content_type = extensions.EMPTY_SNAPSHOT_TYPE
        elif not P.is_valid_content_type(content_type):
            raise BadRequest(f"invalid Content-Type {content_type[:100]!r}")
        elif len(content_type) > extensions.MAX_SNAPSHOT_CONTENT_TYPE:
            raise BadRequest(f"a snapshot's Content-Type is at most {extensions.MAX_SNAPSHOT_CONTENT_TYPE} bytes "
                             f"(this one is {len(content_type)})")
        found = await self.reads.run(self.reads.position_sync, path, off.position)
        if found is None:
            raise Conflict("snapshot offset is beyond the tail of the stream")
        meta = found.meta
        if meta.snapshot_offset is not None and off.position < meta.earliest:
            raise Retained(meta.snapshot_offset, "snapshot offset is older than the earliest retained offset")
        if found.chunk != off.chunk:
            raise BadRequest("snapshot offset is not one this stream issued (its chunk id does not match)")
        boundary = found.boundary
        if boundary is None and found.sealed is not None and self.chunk_reader is not None:
            head = await self.chunk_reader.head(found.sealed.uid, found.sealed.chunk)
            boundary = head.is_boundary(off.position)
        if not boundary:
            raise BadRequest("snapshot offset is not at a message boundary")
        key = keys.snapshot_key(meta.uid, str(off))
        await self.objects.put(key, body, content_type=content_type)
        req = retention.SnapshotRequest(path, meta.sid, str(off), off.position, content_type, len(body), key)
        commit = self.committer.submit(partial(retention.publish, self.store, req=req))
        try:
            garbage = await asyncio.shield(commit)
        except asyncio.CancelledError:
            # The caller went away, not the commit: it goes on in the writer, and its outcome
            # decides whether the blob is the committed snapshot (kept) or an orphan (deleted).
            commit.add_done_callback(partial(self._after_abandoned_commit, key))
            raise
        except BaseException as e:
            if not getattr(e, "in_wal", False):  # the commit did not happen: nothing points at the blob
                with contextlib.suppress(Exception):
                    await self.objects.delete(key)
            # (else: committed, refused for the store's sake (503): it may be shipped later, and
            # then the snapshot is this blob. Found by QA: it was deleted, and the snapshot and
            # /bootstrap answered 404 once the commit shipped.)
            raise
        self.reap(garbage)
        await self.published(path)  # readers answer 410 before the earliest offset once we answer

    def _after_abandoned_commit(self, key: str, commit: asyncio.Future[list[str]]) -> None:
        error = None if commit.cancelled() else commit.exception()
        if commit.cancelled() or (error is not None and not getattr(error, "in_wal", False)):
            spawn(self._delete_quietly(key), self._cleanups, f"deleting the abandoned snapshot {key}")
        elif error is None:
            self.reap(commit.result())  # what the committed snapshot superseded

    async def _delete_quietly(self, key: str) -> None:
        with contextlib.suppress(Exception):
            await self.objects.delete(key)

    async def check_delete(self, path: str, offset_text: str | None) -> None:
        off = extensions.snapshot_offset(offset_text)
        retention.check_delete(await self.reads.head(path), str(off))

    # --- reads ------------------------------------------------------------------------------

    async def latest(self, path: str) -> str:
        meta = await self.reads.head(path)
        if meta.snapshot_offset is None:
            raise NotFound("this stream has no snapshot")
        return meta.snapshot_offset

    async def blob(self, meta: StreamMeta) -> tuple[int, AsyncIterator[bytes]]:
        """The latest snapshot's size and bytes; NotFound when it is gone."""
        assert meta.snapshot_key is not None
        try:
            info = await self.objects.head(meta.snapshot_key)
        except ObjectNotFound:
            raise NotFound("snapshot not found (superseded or removed)") from None
        return info.size, self.objects.stream(meta.snapshot_key)

    async def read(self, path: str, offset_text: str | None) -> SnapshotBlob:
        off = extensions.snapshot_offset(offset_text)
        meta = await self.reads.head(path)
        if meta.snapshot_offset != str(off):
            raise NotFound("no snapshot at that offset (it never existed or was superseded)")
        size, body = await self.blob(meta)
        return SnapshotBlob(meta, meta.snapshot_offset, meta.snapshot_type, size, body)

    async def parts(self, path: str, start: int, until: int, boundary: str, json_mode: bool) -> AsyncIterator[bytes]:
        """Multipart parts (delimiter, headers, body) for the messages in [start, until)."""
        here = start
        while here < until:
            page = await self.reads.run(self.reads.messages_sync, path, here, until, self.max_read_bytes)
            part_type = page.meta.content_type
            if page.sealed is not None:
                if self.chunk_reader is None:  # pragma: no cover - nothing seals without a store
                    raise LookupError("sealed data but no object store")
                s = page.sealed
                piece = await self.chunk_reader.slice(s.uid, s.chunk, here, self.max_read_bytes, cap=s.end)
                data = await self.chunk_reader.read(piece)
                for end, message in chunks.messages_in(piece.head, piece.start, piece.end, data):
                    yield extensions.part_head(boundary, part_type) + extensions.part_body(message, json_mode)
                    here = end
            elif not page.messages:
                raise LookupError(f"no data at position {here} of {path!r}")
            for end, message in page.messages:
                yield extensions.part_head(boundary, part_type) + extensions.part_body(message, json_mode)
                here = end


def parse_position(offset_text: str, what: str) -> offsets.Offset:
    try:
        return offsets.parse(offset_text)
    except offsets.OffsetSyntaxError as e:
        raise BadRequest(f"invalid {what}: {e}") from e
