"""Stream descriptors as the reader sees them: read from the object store, cached briefly.

A descriptor is immutable except for closure and deletion, so a short cache is safe for
sealed reads: a stale entry can at worst serve history of a stream deleted within the
last `ttl` seconds (its objects are being removed), never another stream's bytes, because
objects are keyed by the stream's uid."""

from __future__ import annotations

import time

from reader.singleflight import SingleFlight
from shared import keys
from shared.descriptor import Descriptor
from shared.errors import ObjectNotFound
from shared.objectstore.base import ObjectStore


class DescriptorCache:
    def __init__(self, store: ObjectStore, ttl: float, max_entries: int = 100_000) -> None:
        self.store = store
        self.ttl = ttl
        self._max = max_entries
        self._entries: dict[str, tuple[float, Descriptor | None]] = {}
        self._fetching: SingleFlight[str, Descriptor | None] = SingleFlight("descriptor")
        self.hits = 0
        self.misses = 0

    async def get(self, path: str, max_age: float | None = None) -> Descriptor | None:
        """The stream's descriptor, or None when the store has none (unknown, or deleted).
        max_age: trust a cached entry only this young (default: the cache's ttl)."""
        now = time.monotonic()
        hit = self._entries.get(path)
        if hit is not None and now - hit[0] < (self.ttl if max_age is None else max_age):
            self.hits += 1
            return hit[1]
        if path not in self._fetching:
            self.misses += 1
        return await self._fetching.do(path, lambda: self._fetch(path))

    async def _fetch(self, path: str) -> Descriptor | None:
        """One GET of the descriptor, shared by concurrent misses (reader.singleflight)."""
        try:
            found = Descriptor.decode(await self.store.get(keys.descriptor_key(path)))
            # a sha256 collision would be news; never serve it
            desc: Descriptor | None = found if found.path == path else None
        except ObjectNotFound:
            desc = None
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[path] = (time.monotonic(), desc)
        return desc

    def fresh(self, path: str) -> Descriptor | None:
        """The cached descriptor if get() would answer with it now (younger than the ttl),
        else None (not cached, too old, or cached as absent)."""
        hit = self._entries.get(path)
        if hit is None or hit[1] is None or time.monotonic() - hit[0] >= self.ttl:
            return None
        self.hits += 1
        return hit[1]

    def peek(self, path: str) -> Descriptor | None:
        """The cached descriptor however old (a guess to act on early, never to answer with)."""
        hit = self._entries.get(path)
        return None if hit is None else hit[1]

    def forget(self, path: str) -> None:
        self._entries.pop(path, None)
