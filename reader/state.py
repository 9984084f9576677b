"""The reader's long-lived state, shared by its HTTP modules."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from reader.descriptors import DescriptorCache
from reader.fanout import LiveHub
from reader.relay import NextPages
from reader.routing import Router
from reader.sealed import SealedLocator
from shared.chunkstore import ChunkReader
from shared.config import ReaderConfig
from shared.descriptor import Descriptor
from shared.objectstore.base import ObjectStore


@dataclass(slots=True)
class ReaderState:
    config: ReaderConfig
    objects: ObjectStore
    chunks: ChunkReader
    descriptors: DescriptorCache
    locator: SealedLocator
    router: Router  # which ingester owns a stream, and the clients and lane pools to reach each (reader/routing.py)
    sse: LiveHub  # the live channels: long-poll and SSE fan-out
    next_pages: NextPages = field(default_factory=NextPages)  # catch-ups' next pages, already asked for
    sealed_responses: int = 0
    forwarded: int = 0
    tail_checks: int = 0  # touches asking whether a last sealed page ends at the tail (reader/http.py tail_of)


READER: Final = web.AppKey("reader_state", ReaderState)


def servable(desc: Descriptor) -> bool:
    if desc.soft_deleted:
        return False  # the ingester answers 410 (or the forks' reads)
    return desc.expires_at is None or time.time() < desc.expires_at
