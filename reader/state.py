"""The reader's long-lived state, shared by its HTTP modules."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Final

from aiohttp import web

from reader.descriptors import DescriptorCache
from reader.fanout import LiveHub
from reader.proxy import IngesterClient
from reader.relay import NextPages
from reader.sealed import SealedLocator
from reader.upstream import UpstreamPool
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
    ingester: IngesterClient
    sse: LiveHub  # the live channels: long-poll and SSE fan-out
    upstream: UpstreamPool | None = None  # the forwarding lane's connections (reader/forwardlane.py)
    next_pages: NextPages = field(default_factory=NextPages)  # catch-ups' next pages, already asked for
    sealed_responses: int = 0
    forwarded: int = 0


READER: Final = web.AppKey("reader_state", ReaderState)


def servable(desc: Descriptor) -> bool:
    if desc.soft_deleted:
        return False  # the ingester answers 410 (or the forks' reads)
    return desc.expires_at is None or time.time() < desc.expires_at
