"""The fast lane's connection: a LaneHandler is aiohttp's RequestHandler plus the lane
(shared/http/lane.py says which requests are the lane's and what a Lane does with them;
shared/http/lane_runner.py serves an app with LaneHandlers).

Everything else is aiohttp's. Bytes received wait in one buffer, in arrival order, and one
loop (`_pump`) takes messages from its front: when the connection is between messages and
aiohttp has nothing in progress, a message whose whole head is there is parsed on its own
(exactly its head: a parser never runs past a message) and, if it is the lane's, taken once its
Content-Length body is in; anything else, and everything after it, goes to aiohttp, with an
httptools parser following those bytes so the lane knows when aiohttp's messages end. While a
lane answer is pending nothing after it is taken, so answers keep the request order; an answer
given at once (a refusal) lets the same loop go on (no recursion), and each byte is looked at a
bounded number of times (linear in a pipeline).

Pipelined appends are the exception: a Lane may name methods it serves alongside answers still
pending (`Lane.alongside`: the ingester's POSTs). A reader sends the appends of many clients down
one upstream connection without waiting (reader/upstream.py); the ingester takes each as it
arrives, so they share a group commit, and answers them in request order (an answer that is
ready before an earlier one waits for it). Answers that become ready in one loop iteration leave
in one send (`_flush`): a commit's answers to one connection cost one syscall, not one each. A
request of another kind after them (a HEAD, a read, anything aiohttp's) waits until they are
answered, so it sees their effects, as it would on a connection of its own.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Literal, cast

import httptools
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from shared import extensions, logs
from shared import protocol as P
from shared.errors import DS3Error, RequestTimeout
from shared.http.access import CLIENT_CLOSED, log_access
from shared.http.auth import private_head, private_headers
from shared.http.handlers import error_response, host_problem
from shared.http.lane import COMMON_HEADERS, REASONS, Lane, Message
from shared.limits import client_address, client_identity

log = logging.getLogger("ds3.http")
access_log = logging.getLogger("ds3.access")

# Plain stream URLs only: anything aiohttp might decode or normalise before routing is its, and
# so is a bucket's listing (`streams`, the reserved stream id).
_PLAIN_URL: Final = re.compile(
    rb"/v1/(?:stream/|buckets/[A-Za-z0-9_~!$&'()*+,;=:@.-]+/(?!streams\Z))[A-Za-z0-9_~!$&'()*+,;=:@./-]+")
# (a body with a Content-Encoding, identity included, is aiohttp's: read_body decodes it)
_REFUSED_HEADERS: Final = frozenset({b"transfer-encoding", b"content-encoding", b"expect", b"upgrade"})
_MAX_HEAD: Final = 16 * 1024  # a candidate's head must be complete within this many bytes
# aiohttp answers 400 if one of these is repeated (Authorization: the auth middleware; the
# protocol's own: refuse_repeated_headers)
_SINGLE_HEADERS: Final = frozenset(
    {b"content-type", b"host", b"content-length", b"authorization"}
    | {name.lower().encode() for name in P.SINGLE_VALUE_HEADERS}
)
_PAUSE_ABOVE: Final = 256 * 1024  # unprocessed bytes held while an answer is pending
_STATUS_LINES: dict[int, bytes] = {}


class _Follower:
    """An httptools parser over the bytes aiohttp is given, so the lane knows whether the
    connection is between messages (only then may the next message be the lane's)."""

    __slots__ = ("between", "given", "parser")

    def __init__(self) -> None:
        self.between = True
        self.given = 0  # messages aiohttp was given whole
        self.parser = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.between = False

    def on_message_complete(self) -> None:
        self.between = True
        self.given += 1


class _Head:
    """A candidate's head, parsed on its own (exactly its bytes, never past them)."""

    __slots__ = ("duplicate", "headers", "keep_alive", "pairs", "parser", "url", "version")

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.pairs: list[tuple[bytes, bytes]] = []
        self.duplicate = False
        self.parser: httptools.HttpRequestParser | None = None  # set while it parses (see on_headers_complete)
        self.keep_alive = False
        self.version = ""

    def on_headers_complete(self) -> None:
        # Asked here, not after feed_data: a message without a body is complete by then, and
        # llhttp resets what it knew of the message (`Connection: close` included) at its end.
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()
        self.version = self.parser.get_http_version()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.pairs.append((name, value))
        name = name.lower()
        if name in self.headers:
            self.duplicate = self.duplicate or name in _SINGLE_HEADERS
        else:  # the first one counts, as with aiohttp's headers.get()
            self.headers[name] = value


class LaneHandler(RequestHandler):
    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A request aiohttp could not parse (a request line or header over 8190 bytes, bad
        syntax): a plain 400 that says what is wrong, and one warning line. aiohttp's own logs
        a traceback at error level for each, which any client could fill the logs with, and
        echoes up to 8 KiB of the client's bytes."""
        if status != 400 or not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, LineTooLong):
            why = "a request line or header line is longer than 8190 bytes"
        else:
            why = (exc.message or type(exc).__name__).splitlines()[0][:200]
        # (not HTTP at all, often TLS to a plain port: aiohttp's own path logs that at debug too)
        (log.debug if isinstance(exc, BadHttpMethod) else log.warning)("malformed request from %s: %s",
                                                                        request.remote, why)
        resp = web.Response(status=400, text=f"malformed HTTP request: {why}\n",
                            headers={"X-Content-Type-Options": "nosniff"})
        resp.force_close()
        return resp

    def __init__(self, manager: web.Server, *, lane: Lane, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._lane = lane
        self._follower = _Follower()
        self._aiohttp_answered = 0  # messages aiohttp handled to the end (see _aiohttp_idle)
        # Bytes received and not yet handed on, in arrival order: a message the lane is taking,
        # and whatever came after it. One buffer, consumed from `_pos` on by one loop (`_pump`),
        # so pipelined requests are taken in order, each byte looked at a bounded number of times.
        self._buf = bytearray()
        self._pos = 0
        self._pumping = False
        self._fast: Message | None = None  # a lane message whose body is still arriving
        # Lane messages served and not yet answered on the wire, in request order: while there
        # are any, only a message the Lane serves alongside them is taken (see the docstring).
        self._waiting: deque[Message] = deque()
        self._out: list[bytes] = []  # answers ready in request order, sent at the end of this loop iteration
        self._flush_due = False  # a _flush is scheduled
        self._late = False  # a body came too late behind pending answers: the 408 follows them
        self._drained: asyncio.Future[None] | None = None  # shutdown waits on it for the pending answers
        self._paused_by_lane = False
        self._body_timer: asyncio.TimerHandle | None = None
        self._watched = False
        self._lane_off = False  # the follower lost the thread (a parse error): aiohttp's from now on
        self._client: str | object | None = _UNKNOWN  # the limits' identity of this connection's peer
        self._peer: str | object | None = _UNKNOWN
        self._plain_url = b""  # the last URL judged plain (see _judge)
        self._host_ok = b""  # the last Host judged valid (see _candidate)
        self.path_of: tuple[bytes, str] = (b"", "")  # a Lane's cache: the last URL path served and its stream path
        # a pending answer's way out when the client leaves or the server stops first (a long-poll's)
        self.pending_cancel: Callable[[], None] | None = None
        self.draining = False  # the server stops: what is in flight is answered, nothing new is taken

    # --- bytes in ------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if not data:
            # aiohttp's own call (its pipelined-message queue drained below its limit): it
            # parses what it buffered while paused. Those bytes are aiohttp's already; without
            # passing this on, more than 32 pipelined requests stalled until the next bytes came.
            super().data_received(data)
            return
        if self._lane_off or ((self._force_close or self._close) and self._fast is None):
            # (a lane message whose body is arriving is in flight: the server's shutdown waits
            # for its answer, so its bytes still go to the lane)
            if self._pos < len(self._buf):  # (cannot happen: nothing is held once the lane is off)
                data = bytes(self._buf[self._pos:]) + data
                self._buf.clear()
                self._pos = 0
            if self.draining and self._request_in_progress:
                self._body_while_draining(data)
                return
            super().data_received(data)
            return
        self._buf += data
        self._pump()

    def _body_while_draining(self, data: bytes) -> None:
        """Bytes for aiohttp's request in progress while the server stops: aiohttp drops all it
        receives once a connection is closing, so a request whose body was still arriving
        would wait for it until the shutdown timeout cancelled it, unanswered. Parsed as if
        open (its body reaches its handler; a message after it is parsed but never served:
        aiohttp's loop ends with this request)."""
        closing = self._close, self._force_close
        self._close = self._force_close = False
        try:
            super().data_received(data)
        finally:
            self._close, self._force_close = closing

    def _pump(self) -> None:
        """Take messages from the buffer in order until an answer is pending or more bytes are
        needed. Iterative: an answer given at once (a refusal) does not recurse into the next."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._pos < len(self._buf) and not self._lane_off:
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
                if self._waiting and held > _PAUSE_ABOVE and not self._paused_by_lane:
                    self._paused_by_lane = True
                    self.transport.pause_reading()
                elif self._paused_by_lane and (not self._waiting or held <= _PAUSE_ABOVE):
                    self._paused_by_lane = False
                    self.transport.resume_reading()
        finally:
            self._pumping = False

    def _step(self) -> bool:
        """Handle the message at the buffer's position; False when it needs more bytes."""
        buf, pos = self._buf, self._pos
        fast = self._fast
        if self._late or (fast is None and (self._close or self._force_close)):
            return False  # (closing: nothing new is taken; a message whose body is arriving is)
        if fast is None and self._waiting:
            # Answers are pending: only a message served alongside them is taken now; anything
            # else waits in the buffer until they are out.
            if not self._joins(buf, pos):
                return False
            verdict = self._candidate(buf, pos)
            if not verdict:
                return False  # not complete yet, or not one to serve alongside: after the answers
            fast = self._take(verdict)
        elif fast is None and self._follower.between and self._aiohttp_idle() and self._lane.ready():
            verdict = self._candidate(buf, pos)
            if verdict is None:
                return False  # a head that may be the lane's is not complete yet
            if verdict is not False:
                fast = self._take(verdict)
        if fast is not None:
            if len(buf) - pos < fast.total:
                return False
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            body = bytes(buf[pos + fast.head_len: pos + fast.total])
            self._pos = pos + fast.total
            self._fast = None
            self._waiting.append(fast)
            self._serve(fast, body)
            return True
        # aiohttp's: all we hold goes to it (it queues pipelined messages itself), and the
        # follower parses the same bytes to know where its messages end.
        chunk = bytes(buf[pos:])
        self._pos = len(buf)
        try:
            self._follower.parser.feed_data(chunk)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            # aiohttp parses the same bytes and answers 400, or takes the Upgrade (QA: an
            # Upgrade escaped here and killed the connection, and with it, when raised in an
            # upstream answer's callback, the reader's pooled connection to the ingester)
            self._lane_off = True
        super().data_received(chunk)
        return True

    def _take(self, msg: Message) -> Message:
        """`msg` is the lane's: it is taken once its body is in."""
        self._fast = msg
        if len(self._buf) - self._pos < msg.total:
            # the body must arrive within the body timeout, as through aiohttp (read_body)
            self._body_timer = self._loop.call_later(self._lane.body_timeout(), self._body_late)
        return msg

    def _joins(self, buf: bytearray, pos: int) -> bool:
        """Whether the message at `pos` may be taken while the pending answers are: they are of
        a kind the Lane serves alongside each other, there is room, and it looks like one."""
        lane = self._lane
        waiting = self._waiting
        if len(waiting) >= lane.max_alongside or waiting[0].method not in lane.alongside:
            return False  # (all pending are alongside-kind when the first is: nothing else joins it)
        return any(buf.startswith(prefix, pos) for prefix in lane.alongside_prefixes)

    def _candidate(self, buf: bytearray, pos: int) -> Message | Literal[False] | None:
        """The message at `pos` as one the lane answers; None if its head is not all here yet;
        False if it is aiohttp's."""
        held = len(buf) - pos
        for prefix in self._lane.prefixes:
            if buf.startswith(prefix, pos):
                break
            if held < len(prefix) and prefix.startswith(buf[pos:]):
                return None
        else:
            return False
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
        parser = h.parser = httptools.HttpRequestParser(h)
        try:
            parser.feed_data(head)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            return False  # aiohttp answers the 400 (or takes the Upgrade: not a lane request)
        finally:
            h.parser = None  # (no reference cycle left for the collector)
        if h.duplicate:
            return False
        host = h.headers.get(b"host")  # (HTTP/1.1 only here: one is required)
        if host is None or (host != self._host_ok and host_problem([host.decode("latin-1")]) is not None):
            return False  # aiohttp's path answers the 400 (errors_middleware)
        self._host_ok = host
        method = parser.get_method()
        if method not in self._lane.methods or h.version != "1.1" or not h.keep_alive:
            return False
        if not _REFUSED_HEADERS.isdisjoint(h.headers):
            return False
        length = h.headers.get(b"content-length")
        if length is None:
            if method == b"POST":
                return False
            size = 0
        else:
            size = int(length)
            if size > self._lane.max_body():
                return False  # big bodies stream through aiohttp (and it answers the 413)
        path, sep, _query = h.url.partition(b"?")
        if (sep and method not in self._lane.query_methods) or not self._judge(path):
            return False
        msg = Message(method, head_len, head_len + size, h.url, h.headers, h.pairs)
        return msg if self._lane.authorized(msg) and self._lane.accepts(self, msg) else False

    def _aiohttp_idle(self) -> bool:
        # Every message aiohttp was given is answered. Its own state alone is not enough: between
        # taking a message from its queue and starting the task that handles it (a loop
        # iteration), aiohttp has neither a queued message nor a request in progress. A pipelined
        # append taken by the lane then was answered before aiohttp's answer to the message in
        # front of it (a 421 while the description changed), so a reader matched that append's
        # 200 to the refused request and a client was told its append was stored when it was
        # not (found by tests/test_cluster_moves.py under load, about 1 run in 6).
        return (self._follower.given <= self._aiohttp_answered and not self._messages
                and not self._request_in_progress and not self._upgraded)

    async def _handle_request(self, request: Any, start_time: float | None,
                              request_handler: Callable[[Any], Any]) -> tuple[Any, bool]:
        try:
            return cast(tuple[Any, bool], await super()._handle_request(request, start_time, request_handler))
        finally:
            self._aiohttp_answered += 1  # (its answer is written by now: finish_response)

    def _judge(self, url: bytes) -> bool:
        """Whether `url` is a plain stream URL the lane may take."""
        if url != self._plain_url:  # a connection usually talks to one stream: judge its URL once
            if not _PLAIN_URL.fullmatch(url) or b"/." in url:
                return False
            if extensions.split(url.decode("ascii"))[1] is not None:  # POST .../snapshot etc.
                return False
            self._plain_url = url
        return True

    def _body_late(self) -> None:
        """A client trickling a body (slowloris): 408 and close, as aiohttp's path does (after
        the answers to the appends before it, when they are pending: answer() calls back)."""
        fast = self._fast
        self._body_timer = None
        if self._waiting:
            self._late = True
            return
        self._lane_off = True
        http = self._lane.http
        timeout = self._lane.body_timeout()
        if http is not None:
            http.observe(fast.route if fast is not None else "other", 408, timeout)
        r = error_response(RequestTimeout(f"the request body did not arrive within {timeout:g} s"))
        self._write(r.status, dict(r.headers), r.body if isinstance(r.body, bytes) else b"",
                    logs.accept_request_id(None))
        self.force_close()
        self._settle_drain()

    # --- serving -------------------------------------------------------------------------

    def _serve(self, msg: Message, body: bytes) -> None:
        lane = self._lane
        http = lane.http
        assert http is not None
        http.in_flight += 1
        started = time.perf_counter()
        rid = logs.accept_request_id(msg.header(b"x-request-id"))
        if not self._watched:  # the stuck-writer watchdog knows a connection once
            self._watched = True
            assert lane.limits is not None
            lane.limits.stuck.watch_protocol(self)
        try:
            lane.serve(self, msg, body, rid, started)
        except Exception as e:
            self.answer_failure(msg, e, rid, started)

    def client(self, msg: Message) -> str | None:
        """The limits' identity of the client that sent `msg` (its token's subject, else its
        address, or the address its trusted proxies forwarded it for)."""
        if msg.caller is not None and msg.caller.subject:
            return msg.caller.subject
        forwarded = msg.header(b"x-forwarded-for")
        if forwarded is None and self._client is not _UNKNOWN:
            return cast(str | None, self._client)  # the same peer all along: judged once
        assert self._lane.limits is not None
        client = client_identity(None, client_address(self.peer(), forwarded, self._lane.limits.proxies))
        if forwarded is None:
            self._client = client
        return client

    def peer(self) -> str | None:
        """The connection's peer address (looked up once: a connection keeps its peer)."""
        peer = self._peer
        if peer is _UNKNOWN:
            peer = self._peer = _peer_of(self.transport)
        return cast(str | None, peer)

    def answer_failure(self, msg: Message, e: BaseException, rid: str, started: float) -> None:
        """A refusal (DS3Error) as shared.http.handlers.error_response has it; anything else is a
        500, logged."""
        if isinstance(e, DS3Error):
            r = error_response(e)
            self.answer(msg, r.status, dict(r.headers), r.body if isinstance(r.body, bytes) else b"", rid, started)
        else:
            log.error("internal error on %s %s (request %s)", msg.method.decode(), msg.url[:200], rid, exc_info=e)
            self.answer(msg, 500, _INTERNAL_ERROR, _INTERNAL_ERROR_BODY, rid, started)

    def abandoned(self, msg: Message, started: float) -> None:
        """`msg` will not be answered: its client left (or the server stops) while it waited.
        Counted as aiohttp's access middleware counts a cancelled handler (499)."""
        http = self._lane.http
        assert http is not None
        http.in_flight -= 1
        http.observe(msg.route, CLIENT_CLOSED, time.perf_counter() - started)

    def answer(self, msg: Message, status: int, headers: dict[str, str], body: bytes, rid: str, started: float,
               *, head: bytes | None = None) -> None:
        """Send the answer to `msg` and go on with what came after it. `head`: the answer's
        header lines already serialised (b"Name: value\\r\\n" each, Content-Length included),
        in place of `headers`."""
        lane = self._lane
        http = lane.http
        assert http is not None
        http.in_flight -= 1
        seconds = time.perf_counter() - started
        http.observe(msg.route, status, seconds)
        by_route = lane.served_by_route
        by_route[msg.route] = by_route.get(msg.route, 0) + 1
        self.pending_cancel = None
        if access_log.isEnabledFor(logging.INFO):
            self._log_access(msg, status, seconds, 0 if msg.method == b"HEAD" else len(body), rid)
        if msg.private:  # as shared.http.auth.private_cache_headers marks aiohttp's answers
            if head is None:
                headers = private_headers(headers)
            else:
                head = private_head(head)
        reply = self._reply(status, headers, body, rid, head=head, send_body=msg.method != b"HEAD")
        if self._keepalive_timeout > 0:  # the connection was busy, not idle
            self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout
        waiting = self._waiting
        if not waiting or waiting[0] is not msg:
            if msg in waiting:  # an earlier answer is still pending: this one waits for it
                msg.reply = reply
            return  # (else nothing waits for it any more: its client left)
        waiting.popleft()
        out = self._out
        out.append(reply)
        while waiting and waiting[0].reply is not None:
            ready = waiting.popleft()
            out.append(cast(bytes, ready.reply))
            ready.reply = None
        if not waiting:
            self._flush()
        elif not self._flush_due:  # more may be answered in this loop iteration (a group commit's): one send
            self._flush_due = True
            self._loop.call_soon(self._flush)
        if not waiting:
            self._settle_drain()
            if self._late:
                self._late = False
                self._body_late()
                return
        self._pump()  # what came after it (a no-op when the answer came from inside the pump)

    def _settle_drain(self) -> None:
        """The shutdown waiting for this connection's lane messages may go on: none is pending
        or receiving its body any more."""
        if self._waiting or (self._fast is not None and not self._lane_off):
            return
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _flush(self) -> None:
        """Send the answers that are ready, in one write."""
        self._flush_due = False
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def _log_access(self, msg: Message, status: int, seconds: float, sent: int, rid: str) -> None:
        peer = self.peer()
        client = peer or "unknown"
        forwarded = msg.header(b"x-forwarded-for")
        if forwarded is not None and self._lane.limits is not None:
            client = client_address(peer, forwarded, self._lane.limits.proxies) or client
        log_access(rid, msg.method.decode(), msg.url.decode("utf-8", "surrogateescape"), msg.route, status, seconds,
                   sent, client, msg.caller.subject if msg.caller is not None else None)

    def _write(self, status: int, headers: dict[str, str], body: bytes, rid: str) -> None:
        """Send an answer no lane message waits for (a refusal that ends the connection)."""
        self._flush()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(self._reply(status, headers, body, rid))

    def _reply(self, status: int, headers: dict[str, str], body: bytes, rid: str, *, head: bytes | None = None,
               send_body: bool = True) -> bytes:
        """An answer's bytes. `head`: its header lines already serialised (see answer)."""
        if head is None:
            lines = [f"{name}: {value}\r\n" for name, value in headers.items()]
            if status != 204 and status != 304 and (send_body or body):
                # (aiohttp answers a HEAD without a body with no Content-Length)
                lines.append(f"Content-Length: {len(body)}\r\n")
            head = "".join(lines).encode("latin-1", "replace")
        status_line = _STATUS_LINES.get(status)
        if status_line is None:
            status_line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n".encode()
        tail = f"Date: {self._lane.date()}\r\nX-Request-Id: {rid}\r\n{COMMON_HEADERS}\r\n".encode("latin-1", "replace")
        return b"".join((status_line, head, tail, body)) if send_body and body else b"".join((status_line, head, tail))

    # --- the end -------------------------------------------------------------------------

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._cancel_pending()
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():  # (nobody left to answer)
            drained.set_result(None)
        super().connection_lost(exc)

    def _cancel_pending(self) -> None:
        cancel, self.pending_cancel = self.pending_cancel, None
        if cancel is not None:
            cancel()
            self._waiting.clear()  # (the one pending message: a long-poll is never pipelined)

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        self._cancel_pending()  # a waiting long-poll is cut, as aiohttp cancels its handlers
        if self._waiting or (self._fast is not None and not self._lane_off):  # let the pending answers go out first
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
_INTERNAL_ERROR: Final = {"Content-Type": "text/plain; charset=utf-8"}
_INTERNAL_ERROR_BODY: Final = b"internal server error; nothing was changed\n"
