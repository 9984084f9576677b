"""Serving catch-up reads from sealed chunks: find the chunk that holds an offset's
position (following fork chains), and slice whole messages out of it.

An offset `c_p` names the chunk c holding the byte before position p, so the byte at p is
in chunk c, or in c + 1 when p is c's end. An offset that names another chunk is not one the
stream issued: it is not served from here, and the ingester refuses it (400). Where a
stream's own data begins (position 0, or a fork's fork position) the first byte is in its
first chunk, named by its descriptor: first chunk ids are random per incarnation (see
ingester.records.new_first_chunk).

A chunk the store does not have (yet) is remembered as missing for `recheck_seconds` (the
reader's --descriptor-ttl, 1 s by default): reads at a stream's unsealed tail (the empty page
every caught-up client reads, a catch-up of what the ingester still holds) would otherwise cost
two store lookups each before they are passed to the ingester, two round trips to S3
(milliseconds each) per read. A chunk sealed meanwhile is read from the ingester for at most
that long, which answers it just as well; should the ingester be unreachable, the reader asks
the store again at once (reader/http.py), so sealed history stays readable without it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from reader.descriptors import DescriptorCache
from shared import offsets
from shared.chunkstore import ChunkReader, Slice
from shared.descriptor import Descriptor
from shared.errors import ObjectNotFound

MISSING_REMEMBERED: Final = 4096  # streams with chunks remembered missing; the longest unasked are forgotten


@dataclass(frozen=True, slots=True)
class SealedRead:
    descriptor: Descriptor  # the stream the client asked for
    owner_uid: str  # the stream whose chunk holds the data (an ancestor, for inherited data)
    chunk: int
    piece: Slice
    next_offset: str
    at_fork_point: bool = False  # inherited data ending where a fork's own begins

    @property
    def final(self) -> bool:
        """This response ends at the final offset of a closed stream: its chunk was sealed by
        the close, or the descriptor says the stream was closed where the chunk ends."""
        h, d = self.piece.head.header, self.descriptor
        if self.owner_uid != d.uid or self.piece.end != h.end:
            return False
        return h.closed or (d.closed and d.final_offset is not None and _position(d.final_offset) == h.end)


class SealedLocator:
    def __init__(self, descriptors: DescriptorCache, chunk_reader: ChunkReader, max_bytes: int,
                 recheck_seconds: float = 1.0) -> None:
        self.descriptors = descriptors
        self.chunks = chunk_reader
        self.max_bytes = max_bytes
        self.recheck_seconds = recheck_seconds
        self._missing: OrderedDict[str, dict[int, float]] = OrderedDict()  # uid -> chunk -> when to ask again
        self.lookups = 0  # chunk heads asked of the store (or its cache)
        self.missing_hits = 0  # lookups answered "not sealed" from memory, no store request

    def known_unsealed(self, desc: Descriptor, start: offsets.Offset) -> bool:
        """Whether `start` is, as far as this reader knows now, not sealed (without asking
        anything): a read there goes to the ingester. False when the store must be asked."""
        if _at_closed_end(desc, start):
            return True
        if desc.fork_source is not None and start.position < desc.fork_position:
            return False  # inherited: the source's chunks
        candidates = _candidates(desc, start)
        now = time.monotonic()
        if not all(self._is_missing(desc.uid, chunk, now) for chunk in candidates):
            return False
        self.lookups += len(candidates)
        self.missing_hits += len(candidates)
        return True

    async def sealed_after(self, found: SealedRead) -> bool:
        """Whether the chunk after `found`'s is in the store: then a page ending at its chunk's
        end is not at the stream's tail (no need to ask the ingester where the tail is)."""
        uid, chunk = found.owner_uid, found.chunk + 1
        if self._is_missing(uid, chunk, time.monotonic()):
            return False
        try:
            await self.chunks.head(uid, chunk)
        except ObjectNotFound:
            self._remember_missing(uid, chunk)
            return False
        return True

    def forget_missing(self, uid: str) -> None:
        """Ask the store again about the stream's chunks next time (its ingester failed us)."""
        self._missing.pop(uid, None)

    def _is_missing(self, uid: str, chunk: int, now: float) -> bool:
        chunks = self._missing.get(uid)
        until = None if chunks is None else chunks.get(chunk)
        return until is not None and now < until

    def _remember_missing(self, uid: str, chunk: int) -> None:
        now = time.monotonic()
        chunks = self._missing.get(uid)
        if chunks is None:
            chunks = self._missing[uid] = {}
            if len(self._missing) > MISSING_REMEMBERED:
                self._missing.popitem(last=False)
        else:
            self._missing.move_to_end(uid)
            for old in [c for c, until in chunks.items() if until <= now]:  # (a tail moves on: a few)
                del chunks[old]
        chunks[chunk] = now + self.recheck_seconds

    async def find(self, desc: Descriptor, start: offsets.Offset, *, remembered: bool = True,
                   max_bytes: int | None = None) -> SealedRead | None:
        """The sealed read for `start`, or None when that position is not sealed (yet).
        remembered=False: ask the store even about chunks found missing a moment ago."""
        if _at_closed_end(desc, start):
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
        candidates = _candidates(owner, start)
        now = time.monotonic()
        for chunk in candidates:
            self.lookups += 1
            if remembered and self._is_missing(owner.uid, chunk, now):
                self.missing_hits += 1
                continue
            try:
                head = await self.chunks.head(owner.uid, chunk)
            except ObjectNotFound:
                self._remember_missing(owner.uid, chunk)
                continue
            h = head.header
            if h.start <= start.position < h.end and _names(start, chunk, h.start, owner):
                piece = await self.chunks.slice(owner.uid, chunk, start.position, max_bytes or self.max_bytes, cap=cap)
                return SealedRead(desc, owner.uid, chunk, piece, offsets.encode(chunk, piece.end), piece.end == cap)
        return None


async def across_forks(locator: SealedLocator, found: SealedRead) -> list[SealedRead] | None:
    """The sealed reads making one page from `found`: a page does not end where a fork's own
    data begins unless it is full (a client reading a fork at -1 with one GET gets the
    inherited part and the fork's own; the ingester's pages do the same). None when what
    follows is not sealed (yet): the ingester answers the whole page then."""
    run = [found]
    size = found.piece.end - found.piece.start
    while run[-1].at_fork_point and size < locator.max_bytes:
        nxt = await locator.find(found.descriptor, offsets.parse(run[-1].next_offset),
                                 max_bytes=locator.max_bytes - size)
        if nxt is None:
            return None
        run.append(nxt)
        size += nxt.piece.end - nxt.piece.start
    return run


def _at_closed_end(desc: Descriptor, start: offsets.Offset) -> bool:
    return desc.closed and desc.final_offset is not None and start.position >= _position(desc.final_offset)


def _candidates(owner: Descriptor, start: offsets.Offset) -> tuple[int, ...]:
    """The chunks of `owner` that can hold the byte at `start`: its first where its own data
    begins (position 0, or a fork's fork position), else the offset's chunk or the next."""
    own_start = owner.fork_position if owner.fork_source is not None else 0
    return (owner.first_chunk,) if start.position == own_start else (start.chunk, start.chunk + 1)


def _names(start: offsets.Offset, chunk: int, chunk_start: int, owner: Descriptor) -> bool:
    """Whether `start` is the offset this stream issued for its position, given that `chunk`
    (starting at `chunk_start`) holds the byte there: it names the chunk holding the byte
    before, `chunk` itself or, at `chunk`'s first byte, the one before it. Where the stream's
    own data begins any spelling reads from there (as on the ingester). Otherwise the read is
    passed to the ingester, which refuses an offset the stream never issued."""
    if start.position == (owner.fork_position if owner.fork_source is not None else 0):
        return True
    if chunk == start.chunk:
        return chunk_start < start.position
    return chunk == start.chunk + 1 and chunk_start == start.position


def _position(offset: str) -> int:
    try:
        return offsets.parse(offset).position
    except ValueError:
        return 1 << 62  # not ours to judge: look it up
