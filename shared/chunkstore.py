"""Reading sealed chunks from the object store: cached heads, message-aligned slices.

A chunk's head (prelude, header, record index) is immutable, so it is cached for as long
as memory allows; serving a range then costs one ranged GET of exactly the bytes needed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared import chunks, keys
from shared.objectstore.base import MappedRange, ObjectStore

HEAD_FETCH = 64 * 1024  # one GET usually covers prelude, header and index
# Pieces a relay reads from the store: large enough that the per-piece cost (an await, a
# write, for the local store a thread hop) is small against the bytes (measured:
# scripts/bench_catchup.py).
RELAY_PIECE = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Slice:
    """Object bytes [obj_start, obj_end) hold stream positions [start, end)."""

    key: str
    head: chunks.ChunkHead
    obj_start: int
    obj_end: int
    start: int
    end: int


class ChunkReader:
    def __init__(self, store: ObjectStore, cached_heads: int = 4096) -> None:
        self.store = store
        self._heads: OrderedDict[str, chunks.ChunkHead] = OrderedDict()
        self._max = cached_heads

    async def head(self, uid: str, chunk: int) -> chunks.ChunkHead:
        key = keys.chunk_key(uid, chunk)
        cached = self._heads.get(key)
        if cached is not None:
            self._heads.move_to_end(key)
            return cached
        first = await self.store.get(key, 0, HEAD_FETCH)
        prelude = chunks.parse_prelude(first[: chunks.PRELUDE_SIZE])
        need = chunks.PRELUDE_SIZE + prelude.header_length + prelude.index_length
        if len(first) < need:
            first = await self.store.get(key, 0, need)
        head = chunks.parse_head(first)
        self._heads[key] = head
        if len(self._heads) > self._max:
            self._heads.popitem(last=False)
        return head

    async def slice(
        self, uid: str, chunk: int, position: int, max_bytes: int, cap: int | None = None
    ) -> Slice:
        """Whole messages from `position` to the chunk's end (or `cap`), about max_bytes."""
        head = await self.head(uid, chunk)
        obj_start, obj_end, end = head.slice_for(position, max_bytes)
        if cap is not None and end > cap:
            end = cap
            obj_end = head.data_offset + (cap - head.header.start)
        return Slice(keys.chunk_key(uid, chunk), head, obj_start, obj_end, position, end)

    async def read(self, s: Slice) -> bytes:
        if s.obj_end <= s.obj_start:
            return b""
        return await self.store.get(s.key, s.obj_start, s.obj_end)

    def stream(self, s: Slice, piece: int = RELAY_PIECE) -> AsyncIterator[bytes]:
        return self.store.stream(s.key, s.obj_start, s.obj_end, piece)

    async def mapped(self, s: Slice) -> MappedRange | None:
        """The slice as a view of the store's local file (the local store), else None."""
        return await self.store.map_range(s.key, s.obj_start, s.obj_end)
