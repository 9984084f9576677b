"""SSE fan-out: all SSE clients of one stream on this reader share one upstream SSE
connection to the ingester.

A channel holds the upstream subscription and the offset it has reached. A client that
starts at that offset attaches at once; one that starts behind catches up with ordinary
reads (sealed chunks from the object store, the rest from the ingester, collapsed) and
attaches when its offset meets the channel's. Each upstream event is a data event followed
by its control event; a client takes an event only when it continues exactly where the
client is, so nothing is skipped or repeated even when a client is ahead of the channel.
Control events are re-encoded per client: cursors must never go back for that client.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from reader.proxy import SKIP_AUTO, IngesterClient, upstream_url
from shared import protocol as P
from shared import sse
from shared.buckets import url_path
from shared.errors import Unavailable

log = logging.getLogger("ds3.reader.sse")


@dataclass(frozen=True, slots=True)
class Page:
    """One catch-up read, as a GET returns it."""

    content_type: str
    body: bytes
    next_offset: str
    up_to_date: bool
    closed: bool


PageReader = Callable[[str, str], Awaitable[Page]]


@dataclass(slots=True)
class Event:
    """A data event (maybe none) and the control event that ends it."""

    data: bytes | None  # the raw `event: data` block, as the ingester framed it
    control: dict[str, object]
    before: str  # the offset the event continues from

    @property
    def after(self) -> str:
        return str(self.control["streamNextOffset"])

    @property
    def closed(self) -> bool:
        return bool(self.control.get("streamClosed"))


@dataclass(eq=False)
class Subscriber:
    offset: str
    cursor: str | None
    queue: asyncio.Queue[Event | None] = field(default_factory=lambda: asyncio.Queue(maxsize=1024))
    dropped: bool = False


class Channel:
    def __init__(self, hub: SseHub, path: str, offset: str) -> None:
        self.hub = hub
        self.path = path
        self.offset = offset
        self.subscribers: set[Subscriber] = set()
        self.clients = 0  # attached or catching up; the upstream closes when none is left
        self.content_type: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()  # the first upstream response arrived (or failed)
        self.error: Exception | None = None
        self.status: int | None = None
        self.failure: tuple[int, bytes, dict[str, str]] | None = None

    def publish(self, ev: Event) -> None:
        self.offset = ev.after
        for sub in list(self.subscribers):
            try:
                sub.queue.put_nowait(ev)
            except asyncio.QueueFull:  # a client that stopped reading: cut it loose
                sub.dropped = True
                self.hub.dropped += 1
                self.subscribers.discard(sub)
                with contextlib.suppress(asyncio.QueueFull):
                    sub.queue.put_nowait(None)

    def end(self) -> None:
        for sub in list(self.subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait(None)
        self.subscribers.clear()

    async def run(self) -> None:
        """Hold the upstream subscription while anyone listens; reconnect on rotation."""
        backoff = 0.1
        try:
            while True:
                try:
                    closed = await self._follow()
                    backoff = 0.1
                except (aiohttp.ClientError, TimeoutError, Unavailable) as e:
                    self.error = e if isinstance(e, Unavailable) else Unavailable(f"the ingester is unreachable ({e})", 2)
                    self.ready.set()
                    log.info("upstream SSE for %s ended (%s)", self.path, e)
                    closed = False
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    if not self.subscribers:
                        return
                    if backoff >= 5.0:
                        return
                if closed or not self.subscribers or self.failure is not None:
                    return
        finally:
            self.ready.set()
            self.end()
            self.hub.channels.pop(self.path, None) if self.hub.channels.get(self.path) is self else None

    async def _follow(self) -> bool:
        """One upstream connection; True when the stream closed."""
        client = self.hub.ingester
        url = f"{client.base}{url_path(self.path)}?live=sse&offset={self.offset}"
        client.requests += 1
        async with client.session.get(
            upstream_url(url), skip_auto_headers=SKIP_AUTO, headers=client.upstream_headers({}),
            timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_read=self.hub.idle_timeout),
        ) as up:
            if up.status != 200:
                body = await up.read()
                hdrs = {k: v for k, v in up.headers.items() if k.lower() in ("content-type", "retry-after")}
                self.failure = (up.status, body, hdrs)
                self.ready.set()
                return False
            self.content_type = up.headers.get(P.SSE_ENCODING, "")
            self.ready.set()
            pending_data: bytes | None = None
            before = self.offset
            buf = b""
            async for piece in up.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    block, buf = buf.split(b"\n\n", 1)
                    kind, payload = _parse_block(block)
                    if kind == "data":
                        pending_data = block + b"\n\n"
                    elif kind == "control":
                        control = orjson.loads(payload)
                        ev = Event(pending_data, control, before)
                        pending_data = None
                        before = ev.after
                        self.publish(ev)
                        if ev.closed:
                            return True
                if not self.subscribers:
                    return False
        return False


def _parse_block(block: bytes) -> tuple[str, bytes]:
    kind = ""
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"event:"):
            kind = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data.append(line[5:][1:] if line[5:6] == b" " else line[5:])
    return kind, b"\n".join(data)


class SseHub:
    def __init__(self, ingester: IngesterClient, read_page: PageReader, max_seconds: float,
                 idle_timeout: float) -> None:
        self.ingester = ingester
        self.read_page = read_page
        self.max_seconds = max_seconds
        self.idle_timeout = idle_timeout
        self.channels: dict[str, Channel] = {}
        self.shared = 0  # clients that attached to an existing upstream subscription
        self.dropped = 0  # clients cut loose because they stopped reading

    async def serve(self, request: web.Request, path: str, start: str, cursor: str | None) -> web.StreamResponse:
        channel = self.channels.get(path)
        if channel is None:
            channel = self.channels[path] = Channel(self, path, start)
            channel.task = asyncio.create_task(channel.run(), name=f"ds3-sse-{path[:40]}")
        else:
            self.shared += 1
        sub = Subscriber(start, cursor)
        if channel.offset == start:
            channel.subscribers.add(sub)
        channel.clients += 1
        try:
            return await self._serve(request, channel, sub, path)
        finally:
            channel.clients -= 1
            channel.subscribers.discard(sub)
            if channel.clients == 0 and channel.task is not None:
                channel.task.cancel()  # nobody listens: drop the upstream subscription
                if self.channels.get(path) is channel:
                    del self.channels[path]

    async def _serve(self, request: web.Request, channel: Channel, sub: Subscriber, path: str) -> web.StreamResponse:
        await channel.ready.wait()
        if channel.failure is not None:
            channel.subscribers.discard(sub)
            status, body, hdrs = channel.failure
            return web.Response(status=status, body=body, headers=hdrs)
        if channel.error is not None and channel.content_type is None:
            channel.subscribers.discard(sub)
            raise channel.error
        binary = channel.content_type == "base64"
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if binary:
            headers[P.SSE_ENCODING] = "base64"
        resp = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        ends_at = time.monotonic() + self.max_seconds
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            try:
                await self._pump(resp, channel, sub, path, binary, ends_at)
            finally:
                channel.subscribers.discard(sub)
        with contextlib.suppress(Exception):
            await resp.write_eof()
        return resp

    async def _pump(self, resp: web.StreamResponse, channel: Channel, sub: Subscriber, path: str,
                    binary: bool, ends_at: float) -> None:
        while time.monotonic() < ends_at:
            if sub not in channel.subscribers:
                # catch up with reads until this client meets the channel, then attach
                page = await self.read_page(path, sub.offset)
                data = sse.data_event(_payload(page, binary)) if page.body and page.body != b"[]" else b""
                await resp.write(data + self._control(sub, page.next_offset, page.up_to_date, page.closed))
                sub.offset = page.next_offset
                if page.closed:
                    return
                if page.up_to_date or sub.offset == channel.offset:
                    if channel.task is None or channel.task.done():
                        return  # the upstream went away: the client reconnects
                    channel.subscribers.add(sub)
                continue
            try:
                ev = await asyncio.wait_for(sub.queue.get(), max(0.01, ends_at - time.monotonic()))
            except TimeoutError:
                return
            if ev is None:
                if sub.dropped:
                    return
                return
            if ev.after <= sub.offset and not ev.closed:
                continue  # already sent (the client caught up past it)
            if ev.before != sub.offset and ev.after > sub.offset:
                channel.subscribers.discard(sub)  # a gap: read it instead
                continue
            control = self._control(sub, ev.after, bool(ev.control.get("upToDate")), ev.closed)
            await resp.write((ev.data or b"") + control)  # data and its control in one write
            sub.offset = ev.after
            if ev.closed:
                return

    @staticmethod
    def _control(sub: Subscriber, offset: str, up_to_date: bool, closed: bool) -> bytes:
        return sse.control_event(offset, cursor=P.response_cursor(sub.cursor), up_to_date=up_to_date,
                                 closed=closed)


def _payload(page: Page, binary: bool) -> str:
    if binary:
        return base64.b64encode(page.body).decode("ascii")
    return page.body.decode("utf-8", "replace")
