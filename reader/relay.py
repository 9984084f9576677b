"""Relaying a body from the object store to a client while the next piece is already read.

Without it a relay alternates: read a piece from the store, write it to the client, wait for
the client's socket to drain, read the next. With a task reading ahead into a short queue the
store's connection keeps flowing while the client drains (scripts/bench_catchup.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Final, Self

AHEAD: Final = 4  # pieces read ahead (with 1 MiB pieces, 4 MiB per relay at most)
_END: Final = object()


class RelayAhead:
    """`async with RelayAhead(source) as pieces: async for piece in pieces: ...` — the
    source's pieces in order, read by a task of their own up to AHEAD pieces ahead. An error of
    the source surfaces where its piece would have; leaving early stops the task and closes
    the source (an S3 body goes back to its pool)."""

    def __init__(self, source: AsyncIterator[bytes], ahead: int = AHEAD) -> None:
        self._source = source
        self._queue: asyncio.Queue[object] = asyncio.Queue(ahead)
        self._task: asyncio.Task[None] | None = None

    async def _fill(self) -> None:
        try:
            async for piece in self._source:
                await self._queue.put(piece)
        except Exception as e:  # handed to the consumer, in order
            await self._queue.put(e)
            return
        await self._queue.put(_END)

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._fill())
        return self

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        assert isinstance(item, bytes | bytearray | memoryview)
        return bytes(item) if not isinstance(item, bytes) else item

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
