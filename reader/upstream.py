"""Pooled raw HTTP/1.1 connections to the ingester, for the forwarding lane (reader/forwardlane.py).

aiohttp's client costs a forwarded append more CPU than the ingester spends storing it (a
ClientRequest, a ClientResponse, a task, header multidicts both ways). The lane's requests are
small and their answers too, so this pool sends a request already serialised and hands the
answer back as it came, in a callback: status, the raw header block and the body.

One request at a time per connection (no pipelining: the ingester answers a connection's
appends one group commit at a time, so requests on separate connections share a commit),
connections kept alive and reused last-in first-out (warm ones first), dropped after
`idle_timeout` unused (well under the ingester's keep-alive timeout, so a reused connection
is not one the ingester is closing). A response is framed by Content-Length, chunked
encoding, or the connection's end; HEAD, 1xx, 204 and 304 answers have no body.

Errors come back as shared.errors.Unavailable with aiohttp's exception names, so the lane's
503s read like the aiohttp path's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Final, cast
from urllib.parse import urlsplit

from shared.errors import Unavailable

INGESTER_RETRY_AFTER: Final = 2


class Answer:
    """An upstream answer: status, the header lines (`Name: value\\r\\n` each, as received),
    and the body (chunked encoding removed)."""

    __slots__ = ("body", "head", "status")

    def __init__(self, status: int, head: bytes, body: bytes) -> None:
        self.status, self.head, self.body = status, head, body

    def header_lines(self) -> list[bytes]:
        return self.head.split(b"\r\n")[:-1] if self.head else []


Deliver = Callable[[Answer | Unavailable], None]


def unreachable(why: str) -> Unavailable:
    return Unavailable(f"the ingester is unreachable ({why})", INGESTER_RETRY_AFTER)


class _Connection(asyncio.Protocol):
    __slots__ = ("_body_left", "_buf", "_chunked", "_deliver", "_head", "_head_only", "_keep", "_pool",
                 "_status", "_timer", "idle_since", "transport")

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._deliver: Deliver | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._buf = bytearray()
        self._head_only = False
        self._status = 0
        self._head: bytes | None = None
        self._body_left = -1  # Content-Length left; -1: until the end of the connection
        self._chunked = False
        self._keep = True
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's are not asyncio.Transport subclasses)

    def send(self, data: bytes, head_only: bool, deliver: Deliver) -> None:
        assert self.transport is not None and self._deliver is None
        self._deliver = deliver
        self._head_only = head_only
        self._head = None
        self._buf.clear()
        self._timer = self._pool.loop.call_later(self._pool.read_timeout, self._timed_out)
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self._deliver is None:  # nothing asked: the ingester should not be talking
            self._close()
            return
        self._buf += data
        try:
            done = self._parse()
        except ValueError:
            self._fail(unreachable("ClientResponseError"))
            self._close()
            return
        if done is not None:
            self._finish(done)

    def _parse(self) -> Answer | None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 64 * 1024:
                    raise ValueError("response head too large")
                return None
            first = buf.find(b"\r\n")
            status_line = bytes(buf[:first])
            if not status_line.startswith(b"HTTP/1.") or len(status_line) < 12:
                raise ValueError("not an HTTP/1.x response")
            self._status = int(status_line[9:12])
            self._head = head = bytes(buf[first + 2: end + 2])
            del buf[: end + 4]
            self._keep = status_line.startswith(b"HTTP/1.1")
            self._chunked = False
            self._body_left = -1
            for line in head.split(b"\r\n")[:-1]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    self._body_left = int(value)
                elif name == b"transfer-encoding":
                    self._chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    v = value.strip().lower()
                    self._keep = v == b"keep-alive" or (self._keep and v != b"close")
            if self._status < 200:  # an interim answer (100 Continue): the real one follows
                self._head = None
                return self._parse()
            if self._head_only or self._status in (204, 304):
                self._body_left = 0
                self._chunked = False
        if self._chunked:
            body = _dechunk(buf)
            return None if body is None else Answer(self._status, self._head, body)
        if self._body_left < 0:
            return None  # until the connection ends (connection_lost delivers it)
        if len(buf) < self._body_left:
            return None
        if len(buf) > self._body_left:
            self._keep = False  # more than we asked for: do not trust this connection again
        return Answer(self._status, self._head, bytes(buf[: self._body_left]))

    def _finish(self, answer: Answer) -> None:
        deliver = self._deliver
        self._deliver = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._buf.clear()
        if self._keep:
            self._pool.release(self)
        else:
            self._close()
        assert deliver is not None
        deliver(answer)

    def _fail(self, error: Unavailable) -> None:
        deliver = self._deliver
        self._deliver = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deliver is not None:
            deliver(error)

    def _timed_out(self) -> None:
        self._timer = None
        self._fail(unreachable("ServerTimeoutError"))
        self._close()

    def _close(self) -> None:
        self._pool.forget(self)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool.forget(self)
        self.transport = None
        if self._deliver is not None:
            if self._head is not None and self._body_left < 0 and not self._chunked:
                self._finish_at_eof()
            else:
                self._fail(unreachable("ServerDisconnectedError"))

    def _finish_at_eof(self) -> None:
        assert self._head is not None
        self._keep = False
        answer = Answer(self._status, self._head, bytes(self._buf))
        deliver, self._deliver = self._deliver, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        assert deliver is not None
        deliver(answer)


def _dechunk(buf: bytearray) -> bytes | None:
    """The body of a complete chunked message in `buf`, or None while it is not complete."""
    out = bytearray()
    pos = 0
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0].strip(), 16)
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n\r\n", pos - 2)  # trailers (none, usually) end with a blank line
            return None if end < 0 else bytes(out)
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos: pos + size]
        pos += size + 2


class UpstreamPool:
    """Keep-alive connections to one ingester (`http://host:port`)."""

    def __init__(self, base_url: str, *, connect_timeout: float = 5.0, read_timeout: float = 60.0,
                 idle_timeout: float = 30.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None or parts.path.strip("/") or parts.query:
            raise ValueError(f"the forwarding lane needs an http://host:port ingester URL, not {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.netloc = parts.netloc.encode("idna")
        self.connect_timeout, self.read_timeout, self.idle_timeout = connect_timeout, read_timeout, idle_timeout
        self.loop = asyncio.get_running_loop()
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._closed = False
        self._connecting: set[asyncio.Task[None]] = set()
        self.opened = 0  # connections made (a metric: few, when keep-alive works)

    def request(self, data: bytes, head_only: bool, deliver: Deliver) -> None:
        """Send `data` (a whole request) and call `deliver` with the answer or an Unavailable."""
        idle = self._idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing() and now - conn.idle_since < self.idle_timeout:
                conn.send(data, head_only, deliver)
                return
            conn._close()
        if self._closed:
            deliver(unreachable("ClientConnectionError"))
            return
        task = self.loop.create_task(self._connect_and_send(data, head_only, deliver))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect_and_send(self, data: bytes, head_only: bool, deliver: Deliver) -> None:
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except (OSError, TimeoutError) as e:
            deliver(unreachable("ClientConnectorError" if isinstance(e, OSError) else "ConnectionTimeoutError"))
            return
        self.opened += 1
        self._all.add(conn)
        conn.send(data, head_only, deliver)

    def release(self, conn: _Connection) -> None:
        if self._closed:
            conn._close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    @property
    def connections(self) -> int:
        return len(self._all)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._connecting):
            task.cancel()
        for conn in list(self._all):
            conn._close()
