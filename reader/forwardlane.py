"""The reader's forwarding lane: appends, creates, deletes, HEADs and reads at a stream's
unsealed tail passed to the ingester without aiohttp's per-request objects on the reader.

Writes and HEADs are the requests a reader only forwards (reader/http.py handle_stream). Through
aiohttp each one costs the reader a server round (Request, task, middlewares) and a client round
(ClientRequest, ClientResponse): about 0.4 ms of CPU, more than the ingester spends storing the
append. Here a plain

    POST, PUT, DELETE or HEAD /v1/stream/{path} HTTP/1.1   (see shared/http/lane.py for "plain")

(a fork's create, whose source auth must check too, and a DELETE with a body are aiohttp's)

is taken off the client's connection by the shared lane, checked as the aiohttp path checks it
(the path, the write and create limits), rewritten once into the upstream request (the client's headers
as sent, minus hop-by-hop ones, plus X-Forwarded-For, the internal token and the request id)
and sent on a pooled keep-alive connection (reader/upstream.py); the ingester's answer goes back
as it came, minus its hop-by-hop headers, with the reader's own Date, X-Request-Id and common
headers, the way reader.proxy.to_response and aiohttp's response preparation would write it.
tests/test_forward_lane.py compares the answers with the aiohttp path's (DS3_FAST_LANE=0).

A catch-up read (`GET ...?offset=<offset>`, no live mode) is the lane's when the reader already
knows, without asking anything, that the store cannot answer it: the stream's descriptor is in
its cache and fresh, and the chunks that could hold the offset were missing from the store a
moment ago (reader/sealed.py known_unsealed): the empty page every caught-up client reads, and
catch-ups of what only the ingester holds. Identical reads in flight at once share one upstream
request, as aiohttp's path shares them (reader/proxy.py get_collapsed). Any other read (sealed
history, the start URL, `now`, SSE, a conditional GET, a closed stream) is aiohttp's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from aiohttp import web

from reader.lane_long_poll import DROP_ANSWER_HEADERS, serve_long_poll
from reader.proxy import DROP_REQUEST, refused_internal_token
from reader.routing import MISDIRECTED, Link, Router
from reader.state import READER, ReaderState, servable
from reader.upstream import Answer
from shared import logs, offsets
from shared.errors import DS3Error, Unavailable
from shared.http.handlers import stream_path_of
from shared.http.lane import Lane, Message, catch_up_offset, forks_or_has_a_delete_body
from shared.http.lane_connection import LaneHandler
from shared.http.lane_live import long_poll_query
from shared.http.lane_runner import LaneRunner
from shared.ownership import FENCED_HEADER
from shared.placement import GENERATION_HEADER, OWNER_ID_HEADER, placement_key
from shared.tasks import spawn

log = logging.getLogger("ds3.reader.lane")
# an ingester down fails every forwarded request alike: said once per 10 s per cause
_unreachable: Final = logs.RepeatedWarnings(log)

_DROP_REQUEST: Final = frozenset(n.encode("ascii") for n in DROP_REQUEST) | {b"x-forwarded-for"}


class ForwardLane(Lane):
    """Plain appends, creates, deletes, HEADs and reads at the unsealed tail, forwarded to the
    ingester over reader.upstream's pool, and long-polls the stream's live channel answers
    (reader.fanout)."""

    methods = frozenset({b"POST", b"HEAD", b"GET", b"PUT", b"DELETE"})
    query_methods = frozenset({b"GET"})

    def __init__(self, app: web.Application) -> None:
        super().__init__(app)
        self.st: ReaderState | None = None
        self.router: Router | None = None
        self._tail = b""  # the upstream request's own header lines after the client's
        self._reads: dict[bytes, list[_Forward]] = {}  # tail reads in flight by URL, the sender first

    def ready(self) -> bool:
        if self.router is None:
            st = self.app.get(READER)
            if st is None:
                return False
            self.st, self.router = st, st.router
            self._tail = st.router.internal_lines
        return super().ready()

    def max_body(self) -> int:
        assert self.st is not None
        return min(super().max_body(), self.st.config.max_body_bytes)

    def accepts(self, handler: LaneHandler, msg: Message) -> bool:
        if forks_or_has_a_delete_body(msg):
            return False
        if msg.method != b"GET":
            try:
                return self._routed(msg, self.stream_path(handler, msg))
            except DS3Error:
                return False
        # A long-poll at a concrete offset that the stream's live channel answers, or a read at
        # the unsealed tail; any other read (sealed history, SSE, a 304 to work out) is
        # aiohttp's (reader/http.py).
        assert self.st is not None
        if b"if-none-match" in msg.headers or msg.total != msg.head_len:
            return False
        q = long_poll_query(msg.query)
        if q is None:
            return self._accepts_tail_read(handler, msg)
        try:
            path = self.stream_path(handler, msg)
        except DS3Error:
            return False  # aiohttp answers the 400/404
        if not self.st.sse.follows(path, q[0]):
            return False
        msg.route = "stream_long_poll"
        msg.note = q
        return True

    def _accepts_tail_read(self, handler: LaneHandler, msg: Message) -> bool:
        """A catch-up read that reader/http.py handle_get would pass to the ingester, judged
        from what the reader knows now (the checks it makes first, in the same order)."""
        st = self.st
        assert st is not None
        offset = catch_up_offset(msg.query)
        if offset is None:
            return False
        try:
            path = self.stream_path(handler, msg)
            start = offsets.parse(offset)
        except (DS3Error, ValueError):
            return False
        desc = st.descriptors.fresh(path)
        if desc is None or desc.closed or not servable(desc):
            return False  # unknown here, or a closed stream's end (aiohttp's path knows it with the ingester down)
        if desc.snapshot_offset is not None and start.position < desc.earliest:
            return False  # aiohttp's 410
        return st.locator.known_unsealed(desc, start) and self._routed(msg, path)

    def _routed(self, msg: Message, path: str) -> bool:
        """To the stream's owner (reader.routing), over its pool: an https:// ingester has none,
        and an owner not known yet is aiohttp's to answer (503)."""
        assert self.router is not None
        try:
            link = self.router.for_path(path)
        except DS3Error:
            return False
        if link.pool is None:
            return False
        msg.note = link
        return True

    def stream_path(self, handler: LaneHandler, msg: Message) -> str:
        assert self.st is not None
        raw = msg.path
        if raw == handler.path_of[0]:
            return handler.path_of[1]
        path = stream_path_of(raw.decode("utf-8", "surrogateescape"), self.st.config.max_path_bytes)
        handler.path_of = (raw, path)
        return path

    def serve(self, handler: LaneHandler, msg: Message, body: bytes, rid: str, started: float) -> None:
        st, lim, router = self.st, self.limits, self.router
        assert st is not None and lim is not None and router is not None
        if msg.method == b"GET":
            if msg.route == "stream_long_poll":
                serve_long_poll(self, handler, msg, rid, started)
            else:
                self._tail_read(handler, msg, rid, started)
            return
        write = msg.method != b"HEAD"
        if write:
            client = handler.client(msg)
            if client is not None:
                lim.take_write(client, msg.method == b"PUT")
        st.forwarded += 1
        _Forward(self, handler, msg, body, rid, started, write).send(msg.note)

    def _tail_read(self, handler: LaneHandler, msg: Message, rid: str, started: float) -> None:
        """Forwarded, or joined to the identical read already on its way (its answer is this
        one's too)."""
        assert self.st is not None
        self.st.forwarded += 1
        forward = _Forward(self, handler, msg, b"", rid, started, False)
        flight = self._reads.get(msg.url)
        if flight is not None:
            flight.append(forward)
            forward.link.client.collapsed += 1
            return
        self._reads[msg.url] = [forward]
        forward.send(msg.note)

    def _upstream_request(self, msg: Message, body: bytes, peer: str | None, rid: str, netloc: bytes) -> bytes:
        parts = [msg.method, b" ", msg.url, b" HTTP/1.1\r\nHost: ", netloc, b"\r\n"]
        forwarded_for = None
        for name, value in msg.pairs:
            lower = name.lower()
            if lower in _DROP_REQUEST:
                if lower == b"x-forwarded-for" and forwarded_for is None:
                    forwarded_for = value
                continue
            parts += (name, b": ", value, b"\r\n")
        if peer is not None:
            peer_b = peer.encode("ascii")
            parts += (b"X-Forwarded-For: ", forwarded_for + b", " + peer_b if forwarded_for else peer_b, b"\r\n")
        elif forwarded_for is not None:  # a unix socket's client: its proxies' header goes on as it came
            parts += (b"X-Forwarded-For: ", forwarded_for, b"\r\n")
        parts += (self._tail, b"X-Request-Id: ", rid.encode("ascii"), b"\r\n")
        if msg.method == b"POST" or msg.method == b"PUT":
            parts += (b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        else:
            parts.append(b"\r\n")
        return b"".join(parts)

    def _answer_head(self, msg: Message, answer: Answer) -> bytes:
        """The ingester's header lines without the ones the reader writes itself, and the
        Content-Length of the body passed on."""
        keep = []
        for line in answer.header_lines():
            name = line.split(b":", 1)[0].strip().lower()
            if name in DROP_ANSWER_HEADERS:
                continue
            if name == b"location":  # the reader's URL of the stream, as reader/http.py has it
                host = msg.headers.get(b"host", b"")
                line = b"Location: http://" + host + msg.url
            keep.append(line + b"\r\n")
        if answer.status != 204 and answer.status != 304 and msg.method != b"HEAD":  # (aiohttp's path sends none to a HEAD)
            keep.append(b"Content-Length: %d\r\n" % len(answer.body))
        return b"".join(keep)


class _Forward:
    """One append, HEAD or tail read on its way to the stream's owner and back. An object rather than
    closures: nested functions that refer to each other form a reference cycle per request,
    garbage only the collector frees (~28 objects per forwarded request, a 5-8% share of the
    reader's CPU in young collections at 10,000 appends/s)."""

    __slots__ = ("body", "handler", "lane", "link", "msg", "path", "peer", "retried", "rid", "started", "write")

    def __init__(self, lane: ForwardLane, handler: LaneHandler, msg: Message, body: bytes, rid: str,
                 started: float, write: bool) -> None:
        self.lane, self.handler, self.msg, self.body = lane, handler, msg, body
        self.rid, self.started, self.write = rid, started, write
        self.path = lane.stream_path(handler, msg)
        self.peer = handler.peer()
        self.link: Link = msg.note
        self.retried = False

    def send(self, to: Link) -> None:
        assert to.pool is not None
        self.link = to
        to.client.requests += 1
        request = self.lane._upstream_request(self.msg, self.body, self.peer, self.rid, to.pool.netloc)
        # Appends are pipelined; a create or delete may wait for the store (its descriptor) and
        # must not hold the appends behind it: a connection of its own, like reads.
        to.pool.request(request, self.msg.method == b"HEAD", self.done, pipelined=self.msg.method == b"POST")

    def done(self, answer: Answer | Unavailable) -> None:
        lane, msg = self.lane, self.msg
        st, router = lane.st, lane.router
        assert st is not None and router is not None
        if self.write:
            st.descriptors.forget(self.path)
        if isinstance(answer, Unavailable):
            _unreachable.warning(answer.message[:120], "%s %s: %s", msg.method.decode(),
                                 msg.url[:200].decode("latin-1"), answer.message)
            router.failed(self.link)
            if msg.method == b"GET" and (desc := st.descriptors.peek(self.path)) is not None:
                st.locator.forget_missing(desc.uid)  # the retry asks the store: sealed meanwhile?
            self.fail(answer)
            return
        if answer.status == 401 and (refusal := refused_internal_token(
                401, _header(answer, b"www-authenticate"), self.link.client.base)) is not None:
            self.fail(refusal)
            return
        if answer.status == MISDIRECTED and router.watcher is not None:
            # the ingester judged by another description: re-read it, retry once at the owner
            if self.retried:
                router.misdirected += 1
                self.fail(router.still_misdirected(self.link))
                return
            self.retried = True
            spawn(self._reroute(_header(answer, _GENERATION), _header(answer, _OWNER_ID)), _pending,
                  "re-routing a misdirected request")
            return
        if answer.status == 503 and _header(answer, _FENCED) is not None:
            router.failed(self.link)  # alive but no longer the owner: look the owner up (routing.py)
        head = lane._answer_head(msg, answer)
        for f in self._flight():
            f.handler.answer(f.msg, answer.status, {}, answer.body, f.rid, f.started, head=head)

    def fail(self, e: BaseException) -> None:
        for f in self._flight():
            f.handler.answer_failure(f.msg, e, f.rid, f.started)

    def _flight(self) -> list[_Forward]:
        """Who gets this answer: this request, and the reads that joined it (a tail read)."""
        if self.msg.method != b"GET":
            return [self]
        return self.lane._reads.pop(self.msg.url, None) or [self]

    async def _reroute(self, generation: str | None, owner_id: str | None) -> None:
        router = self.lane.router
        assert router is not None
        try:
            again = await router.after_misdirected(placement_key(self.path), self.link, generation, owner_id)
        except Exception as e:  # (answer exactly once, whatever happens)
            self.fail(e)
            return
        if again is None or again.pool is None:
            self.fail(router.still_misdirected(self.link))
            return
        self.send(again)


_pending: set[asyncio.Task[None]] = set()  # re-routes in progress (kept from the garbage collector)
_GENERATION: Final = GENERATION_HEADER.lower().encode("ascii")
_OWNER_ID: Final = OWNER_ID_HEADER.lower().encode("ascii")
_FENCED: Final = FENCED_HEADER.lower().encode("ascii")


def _header(answer: Answer, lower_name: bytes) -> str | None:
    """The first value of a header of the ingester's answer."""
    for line in answer.header_lines():
        name, _, value = line.partition(b":")
        if name.strip().lower() == lower_name:
            return value.strip().decode("latin-1")
    return None


class ForwardLaneRunner(LaneRunner):
    """web.AppRunner whose connections get the forwarding lane (use it like an AppRunner).
    SIGTERM/SIGINT drain: no new connections, parked long-polls and SSE responses end
    (reader/app.py's on_shutdown), other requests in flight get up to the shutdown timeout."""

    lane_class = ForwardLane
    drain_on_signal = True
