"""Stream descriptors: the small object a reader needs to serve sealed history without the
ingester (design §6). Written by the ingester when a stream is created, closed or deleted."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import orjson

from shared import offsets


@dataclass(frozen=True, slots=True)
class Descriptor:
    path: str
    uid: str
    content_type: str
    created_at: float
    ttl: int | None = None
    expires_at: float | None = None
    closed: bool = False
    final_offset: str | None = None  # the tail offset once closed
    soft_deleted: bool = False
    fork_source: str | None = None
    fork_source_uid: str | None = None
    fork_position: int = 0  # positions below it are read from the source
    first_chunk: int = 0  # the chunk holding the stream's own first byte (0, or fork_position)
    snapshot_offset: str | None = None  # the latest snapshot: reads before it answer 410
    snapshot_type: str = ""
    snapshot_key: str | None = None  # its object (a fork's may be its source's)

    @property
    def earliest(self) -> int:
        return offsets.parse(self.snapshot_offset).position if self.snapshot_offset else 0

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @staticmethod
    def decode(raw: bytes) -> Descriptor:
        return Descriptor(**orjson.loads(raw))
