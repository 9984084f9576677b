"""The move format: what an ingester hands a stream's new owner (issue 15, item 4). Pure.

One placement key moves at a time (shared/placement.py): a plain stream, or a bucket with
every stream in it. The old owner freezes the key's streams and answers `POST /_ds3/move-out`
with this body (Content-Type application/vnd.ds3.move); ingester/moves.py builds and imports it.

    prelude  "DS3MOVE1" | header length u32 BE
    header   JSON (below)
    records  per stream, in header order, its `records` count of:
             end position u64 BE | chunk id u64 BE | flags u8 | length u32 BE | message bytes
    trailer  CRC-32 u32 BE of everything before it

    header = {"version": 1, "key": placement key, "generation": the description the move is for,
              "source": the old owner's id,
              "bucket": BucketMeta fields, or null (a plain stream's key),
              "streams": [{"meta": StreamMeta fields (its uid, positions, chunk ids, producer and
                                   closure state, TTL, Stream-Seq, snapshot fields: all as stored),
                           "sid": the stream's sid on the old owner (named in its chunk headers),
                           "chunks": [[chunk id, ChunkInfo fields], ...]   (the manifest),
                           "producers": [[producer id, epoch, last seq, updated at], ...],
                           "records": how many records follow,
                           "source": null, or (a fork whose source stays behind or lives on a
                                     third ingester) the source's chain below the fork position
                                     as ingester/remote_forks.py exports it for a pin: a list of
                                     levels (uid, first chunk, cap, sealed manifest entries,
                                     unsealed records in base64),
                           "pins": [fork uid, ...] (forks elsewhere that read this stream: its
                                   refcount's share the new owner must be able to release)}, ...]}

Only the records not yet sealed are in it (the WAL's, journal included): sealed chunks stay in
the store under the stream's uid, which does not change. Chunks still `sealing` travel with
their records; the new owner uploads them again under the same key with the same bytes.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

MAGIC: Final = b"DS3MOVE1"
VERSION: Final = 1
CONTENT_TYPE: Final = "application/vnd.ds3.move"
_U32: Final = struct.Struct(">I")
_RECORD: Final = struct.Struct(">QQBI")


class MoveFormatError(ValueError):
    """A move body is damaged or not one (the message says where)."""


@dataclass(slots=True)
class MovedStream:
    meta: dict[str, Any]
    sid: int
    chunks: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    producers: list[tuple[str, int, int, float]] = field(default_factory=list)
    records: list[tuple[int, int, int, bytes]] = field(default_factory=list)  # (end, chunk, flags, data)
    source: list[dict[str, Any]] | None = None  # a fork's source chain, as remote_forks.levels_to_json
    pins: list[str] = field(default_factory=list)  # fork uids pinning this stream


@dataclass(slots=True)
class MoveExport:
    key: str
    generation: int
    source: str
    bucket: dict[str, Any] | None = None
    streams: list[MovedStream] = field(default_factory=list)

    @property
    def record_bytes(self) -> int:
        return sum(len(r[3]) for s in self.streams for r in s.records)


def encode(export: MoveExport) -> bytes:
    header = orjson.dumps({
        "version": VERSION, "key": export.key, "generation": export.generation, "source": export.source,
        "bucket": export.bucket,
        "streams": [{"meta": s.meta, "sid": s.sid, "chunks": [[c, info] for c, info in s.chunks],
                     "producers": [list(p) for p in s.producers], "records": len(s.records),
                     "source": s.source, "pins": s.pins}
                    for s in export.streams],
    })
    parts = [MAGIC, _U32.pack(len(header)), header]
    for s in export.streams:
        for end, chunk, flags, data in s.records:
            parts.append(_RECORD.pack(end, chunk, flags, len(data)))
            parts.append(data)
    body = b"".join(parts)
    return body + _U32.pack(zlib.crc32(body))


def decode(body: bytes) -> MoveExport:
    if len(body) < len(MAGIC) + 8 or body[: len(MAGIC)] != MAGIC:
        raise MoveFormatError("not a ds3 move body (bad magic)")
    (crc,) = _U32.unpack_from(body, len(body) - 4)
    if zlib.crc32(body[:-4]) != crc:
        raise MoveFormatError("move body CRC mismatch (truncated or damaged)")
    at = len(MAGIC)
    (hlen,) = _U32.unpack_from(body, at)
    at += 4
    try:
        h = orjson.loads(body[at : at + hlen])
        if h.get("version") != VERSION:
            raise MoveFormatError(f"move format version {h.get('version')!r}, this server reads {VERSION}")
        export = MoveExport(str(h["key"]), int(h["generation"]), str(h["source"]), h["bucket"])
        counts: list[int] = []
        for s in h["streams"]:
            export.streams.append(MovedStream(
                dict(s["meta"]), int(s["sid"]), [(int(c), dict(info)) for c, info in s["chunks"]],
                [(str(p), int(e), int(q), float(t)) for p, e, q, t in s["producers"]],
                source=s.get("source"), pins=[str(u) for u in s.get("pins", [])],
            ))
            counts.append(int(s["records"]))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, MoveFormatError):
            raise
        raise MoveFormatError(f"move header is invalid: {e!r}") from None
    at += hlen
    end_of_records = len(body) - 4
    for stream, n in zip(export.streams, counts, strict=True):
        for _ in range(n):
            if at + _RECORD.size > end_of_records:
                raise MoveFormatError("move body ends inside a record header")
            end, chunk, flags, size = _RECORD.unpack_from(body, at)
            at += _RECORD.size
            if at + size > end_of_records:
                raise MoveFormatError("move body ends inside a record")
            stream.records.append((end, chunk, flags, body[at : at + size]))
            at += size
    if at != end_of_records:
        raise MoveFormatError(f"{end_of_records - at} bytes after the last record")
    return export
