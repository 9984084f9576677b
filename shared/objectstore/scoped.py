"""A view of an ObjectStore under a key prefix: what one ingester of several keeps for itself.

Several ingesters share one store (shared/placement.py): streams' chunks and descriptors are
disjoint by placement and live where they always do, but each ingester's commit log, its
checkpoints and its ownership record are its own (ingester/shipper.py, ingester/logstore.py,
shared/ownership.py). Those modules take an ObjectStore and use fixed keys (`log/...`,
`checkpoint/...`, `_ds3/owner.json`); handing them a ScopedStore over
`_ds3/ingesters/<id>/` keeps every ingester's in a namespace of its own without their knowing.

Keys in, keys out (head, list, and the key a not-found or precondition error names) are
relative to the scope; other errors are the inner store's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection, Iterator
from types import TracebackType
from typing import Self

from shared.errors import ObjectNotFound, PreconditionFailed

from .base import DEFAULT_CHUNK_SIZE, MappedRange, ObjectInfo, ObjectStore, StoreCounters

INGESTERS_PREFIX = "_ds3/ingesters/"


def ingester_scope(ingester_id: str) -> str:
    """The key prefix of one cluster member's own objects (its id is [A-Za-z0-9._-]{1,64})."""
    return f"{INGESTERS_PREFIX}{ingester_id}/"


class ScopedStore:
    """`inner`'s keys under `prefix` (which ends with '/'), as a store of their own. Closing it
    leaves the inner store open: its owner closes that."""

    def __init__(self, inner: ObjectStore, prefix: str) -> None:
        if not prefix.endswith("/") or prefix.startswith("/"):
            raise ValueError(f"a scope is a relative key prefix ending with '/', not {prefix!r}")
        self.inner = inner
        self.prefix = prefix
        self.url = inner.url.rstrip("/") + "/" + prefix
        self.counters: StoreCounters = inner.counters  # one set of counts for the store

    async def put(self, key: str, data: bytes, *, content_type: str | None = None, if_absent: bool = False,
                  if_match: str | None = None, durable: bool = True) -> str:
        with self._errors(key):
            return await self.inner.put(self.prefix + key, data, content_type=content_type, if_absent=if_absent,
                                        if_match=if_match, durable=durable)

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        with self._errors(key):
            return await self.inner.get(self.prefix + key, start, end)

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        with self._errors(key):
            return await self.inner.get_with_etag(self.prefix + key)

    async def stream(self, key: str, start: int | None = None, end: int | None = None,
                     chunk_size: int = DEFAULT_CHUNK_SIZE) -> AsyncIterator[bytes]:
        with self._errors(key):
            async for piece in self.inner.stream(self.prefix + key, start, end, chunk_size):
                yield piece

    async def map_range(self, key: str, start: int, end: int) -> MappedRange | None:
        with self._errors(key):
            return await self.inner.map_range(self.prefix + key, start, end)

    async def head(self, key: str) -> ObjectInfo:
        with self._errors(key):
            return self._relative(await self.inner.head(self.prefix + key))

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """The inner store's not-found and precondition errors, naming the key as asked."""
        try:
            yield
        except ObjectNotFound as e:
            raise ObjectNotFound(key) from e
        except PreconditionFailed as e:
            why = str(e.message).rsplit(": ", 1)[0] if ": " in str(e.message) else "precondition failed"
            raise PreconditionFailed(key, why) from e

    async def delete(self, key: str, *, durable: bool = True) -> None:
        await self.inner.delete(self.prefix + key, durable=durable)

    async def sync(self, keys: Collection[str]) -> None:
        await self.inner.sync([self.prefix + key for key in keys])

    async def delete_prefix(self, prefix: str) -> int:
        return await self.inner.delete_prefix(self.prefix + prefix)

    async def list(self, prefix: str = "", start_after: str | None = None,
                   limit: int | None = None) -> AsyncIterator[ObjectInfo]:
        after = None if start_after is None else self.prefix + start_after
        async for info in self.inner.list(self.prefix + prefix, after, limit):
            yield self._relative(info)

    def _relative(self, info: ObjectInfo) -> ObjectInfo:
        key = info.key[len(self.prefix):] if info.key.startswith(self.prefix) else info.key
        return ObjectInfo(key, info.size, info.etag, info.content_type, info.last_modified)

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
