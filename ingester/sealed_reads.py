"""Reads that land in a sealed chunk, answered from the object store: a read's part in that
chunk, and a fork's sub-offset into one (resolved with the chunk's index)."""

from __future__ import annotations

from ingester.reads import ReadResult, Reads
from ingester.records import FLAG_END_OF_APPEND
from shared import offsets
from shared.chunkstore import ChunkReader
from shared.errors import BadRequest
from shared.protocol import is_json


async def read_sealed(chunk_reader: ChunkReader, res: ReadResult, max_read_bytes: int) -> None:
    """The read starts in a sealed chunk: serve that chunk's part from the object store."""
    sealed = res.sealed
    assert sealed is not None
    piece = await chunk_reader.slice(sealed.uid, sealed.chunk, sealed.start, max_read_bytes, cap=sealed.end)
    if is_json(res.meta.content_type) and not piece.head.is_boundary(sealed.start):
        raise BadRequest("offset is not at a message boundary of this JSON stream")
    res.messages = [await chunk_reader.read(piece)]
    res.end = piece.end
    res.next_offset = (
        res.meta.tail_offset if piece.end >= res.meta.tail else offsets.encode(sealed.chunk, piece.end)
    )
    res.sealed = None


async def sealed_sub_offset(reads: Reads, chunk_reader: ChunkReader, source_path: str, fork_offset: str,
                            sub: int) -> int | None:
    """A fork sub-offset into a sealed chunk of the source: resolve it with the chunk's
    index (N bytes of the append there, or N of its JSON messages). None: not sealed."""
    try:
        position = offsets.parse(fork_offset).position
    except offsets.OffsetSyntaxError:
        return None  # the writer answers 400
    found = await reads.run(reads.sealed_at, source_path, position)
    if found is None:
        return None
    sealed, json_stream = found
    head = await chunk_reader.head(sealed.uid, sealed.chunk)
    if position >= head.header.end:
        return None
    first = head.record_at(position)
    if not json_stream:
        if sub > first.end - position:
            raise BadRequest("invalid Stream-Fork-Sub-Offset: larger than the append at that offset")
        return position + sub
    count = 0
    for span in head.spans():
        if span.end <= position:
            continue
        count += 1
        if count == sub:
            return span.end
        if span.flags & FLAG_END_OF_APPEND:
            break
    raise BadRequest("invalid Stream-Fork-Sub-Offset: more messages than the append at that offset")
