"""The ingester's fast lane: plain appends answered straight from the connection's bytes.

aiohttp spends ~75 us of CPU per request here before a handler runs (a Request, a
StreamReader, a task, the middleware chain): more than an append's own work. A writer's
keep-alive connection that does nothing but POST is the ingester's hot path, so
FastLaneHandler is aiohttp's RequestHandler with one addition: a plain append

    POST /v1/stream/{path} HTTP/1.1   (keep-alive, Content-Length body; no query, no
                                       %-escapes, no dot segments, no Transfer-Encoding,
                                       Content-Encoding, Expect or Upgrade)

that begins while aiohttp has nothing in progress on the connection is parsed with httptools
and answered from a callback on its group commit: the same validation
(ingester.http.append_request), the same answers (append_answer, shared.http.handlers.error_response),
the same headers, metrics and limits, without a task or a Request object.

Everything else is aiohttp's, byte for byte. Bytes received wait in one buffer, in arrival
order, and one loop (`_pump`) takes messages from its front: when the connection is between
messages and aiohttp has nothing in progress, a message whose whole head is there is parsed on
its own (exactly its head: a parser never runs past a message) and, if it is a plain append,
taken once its Content-Length body is in; anything else, and everything after it, goes to
aiohttp, with an httptools parser following those bytes so the lane knows when aiohttp's
messages end. While a fast answer is pending nothing after it is taken, so answers and
storage keep the request order; a refusal answered at once lets the same loop go on (no
recursion), and each byte is looked at a bounded number of times (linear in a pipeline).

The lane stands aside (aiohttp answers everything, as before) while auth is on (tokens are
verified asynchronously), while the access log is on (it is aiohttp's), and with
DS3_FAST_LANE=0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Final, Literal, cast

import httptools
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.web_protocol import RequestHandler

from ingester.http import append_answer, append_request
from ingester.service import SERVICE, IngesterService
from shared import extensions, logs
from shared import protocol as P
from shared.errors import DS3Error, RequestTimeout
from shared.http.auth import AUTH, INTERNAL_HEADER
from shared.http.handlers import BODY_TIMEOUT, error_response, stream_path_of
from shared.http.limits import LIMITS, Limits
from shared.http.metrics import METRICS, HttpMetrics
from shared.limits import client_address, client_identity

log = logging.getLogger("ds3.http")
access_log = logging.getLogger("ds3.access")

# Plain stream URLs only: anything aiohttp might decode or normalise before routing is its.
_PLAIN_URL: Final = re.compile(rb"/v1/stream/[A-Za-z0-9_~!$&'()*+,;=:@./-]+")
_REFUSED_HEADERS: Final = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})
_COMMON: Final = (
    "X-Content-Type-Options: nosniff\r\n"
    "Cross-Origin-Resource-Policy: cross-origin\r\n"
    "Access-Control-Allow-Origin: *\r\n"
    f"Access-Control-Expose-Headers: {P.CORS_EXPOSE_HEADERS}\r\n"
    f"Server: {SERVER_SOFTWARE}\r\n"
)
_MAX_BODY: Final = 1024 * 1024  # the lane holds a body in memory until it is complete
_REASONS: Final = {s.value: s.phrase for s in HTTPStatus}

# What the tracker knows of the message being parsed.
_BETWEEN: Final = 0  # between messages
_UNDECIDED: Final = 1  # a fresh message (a POST whose whole head is in its first chunk) being parsed
_FAST: Final = 2  # a plain append: ours
_SLOW: Final = 3  # aiohttp's


class FastLane:
    """Per app: whether the lane may run, and what its answers need (looked up once)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.switched_on = os.environ.get("DS3_FAST_LANE", "1") not in ("0", "false", "no", "off")
        self.svc: IngesterService | None = None
        self.http: HttpMetrics | None = None
        self.limits: Limits | None = None
        self.served = 0  # appends answered by the lane
        self._date = ""
        self._date_at = 0

    def service(self) -> IngesterService | None:
        """The service when the lane may run now, else None."""
        svc = self.svc
        if svc is None:
            if not self.switched_on or SERVICE not in self.app:
                return None
            self.http = self.app[METRICS].http
            self.limits = self.app[LIMITS]
            self.svc = svc = self.app[SERVICE]
        if self.app[AUTH].enabled or access_log.isEnabledFor(logging.INFO):
            return None
        return svc

    def body_timeout(self) -> float:
        return self.app.get(BODY_TIMEOUT, 60.0)

    def date(self) -> str:
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = formatdate(now, usegmt=True)
        return self._date


class FastLaneServer(web.Server):
    """aiohttp's low-level server, making FastLaneHandlers."""

    def __init__(self, *args: Any, lane: FastLane, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lane = lane

    def __call__(self) -> RequestHandler:
        return FastLaneHandler(self, lane=self.lane, loop=self._loop, **self._kwargs)


class FastLaneRunner(web.AppRunner):
    """web.AppRunner whose connections get the fast lane (use it like an AppRunner)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.lane = FastLane(app)
        app[FAST_LANE] = self.lane

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return FastLaneServer(
            server.request_handler, request_factory=server.request_factory, lane=self.lane,
            handler_cancellation=server.handler_cancellation, loop=server._loop, **server._kwargs,
        )


FAST_LANE: Final = web.AppKey("ds3_fast_lane", FastLane)


class _Follower:
    """An httptools parser over the bytes aiohttp is given, so the lane knows whether the
    connection is between messages (only then may the next message be the lane's)."""

    __slots__ = ("between", "parser")

    def __init__(self) -> None:
        self.between = True
        self.parser = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.between = False

    def on_message_complete(self) -> None:
        self.between = True


class _Head:
    """A candidate's head, parsed on its own (exactly its bytes, never past them)."""

    __slots__ = ("duplicate", "headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.duplicate = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in self.headers:
            self.duplicate = self.duplicate or name in _SINGLE_HEADERS
        else:  # the first one counts, as with aiohttp's headers.get()
            self.headers[name] = value


class _Fast:
    """A plain append the lane took: where it ends in the buffer, and its head."""

    __slots__ = ("head_len", "headers", "total", "url")

    def __init__(self, head_len: int, total: int, url: bytes, headers: dict[bytes, bytes]) -> None:
        self.head_len, self.total, self.url, self.headers = head_len, total, url, headers


class _Headers:
    """Case-insensitive lookups in a message's raw headers, decoded like aiohttp's."""

    __slots__ = ("raw",)

    def __init__(self, raw: dict[bytes, bytes]) -> None:
        self.raw = raw

    def get(self, name: str) -> str | None:
        key = _HEADER_KEYS.get(name)
        if key is None:  # a handful of names, looked up for every append
            key = _HEADER_KEYS[name] = name.lower().encode("ascii")
        v = self.raw.get(key)
        return None if v is None else v.decode("utf-8", "surrogateescape")


_HEADER_KEYS: dict[str, bytes] = {}
_FAST_PREFIX: Final = b"POST /v1/stream/"
_MAX_HEAD: Final = 16 * 1024  # a candidate's head must be complete within this many bytes
_SINGLE_HEADERS: Final = frozenset({b"content-type", b"host", b"content-length"})  # aiohttp: 400 if repeated
_PAUSE_ABOVE: Final = 256 * 1024  # unprocessed bytes held while an answer is pending


class FastLaneHandler(RequestHandler):
    def __init__(self, manager: web.Server, *, lane: FastLane, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._lane = lane
        self._follower = _Follower()
        # Bytes received and not yet handed on, in arrival order: a message the lane is taking,
        # and whatever came after it. One buffer, consumed from `_pos` on by one loop (`_pump`),
        # so pipelined requests are taken in order, each byte looked at a bounded number of times.
        self._buf = bytearray()
        self._pos = 0
        self._pumping = False
        self._fast: _Fast | None = None  # a fast message whose body is still arriving
        self._answering = False  # a fast answer is pending: nothing after it is taken yet
        self._drained: asyncio.Future[None] | None = None  # shutdown waits on it for that answer
        self._paused_by_lane = False
        self._body_timer: asyncio.TimerHandle | None = None
        self._watched = False
        self._lane_off = False  # the follower lost the thread (a parse error): aiohttp's from now on
        self._client: str | object | None = _UNKNOWN  # the limits' identity of this connection's peer
        self._plain_url = b""  # the last URL judged plain (see _judge)
        self._path_of: tuple[bytes, str] = (b"", "")  # the last URL served and its stream path

    # --- bytes in ------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._lane_off or self._force_close or self._close:
            if self._pos < len(self._buf):  # (cannot happen: nothing is held once the lane is off)
                data = bytes(self._buf[self._pos:]) + data
                self._buf.clear()
                self._pos = 0
            super().data_received(data)
            return
        self._buf += data
        self._pump()

    def _pump(self) -> None:
        """Take messages from the buffer in order until an answer is pending or more bytes are
        needed. Iterative: an answer given at once (a refusal) does not recurse into the next."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while not self._answering and self._pos < len(self._buf) and not self._lane_off:
                if not self._step():
                    break
            buf = self._buf
            if self._pos == len(buf):
                buf.clear()
                self._pos = 0
            elif self._pos > 64 * 1024:
                del buf[: self._pos]
                self._pos = 0
            held = len(buf) - self._pos
            if self.transport is not None:
                if self._answering and held > _PAUSE_ABOVE and not self._paused_by_lane:
                    self._paused_by_lane = True
                    self.transport.pause_reading()
                elif self._paused_by_lane and (not self._answering or held <= _PAUSE_ABOVE):
                    self._paused_by_lane = False
                    self.transport.resume_reading()
        finally:
            self._pumping = False

    def _step(self) -> bool:
        """Handle the message at the buffer's position; False when it needs more bytes."""
        buf, pos = self._buf, self._pos
        fast = self._fast
        if fast is None and self._follower.between and self._aiohttp_idle() and self._lane.service() is not None:
            verdict = self._candidate(buf, pos)
            if verdict is None:
                return False  # a head that may be the lane's is not complete yet
            if verdict is not False:
                fast = self._fast = verdict
                if len(buf) - pos < fast.total:
                    # the body must arrive within the body timeout, as through aiohttp (read_body)
                    self._body_timer = self._loop.call_later(self._lane.body_timeout(), self._body_late)
        if fast is not None:
            if len(buf) - pos < fast.total:
                return False
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            body = bytes(buf[pos + fast.head_len: pos + fast.total])
            self._pos = pos + fast.total
            self._fast = None
            self._answering = True
            self._serve(fast.url, fast.headers, body)
            return True
        # aiohttp's: all we hold goes to it (it queues pipelined messages itself), and the
        # follower parses the same bytes to know where its messages end.
        chunk = bytes(buf[pos:])
        self._pos = len(buf)
        try:
            self._follower.parser.feed_data(chunk)
        except httptools.HttpParserError:
            self._lane_off = True  # aiohttp parses the same bytes and answers 400
        super().data_received(chunk)
        return True

    def _candidate(self, buf: bytearray, pos: int) -> _Fast | Literal[False] | None:
        """The message at `pos` as a plain append the lane answers; None if its head is not
        all here yet; False if it is aiohttp's."""
        held = len(buf) - pos
        if not buf.startswith(_FAST_PREFIX, pos):
            return None if held < len(_FAST_PREFIX) and _FAST_PREFIX.startswith(buf[pos:]) else False
        end = buf.find(b"\r\n\r\n", pos, pos + _MAX_HEAD)
        if end < 0:
            return None if held < _MAX_HEAD else False
        head_len = end + 4 - pos
        head = bytes(buf[pos: pos + head_len])
        # CRLF line ends only (a bare LF, which parsers may tolerate, would make the first blank
        # CRLF line not the head's end).
        if head.count(b"\n") != head.count(b"\r\n"):
            return False
        h = _Head()
        parser = httptools.HttpRequestParser(h)
        try:
            parser.feed_data(head)
        except httptools.HttpParserError:
            return False  # aiohttp answers the 400
        if h.duplicate or not self._judge(parser, h.url, h.headers):
            return False
        return _Fast(head_len, head_len + int(h.headers[b"content-length"]), h.url, h.headers)

    def _aiohttp_idle(self) -> bool:
        return not self._messages and not self._request_in_progress and not self._upgraded

    def _judge(self, p: httptools.HttpRequestParser, url: bytes, headers: dict[bytes, bytes]) -> bool:
        """Whether the message whose head `p` parsed is a plain append the lane answers."""
        if p.get_method() != b"POST" or p.get_http_version() != "1.1" or not p.should_keep_alive():
            return False
        if b"content-length" not in headers or not _REFUSED_HEADERS.isdisjoint(headers):
            return False
        svc = self._lane.svc
        if svc is None or int(headers[b"content-length"]) > min(_MAX_BODY, svc.config.max_body_bytes):
            return False  # big bodies stream through aiohttp (and it answers the 413)
        if url != self._plain_url:  # a connection usually appends to one stream: judge its URL once
            if not _PLAIN_URL.fullmatch(url) or b"/." in url:
                return False
            if extensions.split(url.decode("ascii"))[1] is not None:  # POST .../snapshot etc.
                return False
            self._plain_url = url
        presented = headers.get(_INTERNAL)  # a wrong one: aiohttp answers the 401 (and logs it)
        return presented is None or self._lane.app[AUTH].is_internal(presented.decode("utf-8", "replace"))

    def _body_late(self) -> None:
        """A client trickling a body (slowloris): 408 and close, as aiohttp's path does."""
        self._body_timer = None
        self._lane_off = True
        http = self._lane.http
        if http is not None:
            http.observe("stream_append", 408, self._lane.body_timeout())
        timeout = self._lane.body_timeout()
        r = error_response(RequestTimeout(f"the request body did not arrive within {timeout:g} s"))
        self._write(r.status, dict(r.headers), r.body if isinstance(r.body, bytes) else b"",
                    logs.accept_request_id(None))
        self.force_close()

    # --- the append ----------------------------------------------------------------------

    def _serve(self, url: bytes, raw_headers: dict[bytes, bytes], body: bytes) -> None:
        lane = self._lane
        svc, http, lim = lane.svc, lane.http, lane.limits
        assert svc is not None and http is not None and lim is not None
        http.in_flight += 1
        started = time.perf_counter()
        headers = _Headers(raw_headers)
        rid = logs.accept_request_id(headers.get(logs.REQUEST_ID_HEADER))
        try:
            if not self._watched:  # the stuck-writer watchdog knows a connection once
                self._watched = True
                lim.stuck.watch_protocol(self)
            if _INTERNAL not in raw_headers:  # a reader limits its own clients
                forwarded = headers.get("X-Forwarded-For")
                if forwarded is None and self._client is not _UNKNOWN:
                    client = cast(str | None, self._client)  # the same peer all along: judged once
                else:
                    client = client_identity(None, client_address(_peer_of(self.transport), forwarded, lim.proxies))
                    if forwarded is None:
                        self._client = client
                if client is not None:
                    lim.take(lim.writes, client, "writes")
            if url == self._path_of[0]:
                path = self._path_of[1]
            else:
                path = stream_path_of(url.decode("utf-8", "surrogateescape"), svc.config.max_path_bytes)
                self._path_of = (url, path)
            req = append_request(headers.get, body, path)
        except Exception as e:
            self._answer_failure(e, url, rid, started)
            return

        def done(result: Any, ok: bool) -> None:
            if not ok:
                self._answer_failure(result, url, rid, started)
                return
            svc.append_seconds.observe(time.perf_counter() - started)
            status, answer_headers = append_answer(result, req)
            self._answer(status, answer_headers, b"", rid, started)

        try:
            svc.committer.submit_callback(lambda txn: svc.store.append(txn, req), done)
        except Exception as e:
            self._answer_failure(e, url, rid, started)

    def _answer_failure(self, e: Exception, url: bytes, rid: str, started: float) -> None:
        """A refusal (DS3Error) as shared.http.handlers.error_response has it; anything else is a 500, logged."""
        if isinstance(e, DS3Error):
            r = error_response(e)
            self._answer(r.status, dict(r.headers), r.body if isinstance(r.body, bytes) else b"", rid, started)
        else:
            log.error("internal error on POST %s (request %s)", url[:200], rid, exc_info=e)
            self._answer(500, _INTERNAL_ERROR, _INTERNAL_ERROR_BODY, rid, started)

    def _answer(self, status: int, headers: dict[str, str], body: bytes, rid: str, started: float) -> None:
        lane = self._lane
        http = lane.http
        assert http is not None
        http.in_flight -= 1
        http.observe("stream_append", status, time.perf_counter() - started)
        lane.served += 1
        self._write(status, headers, body, rid)
        if self._keepalive_timeout > 0:  # the connection was busy, not idle
            self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout
        self._answering = False
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)
        self._pump()  # what came after it (a no-op when the answer came from inside the pump)

    def _write(self, status: int, headers: dict[str, str], body: bytes, rid: str) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n")
        if status != 204:
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append(f"Date: {self._lane.date()}\r\nX-Request-Id: {rid}\r\n{_COMMON}\r\n")
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write("".join(lines).encode("latin-1", "replace") + body)

    # --- the end -------------------------------------------------------------------------

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().connection_lost(exc)

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        if self._answering:  # let a pending answer go out first
            self._drained = drained = self._loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(drained), timeout)
            except (TimeoutError, asyncio.CancelledError):
                pass
        await super().shutdown(timeout)


def _peer_of(transport: asyncio.Transport | None) -> str | None:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) else None


_UNKNOWN: Final = object()
_INTERNAL: Final = INTERNAL_HEADER.lower().encode("ascii")
_INTERNAL_ERROR: Final = {"Content-Type": "text/plain; charset=utf-8"}
_INTERNAL_ERROR_BODY: Final = b"internal server error; nothing was changed\n"
