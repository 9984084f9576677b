"""Pooled raw HTTP/1.1 connections to the ingester, for the forwarding lane (reader/forwardlane.py).

aiohttp's client costs a forwarded append more CPU than the ingester spends storing it (a
ClientRequest, a ClientResponse, a task, header multidicts both ways). The lane's requests are
small and their answers too, so this pool sends a request already serialised and hands the
answer back as it came, in a callback: status, the raw header block and the body.

Appends are pipelined (`request(..., pipelined=True)`): the pool's pipe connection carries the
appends of every client of this process without waiting for answers, and those queued in one
loop iteration leave in one write. The ingester's lane takes each as it arrives (they share its
group commits) and answers in order, several in one write (shared/http/lane_connection.py), so a commit's
answers cost each side one send and one receive instead of one per append: about a third of the
CPU both tiers spent per forwarded append. A pipe holds at most MAX_PIPELINE requests; a full
one is left to drain and another connection becomes the pipe (also what limits the damage when
an ingester answers a connection's requests one at a time, as aiohttp's path does).

Everything else (HEADs, reads, long-polls: answers that may take long or must see the appends
before them) has a connection to itself for the request. Connections are kept alive and reused
last-in first-out (warm ones first), dropped after `idle_timeout` unused (well under the
ingester's keep-alive timeout, so a reused connection is not one the ingester is closing). A
response is framed by Content-Length, chunked encoding, or the connection's end; HEAD, 1xx, 204
and 304 answers have no body.

Errors come back as shared.errors.Unavailable with aiohttp's exception names, so the lane's
503s read like the aiohttp path's. A connection that fails fails every request on it: an append
whose answer was lost may or may not have been stored, as with any lost connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Final, cast
from urllib.parse import urlsplit

from shared.errors import IngesterUnreachable, Unavailable
from shared.tasks import spawn

INGESTER_RETRY_AFTER: Final = 2
MAX_PIPELINE: Final = 32  # requests in flight on one pipe connection


class Answer:
    """An upstream answer: status, the header lines (`Name: value\\r\\n` each, as received),
    and the body (chunked encoding removed)."""

    __slots__ = ("body", "head", "status")

    def __init__(self, status: int, head: bytes, body: bytes) -> None:
        self.status, self.head, self.body = status, head, body

    def header_lines(self) -> list[bytes]:
        return self.head.split(b"\r\n")[:-1] if self.head else []


Deliver = Callable[[Answer | Unavailable], None]
_Request = tuple[bytes, bool, Deliver]  # the request's bytes, whether its answer has no body, who gets it


def unreachable(why: str, base_url: str) -> IngesterUnreachable:
    return IngesterUnreachable(f"the ingester at {base_url} is unreachable ({why})", INGESTER_RETRY_AFTER)


class _Connection(asyncio.Protocol):
    __slots__ = ("_body_left", "_buf", "_chunked", "_head", "_keep", "_out", "_pool", "_status", "_timer",
                 "idle_since", "patient", "progress_at", "transport", "waiting")

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        # Requests sent whose answers have not come, in order: (head only, who gets it).
        self.waiting: deque[tuple[bool, Deliver]] = deque()
        self._out: list[bytes] = []  # pipelined requests to write at the end of this loop iteration
        self._timer: asyncio.TimerHandle | None = None
        self._buf = bytearray()
        self._status = 0
        self._head: bytes | None = None  # the front answer's header block, once complete
        self._body_left = -1  # its Content-Length; -1: until the end of the connection
        self._chunked = False
        self._keep = True
        self.idle_since = 0.0
        self.progress_at = 0.0  # loop time the front request began waiting (or the last answer came)
        self.patient = False  # its request may wait long by design (a live channel's long-poll)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's are not asyncio.Transport subclasses)

    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, data: bytes, head_only: bool, deliver: Deliver, patient: bool = False) -> None:
        """Write a request now."""
        assert self.transport is not None
        self.patient = patient
        self._expect(head_only, deliver)
        self.transport.write(data)

    def queue(self, data: bytes, head_only: bool, deliver: Deliver) -> None:
        """Write a request with the others queued in this loop iteration."""
        self.patient = False
        self._expect(head_only, deliver)
        if not self._out:
            self._pool.loop.call_soon(self._flush)
        self._out.append(data)

    def _expect(self, head_only: bool, deliver: Deliver) -> None:
        if not self.waiting:
            self.progress_at = self._pool.loop.time()
        self.waiting.append((head_only, deliver))
        if self._timer is None:
            self._timer = self._pool.loop.call_later(self._pool.read_timeout, self._timed_out)

    def _flush(self) -> None:
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)  # (else connection_lost has failed the requests)

    def data_received(self, data: bytes) -> None:
        if not self.waiting:  # nothing asked: the ingester should not be talking
            self._close()
            return
        self._buf += data
        while self.waiting:
            try:
                done = self._parse()
            except ValueError:
                self._fail(unreachable("ClientResponseError", self._pool.base_url))
                self._close()
                return
            if done is None:
                return
            self._finish(done)

    def _parse(self) -> Answer | None:
        """The front request's answer once it is all in `_buf` (and taken from it)."""
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
            if self.waiting[0][0] or self._status in (204, 304):
                self._body_left = 0
                self._chunked = False
        if self._chunked:
            framed = _dechunk(buf)
            if framed is None:
                return None
            body, used = framed
        else:
            if self._body_left < 0:
                return None  # until the connection ends (connection_lost delivers it)
            used = self._body_left
            if len(buf) < used:
                return None
            body = bytes(buf[:used])
        del buf[:used]
        if buf and len(self.waiting) == 1:
            self._keep = False  # more than we asked for: do not trust this connection again
        return Answer(self._status, self._head, body)

    def _finish(self, answer: Answer) -> None:
        _, deliver = self.waiting.popleft()
        self._head = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._keep:
            rest = list(self.waiting)
            self.waiting.clear()
            self._close()
            deliver(answer)
            for _, later in rest:
                later(unreachable("ServerDisconnectedError", self._pool.base_url))
            return
        if self.waiting:
            self.progress_at = self._pool.loop.time()
            self._timer = self._pool.loop.call_later(self._pool.read_timeout, self._timed_out)
        else:
            self._buf.clear()
            self._pool.release(self)
        deliver(answer)

    def _fail(self, error: Unavailable) -> None:
        """Every request waiting on this connection gets `error`."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._out.clear()
        waiting = list(self.waiting)
        self.waiting.clear()
        for _, deliver in waiting:
            deliver(error)

    def _timed_out(self) -> None:
        self._timer = None
        self._fail(unreachable("ServerTimeoutError", self._pool.base_url))
        self._close()

    def _close(self) -> None:
        self._pool.forget(self)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._pool.forget(self)
        self.transport = None
        if self.waiting and self._head is not None and self._body_left < 0 and not self._chunked:
            self._keep = False  # the front answer ends with the connection
            self._finish(Answer(self._status, self._head, bytes(self._buf)))
        self._fail(unreachable("ServerDisconnectedError", self._pool.base_url))


def _dechunk(buf: bytearray) -> tuple[bytes, int] | None:
    """The body of a complete chunked message at the start of `buf` and how many bytes it took,
    or None while it is not complete."""
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
            return None if end < 0 else (bytes(out), end + 4)
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
        self.base_url = base_url.rstrip("/")  # (named in the 503 when it cannot be reached)
        self.connect_timeout, self.read_timeout, self.idle_timeout = connect_timeout, read_timeout, idle_timeout
        self.loop = asyncio.get_running_loop()
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._pipe: _Connection | None = None  # where pipelined requests go
        self._pipe_pending: list[_Request] | None = None  # pipelined requests while the pipe connects
        self._closed = False
        self._connecting: set[asyncio.Task[None]] = set()
        self.opened = 0  # connections made (a metric: few, when keep-alive works)

    def request(self, data: bytes, head_only: bool, deliver: Deliver, *, pipelined: bool = False,
                patient: bool = False) -> None:
        """Send `data` (a whole request) and call `deliver` with the answer or an Unavailable.
        `pipelined`: it may share a connection with requests whose answers have not come (an
        append: the ingester answers it with the next group commit). `patient`: its answer may
        take long by design (a long-poll), so it never counts as stalled."""
        if pipelined:
            self._pipelined((data, head_only, deliver))
            return
        conn = self._warm()
        if conn is not None:
            conn.send(data, head_only, deliver, patient)
        else:
            self._connect([(data, head_only, deliver)], pipe=False, patient=patient)

    def _pipelined(self, req: _Request) -> None:
        if self._pipe_pending is not None:  # the pipe is connecting
            self._pipe_pending.append(req)
            return
        pipe = self._pipe
        if pipe is not None and pipe.usable() and len(pipe.waiting) < MAX_PIPELINE:
            if not pipe.waiting:  # it drained and went idle: take it back (if it is not stale)
                with contextlib.suppress(ValueError):
                    self._idle.remove(pipe)
                if time.monotonic() - pipe.idle_since >= self.idle_timeout:
                    pipe._close()
                    pipe = None
        else:
            pipe = None
        if pipe is None:
            pipe = self._pipe = self._warm()
        if pipe is not None:
            pipe.queue(*req)
            return
        self._pipe_pending = [req]
        self._connect(self._pipe_pending, pipe=True)

    def _warm(self) -> _Connection | None:
        """An idle connection to use (taken from the idle list), or None."""
        idle = self._idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn is self._pipe:
                self._pipe = None  # it serves one request now
            if conn.usable() and now - conn.idle_since < self.idle_timeout:
                return conn
            conn._close()
        return None

    def _connect(self, requests: list[_Request], *, pipe: bool, patient: bool = False) -> None:
        if self._closed:
            if pipe:
                self._pipe_pending = None
            for _, _, deliver in requests:
                deliver(unreachable("ClientConnectionError", self.base_url))
            return
        spawn(self._connect_and_send(requests, pipe, patient), self._connecting, f"connecting to {self.base_url}")

    async def _connect_and_send(self, requests: list[_Request], pipe: bool, patient: bool) -> None:
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except (OSError, TimeoutError) as e:
            error = unreachable("ClientConnectorError" if isinstance(e, OSError) else "ConnectionTimeoutError", self.base_url)
            conn = None
        finally:
            if pipe:
                self._pipe_pending = None  # (requests is that list: what queued meanwhile is in it)
        if conn is None:
            for _, _, deliver in requests:
                deliver(error)
            return
        self.opened += 1
        self._all.add(conn)
        if not pipe:
            conn.send(*requests[0], patient)
            return
        self._pipe = conn
        for req in requests:
            conn.queue(*req)

    def release(self, conn: _Connection) -> None:
        if self._closed:
            conn._close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        if conn is self._pipe:
            self._pipe = None
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    @property
    def connections(self) -> int:
        return len(self._all)

    def stalled_for(self) -> float:
        """Seconds the longest-waiting request (long-polls aside) has had no answer, on a
        connection that got nothing meanwhile: a frozen or cut-off ingester shows here long
        before read_timeout."""
        now = self.loop.time()
        return max((now - c.progress_at for c in self._all if c.waiting and not c.patient), default=0.0)

    def abandon(self, error: Unavailable) -> int:
        """Every request waiting here gets `error` and every connection is closed (the
        ingester there was replaced: whatever it still answers is a refusal); how many
        requests were waiting."""
        n = 0
        for conn in list(self._all):
            n += len(conn.waiting)
            conn._fail(error)
            conn._close()
        return n

    async def close(self) -> None:
        self._closed = True
        for task in list(self._connecting):
            task.cancel()
        for conn in list(self._all):
            conn._close()
