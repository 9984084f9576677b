"""Serving catch-up reads from sealed chunks: find the chunk that holds an offset's
position (following fork chains), and slice whole messages out of it.

An offset `c_p` names the chunk c holding the byte before position p, so the byte at p is
in chunk c, or in c + 1 when p is c's end. Where a stream's own data begins (position 0,
or a fork's fork position) the first byte is in its first chunk, named by its descriptor:
first chunk ids are random per incarnation (see ingester.records.new_first_chunk)."""

from __future__ import annotations

from dataclasses import dataclass

from reader.descriptors import DescriptorCache
from shared import offsets
from shared.chunkstore import ChunkReader, Slice
from shared.descriptor import Descriptor
from shared.errors import ObjectNotFound


@dataclass(frozen=True, slots=True)
class SealedRead:
    descriptor: Descriptor  # the stream the client asked for
    owner_uid: str  # the stream whose chunk holds the data (an ancestor, for inherited data)
    chunk: int
    piece: Slice
    next_offset: str

    @property
    def final(self) -> bool:
        """This response ends at the final offset of a closed stream."""
        h = self.piece.head.header
        return h.closed and self.piece.end == h.end and self.owner_uid == self.descriptor.uid


class SealedLocator:
    def __init__(self, descriptors: DescriptorCache, chunk_reader: ChunkReader, max_bytes: int) -> None:
        self.descriptors = descriptors
        self.chunks = chunk_reader
        self.max_bytes = max_bytes

    async def find(self, desc: Descriptor, start: offsets.Offset) -> SealedRead | None:
        """The sealed read for `start`, or None when that position is not sealed (yet)."""
        if desc.closed and desc.final_offset is not None and start.position >= _position(desc.final_offset):
            return None  # a closed stream's end: nothing is sealed there (no store request to say so)
        owner, cap = desc, None
        for _ in range(64):  # fork chains are short; the bound only guards against cycles
            if owner.fork_source is None or start.position >= owner.fork_position:
                break
            cap = owner.fork_position if cap is None else min(cap, owner.fork_position)
            source = await self.descriptors.get(owner.fork_source)
            if source is None or source.uid != owner.fork_source_uid:
                return None
            owner = source
        else:
            return None
        own_start = owner.fork_position if owner.fork_source is not None else 0
        candidates = (owner.first_chunk,) if start.position == own_start else (start.chunk, start.chunk + 1)
        for chunk in candidates:
            try:
                head = await self.chunks.head(owner.uid, chunk)
            except ObjectNotFound:
                continue
            h = head.header
            if h.start <= start.position < h.end:
                piece = await self.chunks.slice(owner.uid, chunk, start.position, self.max_bytes, cap=cap)
                return SealedRead(desc, owner.uid, chunk, piece, offsets.encode(chunk, piece.end))
        return None


def _position(offset: str) -> int:
    try:
        return offsets.parse(offset).position
    except ValueError:
        return 1 << 62  # not ours to judge: look it up
