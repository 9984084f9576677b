"""SSE clients of the live fan-out (reader.fanout): each catches up with ordinary reads, then
attaches to its stream's channel, which writes every answer that continues exactly where the
client is straight to the client's connection, from the channel's own loop: one data event
framed once per answer (Answer.sse_data), one control event per client (its cursor), no task
wake-up or queue per client and message. A client that falls behind (an answer from before
its offset) is detached, and its handler catches up with reads again. Nothing is skipped or
repeated.

Direct writes go to the transport as HTTP/1.1 chunks after aiohttp sent the response head
(the handler's first write); a client whose unsent bytes pass MAX_BUFFERED stopped reading
and is cut loose."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from reader.fanout import Answer, LiveHub, Page, Tick, data_event, position
from shared import protocol as P
from shared import sse
from shared.errors import DS3Error

MAX_BUFFERED = 1 << 20


class Subscriber:
    """One SSE client, as its stream's channel sees it."""

    def __init__(self, hub: LiveHub, path: str, offset: str, cursor: str | None) -> None:
        self.hub = hub
        self.path = path
        self.offset = offset  # where the client is: the next event must start here
        self.cursor = cursor
        self.transport: asyncio.Transport | None = None  # set once the response head is out
        self.chunked = True
        self.backlog: list[Answer | Tick | None] = []  # what came before the head was out
        self.wake = asyncio.Event()  # the handler has work: catch up with reads, or end
        self.ended = False

    # --- called by the channel, on its loop, for every answer, tick or end
    def take(self, item: Answer | Tick | None) -> None:
        if self.transport is None:
            self.backlog.append(item)
            return
        if item is None:  # the channel ended: the client reconnects from its last offset
            self._end()
        elif isinstance(item, Tick):
            if item.offset == self.offset:
                self._write(self.control(self.offset, up_to_date=True, closed=item.closed))
                if item.closed:
                    self._end()
        elif item.start == self.offset:
            self._write(item.sse_data() + self.control(item.next_offset, item.up_to_date, item.closed))
            self.offset = item.next_offset
            if item.closed:
                self._end()
        elif position(item.next_offset) > position(self.offset):
            self.detach()  # an answer from before this client: its handler reads the rest
            self.wake.set()
        # else: already sent (the client caught up past it)

    def _write(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            self._end()
            return
        if t.get_write_buffer_size() > MAX_BUFFERED:  # a client that stopped reading: cut it loose
            self.hub.dropped += 1
            self._end()
            return
        t.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def _end(self) -> None:
        self.ended = True
        self.detach()
        self.wake.set()

    # --- used by the handler
    def control(self, offset: str, up_to_date: bool, closed: bool) -> bytes:
        return sse.control_event(offset, cursor=P.response_cursor(self.cursor), up_to_date=up_to_date,
                                 closed=closed)

    def page_events(self, page: Page) -> bytes:
        return data_event(page.body, page.content_type) + self.control(page.next_offset, page.up_to_date, page.closed)

    def attach(self, content_type: str) -> None:
        if self.hub.stopped:  # the reader stops: the response ends here, the client reconnects elsewhere
            self._end()
            return
        ch = self.hub.channel(self.path, self.offset)
        if ch.content_type is None:
            ch.content_type = content_type
        ch.wanted = True
        ch.subscribers.add(self)
        if ch.latest is not None and ch.latest.start == self.offset:
            self.take(ch.latest)  # the channel is a step ahead: take its last answer

    def detach(self) -> None:
        ch = self.hub.channels.get(self.path)
        if ch is not None:
            ch.subscribers.discard(self)

    def attached(self) -> bool:
        ch = self.hub.channels.get(self.path)
        return ch is not None and self in ch.subscribers

    def go_direct(self, request: web.Request, resp: web.StreamResponse) -> None:
        """The head is out: from now on the channel writes to the connection itself."""
        self.chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        self.transport = request.transport
        if self.transport is None:
            self._end()
        backlog, self.backlog = self.backlog, []
        for item in backlog:
            self.take(item)


async def serve(hub: LiveHub, request: web.Request, path: str, start: str, cursor: str | None) -> web.StreamResponse:
    sub = Subscriber(hub, path, start, cursor)
    ch = hub.channels.get(path)
    if ch is not None and ch.offset == start and ch.content_type is not None and not hub.stopped:
        # at the channel's offset: up to date as far as this reader knows, no read needed
        hub.shared += 1
        ch.wanted = True
        ch.subscribers.add(sub)
        first = sub.control(start, up_to_date=True, closed=False)
        content_type = ch.content_type
    else:
        page = await hub.read_page(path, start)  # 404/410 before the 200
        content_type = page.content_type
        first = sub.page_events(page)
        sub.offset = page.next_offset
        if page.closed:
            sub.ended = True
        elif page.up_to_date:
            sub.attach(page.content_type)
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if not P.is_text_for_sse(content_type):
        headers[P.SSE_ENCODING] = "base64"
    resp = web.StreamResponse(status=200, headers=headers)
    hub.clients += 1
    try:
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            await resp.write(first)  # sends the head too (aiohttp holds it until the first write)
            sub.go_direct(request, resp)
            if not sub.ended:
                await _follow(hub, resp, sub, time.monotonic() + hub.max_seconds)
    finally:
        hub.clients -= 1
        sub.detach()
    with contextlib.suppress(Exception):
        await resp.write_eof()
    return resp


async def _follow(hub: LiveHub, resp: web.StreamResponse, sub: Subscriber, ends_at: float) -> None:
    """Catch up with reads whenever the client is not attached; else wait for the channel to
    say it ended the client or detached it."""
    while not sub.ended and not hub.stopped and time.monotonic() < ends_at:  # (stopped: the reader stops)
        if not sub.attached():
            try:
                page = await hub.read_page(sub.path, sub.offset)
            except DS3Error:
                return  # the head is out: end here; the client's reconnect gets the error itself
            await resp.write(sub.page_events(page))
            sub.offset = page.next_offset
            if page.closed:
                return
            if page.up_to_date:
                sub.attach(page.content_type)
            continue
        sub.wake.clear()
        try:
            async with asyncio.timeout(max(0.01, ends_at - time.monotonic())):
                await sub.wake.wait()
        except TimeoutError:
            return
