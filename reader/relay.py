"""Relaying a body from the object store to a client, with the store asked early.

A catch-up is a sequence of pages, one object request each, and a store's time to first byte
(moto: 3-10 ms, S3 more) is about as long as relaying a whole 8 MiB chunk. So a page's request
goes out before its status line (`HeadStart`), and while a page is relayed the next one is
already asked for (`NextPages`): when the client asks for it, its body is flowing. The pieces
themselves are read and written by the request's own task, with no queue and no task switch
per piece: the store connection's buffers and the client socket's keep both ends flowing
meanwhile (scripts/bench_catchup.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, Final, Self

log = logging.getLogger("ds3.reader")

NEXT_PAGE_TTL: Final = 5.0  # seconds a next page's relay waits for its client
NEXT_PAGES: Final = 16  # next pages held at most (the oldest goes first)


class HeadStart:
    """`async for piece in HeadStart(source)` — the source's pieces, its first one asked for
    by a task of its own as soon as start() is called (the store's time to first byte passes
    while the status line goes out, or while the previous page is sent: NextPages); the rest
    is read by whoever iterates, with no queue and no task switch per piece. The store
    connection's own buffers and the client socket's keep both flowing meanwhile."""

    def __init__(self, source: AsyncIterator[bytes]) -> None:
        self._source = source
        self._first: asyncio.Task[bytes | None] | None = None
        self._started = False  # the first piece was handed out
        self._closed = False

    def start(self) -> None:
        if self._first is None:
            self._first = asyncio.create_task(self._first_piece())

    async def _first_piece(self) -> bytes | None:
        return await anext(self._source, None)

    @property
    def failed(self) -> bool:
        """Its first piece failed (a next page not worth using: the client's request asks again)."""
        t = self._first
        return t is not None and t.done() and (t.cancelled() or t.exception() is not None)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        if not self._started:
            self.start()
            assert self._first is not None
            self._started = True
            first = await self._first
            if first is None:
                raise StopAsyncIteration
            return first
        return await anext(self._source)

    async def aclose(self) -> None:
        """Stop reading and close the source (idempotent): an S3 body goes back to its pool,
        or its connection is dropped when it was left unread."""
        if self._closed:
            return
        self._closed = True
        t = self._first
        if t is not None and not t.done():
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        elif t is not None and not t.cancelled():
            t.exception()  # retrieved: a first piece's error nobody took is not logged
        aclose = getattr(self._source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


PageKey = tuple[str, int, int]  # (object key, first byte, end)


class NextPages:
    """Relays started for the pages clients are expected to ask for next, by object range.

    start(find, open) looks the next page up (`find`: its range, or None when there is none
    to read yet) and starts its relay in a task of its own; take(key) hands a started relay
    to the request that asks for that range, once. A relay nobody takes within `ttl` seconds,
    or pushed out by newer ones (at most `limit` held), is closed: its store connection is
    dropped, and at most its connection's buffers were read for nothing."""

    def __init__(self, ttl: float = NEXT_PAGE_TTL, limit: int = NEXT_PAGES) -> None:
        self.ttl = ttl
        self.limit = limit
        self._held: OrderedDict[PageKey, tuple[HeadStart, asyncio.TimerHandle]] = OrderedDict()
        self._lookups: set[asyncio.Task[None]] = set()
        self._closings: set[asyncio.Task[None]] = set()
        self._closed = False
        self.started = 0
        self.taken = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._held)

    def start(self, find: Callable[[], Awaitable[PageKey | None]],
              open_: Callable[[PageKey], AsyncIterator[bytes]]) -> None:
        if self._closed or self.limit <= 0:
            return
        self._spawn(self._start(find, open_), self._lookups)

    async def _start(self, find: Callable[[], Awaitable[PageKey | None]],
                     open_: Callable[[PageKey], AsyncIterator[bytes]]) -> None:
        try:
            key = await find()
        except Exception as e:  # a guess only: the client's own request will say what is wrong
            log.debug("next page not looked up: %s", e)
            return
        if key is None or key in self._held or self._closed:
            return
        relay = HeadStart(open_(key))
        relay.start()
        self.started += 1
        timer = asyncio.get_running_loop().call_later(self.ttl, self._expire, key, relay)
        self._held[key] = (relay, timer)
        while len(self._held) > self.limit:
            _, (old, old_timer) = self._held.popitem(last=False)
            old_timer.cancel()
            self._drop(old)

    def take(self, key: PageKey) -> HeadStart | None:
        held = self._held.pop(key, None)
        if held is None:
            return None
        relay, timer = held
        timer.cancel()
        if relay.failed:  # e.g. the store was briefly unreachable: the client's request asks again
            self._drop(relay)
            return None
        self.taken += 1
        return relay

    def _expire(self, key: PageKey, relay: HeadStart) -> None:
        held = self._held.get(key)
        if held is not None and held[0] is relay:
            del self._held[key]
            self._drop(relay)

    def _drop(self, relay: HeadStart) -> None:
        self.dropped += 1
        self._spawn(relay.aclose(), self._closings)

    @staticmethod
    def _spawn(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def close(self) -> None:
        """Stop looking up, close every relay held (the reader's shutdown)."""
        self._closed = True
        for task in list(self._lookups):
            task.cancel()
        await asyncio.gather(*self._lookups, return_exceptions=True)
        held = list(self._held.values())
        self._held.clear()
        for relay, timer in held:
            timer.cancel()
            await relay.aclose()
        await asyncio.gather(*self._closings, return_exceptions=True)
