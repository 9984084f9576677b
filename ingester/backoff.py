"""Capped exponential backoff for the ingester's background loops (uploads, descriptors,
clean-ups) while the object store fails: 0.2 s, doubling, at most 30 s; reset on success."""

from __future__ import annotations

import asyncio


class Backoff:
    def __init__(self, first: float = 0.2, cap: float = 30.0) -> None:
        self.first, self.cap, self.delay = first, cap, first

    def reset(self) -> None:
        self.delay = self.first

    async def sleep(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.cap, self.delay * 2)
