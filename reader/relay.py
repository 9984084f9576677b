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
import fcntl
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, cast

from aiohttp import web

from shared.errors import ObjectStoreUnavailable
from shared.objectstore.open_body import OpenBody
from shared.tasks import spawn

log = logging.getLogger("ds3.reader")

NEXT_PAGE_TTL: Final = 5.0  # seconds a next page's relay waits for its client
NEXT_PAGES: Final = 16  # next pages held at most (the oldest goes first)


Body = OpenBody | AsyncIterator[bytes] | None  # None: an empty range


class HeadStart:
    """A page's object request, sent as soon as start() is called by a task of its own (the
    store's time to first byte passes while the status line goes out, or while the previous
    page is sent: NextPages); body() is its answer, the body still to read. aclose() stops
    the request or closes the body."""

    def __init__(self, open_: Callable[[], Awaitable[Body]]) -> None:
        self._open = open_
        self._task: asyncio.Task[Body] | None = None
        self._closed = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._opened())

    async def _opened(self) -> Body:
        return await self._open()

    @property
    def failed(self) -> bool:
        """The request failed (a next page not worth using: the client's request asks again)."""
        t = self._task
        return t is not None and t.done() and (t.cancelled() or t.exception() is not None)

    async def body(self) -> Body:
        self.start()
        assert self._task is not None
        return await self._task

    async def aclose(self) -> None:
        """Stop the request, or close its body (idempotent): an S3 body read to its end goes
        back to its pool, one left unread is dropped with its connection."""
        if self._closed:
            return
        self._closed = True
        t = self._task
        if t is None:
            return
        if not t.done():
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
            return
        if t.cancelled() or t.exception() is not None:
            return  # (the exception is retrieved: not logged as never retrieved)
        body = t.result()
        if isinstance(body, OpenBody):
            body.close()
        elif body is not None:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


_PIPE_SIZE: Final = 1024 * 1024  # asked for; the kernel may give less (F_GETPIPE_SZ says)


async def splice_body(resp: web.StreamResponse, transport: asyncio.BaseTransport, head: bytes, src: int,
                      count: int, timeout: float, took: Callable[[int], None]) -> None:
    """Send `count` bytes of a body to the client: `head` (read already), then the rest moved
    from socket `src` to the client's socket in the kernel (splice(2) through a pipe: no copy
    into Python, no read or write per piece in Python). The client's transport is idle
    meanwhile (its buffer drained first), so the bytes go out in order. A client gone raises
    ConnectionResetError (also after `timeout` seconds without progress either way: then the
    client's connection is aborted); the store's connection ending early raises
    ObjectStoreUnavailable."""
    first = head[:count]
    await resp.write(first)  # (also sends the status line and headers if still buffered)
    left = count - len(first)
    if left <= 0:
        return
    transport = cast(asyncio.Transport, transport)  # (uvloop's are not asyncio.Transport subclasses)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while transport.get_write_buffer_size():  # what aiohttp wrote must reach the socket first
        if transport.is_closing():
            raise ConnectionResetError("the client left")
        if loop.time() > deadline:
            transport.abort()
            raise ConnectionResetError("the client took nothing")
        await asyncio.sleep(0.001)
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        raise ConnectionResetError("the client left")
    # Own descriptors: the event loop refuses to watch one a transport owns.
    fds: list[int] = []
    try:
        dst = os.dup(sock.fileno())
        fds.append(dst)
        src = os.dup(src)
        fds.append(src)
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        fds += (r, w)
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        cap = fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)
        in_pipe = 0
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        while left or in_pipe:
            moved = False
            if left and in_pipe < cap:
                try:
                    n = os.splice(src, w, min(left, cap - in_pipe), flags=flags)
                except BlockingIOError:
                    pass
                except OSError as e:
                    raise ObjectStoreUnavailable(f"object store connection failed mid-body: {e}") from e
                else:
                    if n == 0:
                        raise ObjectStoreUnavailable(f"object store closed the connection {left} bytes early")
                    left -= n
                    in_pipe += n
                    took(n)
                    moved = True
            if in_pipe:
                try:
                    m = os.splice(r, dst, in_pipe, flags=flags)
                except BlockingIOError:
                    pass
                except OSError as e:
                    raise ConnectionResetError(f"the client left: {e}") from e
                else:
                    in_pipe -= m
                    moved = True
            if moved:
                continue
            want_read = bool(left) and in_pipe < cap
            if not await _ready(loop, src if want_read else None, dst if in_pipe else None, timeout):
                transport.abort()
                raise ConnectionResetError(f"no progress in {timeout:.0f} s relaying a sealed body")
    finally:
        for fd in fds:
            os.close(fd)


async def _ready(loop: asyncio.AbstractEventLoop, readable: int | None, writable: int | None,
                 timeout: float) -> bool:
    """Wait until `readable` can be read or `writable` written; False after `timeout`."""
    fut: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    if readable is not None:
        loop.add_reader(readable, wake)
    if writable is not None:
        loop.add_writer(writable, wake)
    try:
        async with asyncio.timeout(timeout):
            await fut
        return True
    except TimeoutError:
        return False
    finally:
        if readable is not None:
            loop.remove_reader(readable)
        if writable is not None:
            loop.remove_writer(writable)


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
              open_: Callable[[PageKey], Awaitable[Body]]) -> None:
        if self._closed or self.limit <= 0:
            return
        spawn(self._start(find, open_), self._lookups, "opening a relay")

    async def _start(self, find: Callable[[], Awaitable[PageKey | None]],
                     open_: Callable[[PageKey], Awaitable[Body]]) -> None:
        try:
            key = await find()
        except Exception as e:  # a guess only: the client's own request will say what is wrong
            log.debug("next page not looked up: %s", e)
            return
        if key is None or key in self._held or self._closed:
            return
        relay = HeadStart(lambda: open_(key))
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
        spawn(relay.aclose(), self._closings, "closing a relay")

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
