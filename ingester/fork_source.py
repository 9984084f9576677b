"""Forking a stream on this ingester: validating the fork against its source (offset, message
boundary, sub-offset, content type, retention) and filling the fork's fields. Writer thread
(called by Store.create, and by remote_forks.pin for a fork on another ingester)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lmdb

from ingester.chain import Sealed, at_position, chain_records, chunk_at, record_at
from ingester.records import FLAG_END_OF_APPEND, StreamMeta, new_first_chunk
from ingester.writes import CreateRequest, SubOffsetSealed
from shared import offsets
from shared.errors import BadRequest, Conflict, NotFound, Retained
from shared.protocol import is_json, media_type

if TYPE_CHECKING:
    from ingester.store import Store


def fork_source(store: Store, txn: lmdb.Transaction, req: CreateRequest, meta: StreamMeta, now: float) -> StreamMeta:
    """Validate a fork of `req.fork_from` and fill `meta`'s fork fields (position, sub-offset,
    inherited snapshot and expiry, first chunk); returns the source. Raises what a client is
    told: 404, 409, 400, 410 (before the source's earliest retained offset)."""
    assert req.fork_from is not None
    source = store._live(txn, req.fork_from, now, own=False)
    if source is None or source.moved_to is not None:
        raise NotFound("fork source stream not found")
    if source.soft_deleted:
        raise Conflict("fork source stream was deleted (forks of it still exist)")
    if req.content_type is None:
        meta.content_type = source.content_type
    elif media_type(req.content_type) != media_type(source.content_type):
        raise Conflict("fork content type does not match the source stream's")
    lookup = store._lookup(txn)
    db = store.wal
    if req.fork_offset is not None:
        try:
            given = offsets.parse(req.fork_offset)
        except offsets.OffsetSyntaxError as e:
            raise BadRequest(f"invalid Stream-Fork-Offset: {e}") from e
        position = given.position
        if position > source.tail:
            raise BadRequest("Stream-Fork-Offset is beyond the end of the source stream")
        named, boundary, _ = at_position(txn, db, source, lookup, position)
        if is_json(source.content_type) and boundary is False:
            raise BadRequest("Stream-Fork-Offset is not at a message boundary")
        if position and given.chunk != named:  # as reads check (reads.py)
            raise BadRequest("Stream-Fork-Offset is not one the source stream issued "
                             "(its chunk id does not match its position)")
    else:
        position = source.tail
    sub = req.fork_sub_offset or 0
    if sub > 0:
        if req.fork_offset is None:
            raise BadRequest("Stream-Fork-Sub-Offset > 0 requires Stream-Fork-Offset")
        if req.fork_sub_position is not None:
            if not position < req.fork_sub_position <= source.tail:
                raise BadRequest("invalid Stream-Fork-Sub-Offset")
            position = req.fork_sub_position
        else:
            position = _resolve_sub_offset(store, txn, source, position, sub)
    if source.snapshot_offset is not None:  # the fork's history starts at the same snapshot
        if position < source.earliest:
            raise Retained(source.snapshot_offset, "the fork offset is before the source's earliest retained offset")
        meta.snapshot_offset, meta.snapshot_type = source.snapshot_offset, source.snapshot_type
        meta.snapshot_size, meta.snapshot_key = source.snapshot_size, source.snapshot_key
    if req.ttl is None and req.expires_at is None:
        meta.ttl, meta.expires_at, meta.expires_at_text = source.ttl, source.expires_at, source.expires_at_text
    meta.fork_source = source.path
    meta.fork_source_sid = source.sid
    meta.fork_source_uid = source.uid
    meta.fork_position = position
    meta.fork_offset = req.fork_offset
    meta.fork_sub_offset = sub
    meta.tail = position
    meta.tail_chunk = chunk_at(txn, db, source, lookup, position)
    meta.first_chunk = new_first_chunk(after=meta.tail_chunk)  # after every inherited chunk
    meta.chunk = meta.first_chunk
    meta.chunk_start = position
    return source

def _resolve_sub_offset(store: Store, txn: lmdb.Transaction, source: StreamMeta, position: int, sub: int) -> int:
    """Sub-offset N past `position`: N bytes of the append there, or N of its JSON messages."""
    lookup = store._lookup(txn)
    first = record_at(txn, store.wal, source, lookup, position)
    if first is None:
        raise BadRequest("invalid Stream-Fork-Sub-Offset: the source has no message at that offset")
    if isinstance(first, Sealed):
        raise SubOffsetSealed("the fork sub-offset lies in a chunk sealed since it was resolved")
    if not is_json(source.content_type):
        if sub > first.end - position:
            raise BadRequest("invalid Stream-Fork-Sub-Offset: larger than the append at that offset")
        return position + sub
    for count, rec in enumerate(chain_records(txn, store.wal, source, lookup, position, source.tail), 1):
        if isinstance(rec, Sealed):
            raise SubOffsetSealed("the fork sub-offset lies in a chunk sealed since it was resolved")
        if count == sub:
            return rec.end
        if rec.flags & FLAG_END_OF_APPEND:
            break
    raise BadRequest("invalid Stream-Fork-Sub-Offset: more messages than the append at that offset")
