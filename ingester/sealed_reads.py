"""Reads that land in a sealed chunk, answered from the object store: a read's part in that
chunk, and a fork's sub-offset into one (resolved with the chunk's index).

A page does not end where a fork's own data begins unless it is full: a client reading a
fork at -1 with one GET gets the inherited part and the fork's own (the conformance suite
does exactly that), whether either part is sealed or still in the WAL (complete_read)."""

from __future__ import annotations

from ingester.reads import ReadResult, Reads
from ingester.records import FLAG_END_OF_APPEND
from shared import offsets
from shared.chunkstore import ChunkReader
from shared.errors import BadRequest, DS3Error
from shared.protocol import is_json


async def complete_read(reads: Reads, chunk_reader: ChunkReader | None, path: str, res: ReadResult,
                        max_read_bytes: int) -> None:
    """Fill in a read from the WAL: its sealed part from the object store, and on across the
    fork points it stops at, until about max_read_bytes or the tail."""
    size = sum(len(m) for m in res.messages)
    while True:
        if res.sealed is not None:
            assert chunk_reader is not None  # (something sealed: there is a store)
            size += await read_sealed(chunk_reader, res, max(1, max_read_bytes - size))
        if not res.continues or size >= max_read_bytes:
            return
        try:
            more = await reads.run(reads.continue_sync, path, res.end, max_read_bytes - size)
        except DS3Error:
            return  # the stream changed meanwhile: this page ends here, the next read says how
        if more.meta.uid != res.meta.uid:
            return
        res.meta, res.fork_points, res.sealed = more.meta, more.fork_points, more.sealed
        if more.messages:
            res.messages.extend(more.messages)
            size += sum(len(m) for m in more.messages)
            res.end, res.next_offset = more.end, more.next_offset


async def read_sealed(chunk_reader: ChunkReader, res: ReadResult, max_read_bytes: int) -> int:
    """The read goes on in a sealed chunk: that chunk's part from the object store, after what
    it has (the bytes added)."""
    sealed = res.sealed
    assert sealed is not None
    piece = await chunk_reader.slice(sealed.uid, sealed.chunk, sealed.start, max_read_bytes, cap=sealed.end)
    if is_json(res.meta.content_type) and not piece.head.is_boundary(sealed.start):
        raise BadRequest("offset is not at a message boundary of this JSON stream")
    data = await chunk_reader.read(piece)
    res.messages.append(data)
    res.end = piece.end
    res.next_offset = (
        res.meta.tail_offset if piece.end >= res.meta.tail else offsets.encode(sealed.chunk, piece.end)
    )
    res.sealed = None
    return len(data)


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
