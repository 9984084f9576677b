"""Live fan-out: the long-poll and SSE clients of one stream on this reader share one
upstream subscription to the ingester.

A channel follows a stream with one long-poll at a time, each from where the last one
ended (`Channel.offset`). Every upstream 200 becomes an `Answer`: the ingester's body and
headers, encoded once and handed as they are to every client it answers. Long-poll waiters
at the channel's offset park on the channel and get the next answer (their own cursor is
the one header added per waiter); one that comes back late, at the offset one of the last
answers started from (the channel keeps HISTORY_ANSWERS of them), gets at once that answer
and those that followed it, joined into one page as a read from there would return it
(without Stream-Up-To-Date when it stops short of the newest). Any other waiter is forwarded like a
plain read (reader.http). SSE clients (reader.sse_fanout) catch up with ordinary reads, attach when a
read says they are up to date, and then get each answer that continues exactly where they
are, written by the channel straight to their connections.

Why long-polls and not the ingester's SSE upstream: an SSE data event carries text streams
as UTF-8 lines, so the exact bytes (a CR, invalid UTF-8) and the ingester's headers (ETag,
Cache-Control) of a long-poll answer could not be rebuilt from it. Framing SSE events from
exact bytes is easy; the reverse is not.

A channel keeps polling while anyone waited on it during its last poll, so long-poll clients
coming back with the next offset find it running; it stops after a poll nobody waited on,
when the stream closes, or on an upstream failure (which its waiters get).

When the reader stops (LiveHub.end, from the app's on_shutdown), every channel ends: its
long-poll waiters get the channel's end, 503 with Retry-After (on the fast lane and aiohttp's
path alike), and its SSE clients' responses end; long-polls forwarded as reads end the same
way, and long-polls and SSE clients that come after it are not followed any more.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiohttp import web

from reader.proxy import Upstream, to_response
from shared import offsets, sse
from shared import protocol as P
from shared.buckets import url_path
from shared.errors import DS3Error, IngesterUnreachable, Unavailable
from shared.placement import placement_key

if TYPE_CHECKING:
    from reader.routing import Router

log = logging.getLogger("ds3.reader.live")
T = TypeVar("T")


def ended() -> Unavailable:
    """What a long-poll gets when its live channel ends under it (and when the reader stops)."""
    return Unavailable("the live subscription ended", 1)


@dataclass(frozen=True, slots=True)
class Page:
    """One catch-up read, as a GET returns it."""

    content_type: str
    body: bytes
    next_offset: str
    up_to_date: bool
    closed: bool


PageReader = Callable[[str, str], Awaitable[Page]]


def position(offset: str) -> int:
    return offsets.parse(offset).position


class Answer:
    """An upstream long-poll 200 from `start`: what every client it answers gets."""

    __slots__ = (
        "_behind",
        "_sse_data",
        "body",
        "closed",
        "content_type",
        "etag",
        "headers",
        "next_offset",
        "raw_head",
        "start",
        "up_to_date",
    )

    def __init__(self, start: str, up: Upstream) -> None:
        self.start = start
        self.next_offset = up.headers.get(P.NEXT_OFFSET, start)
        self.up_to_date = up.headers.get(P.UP_TO_DATE) == "true"
        self.closed = up.headers.get(P.CLOSED) == "true"
        self.content_type = up.headers.get("Content-Type", "")
        headers = up.headers.copy()
        headers.popall(P.CURSOR, None)  # each client gets its own
        self.headers = headers
        self.body = up.body
        self.etag = up.headers.get("ETag")
        self._sse_data: bytes | None = None
        self.raw_head: bytes | None = None  # the fast lane's serialised headers (reader/forwardlane.py)
        self._behind: Answer | None = None

    def behind(self) -> Answer:
        """This answer once newer ones followed it: the same bytes, not up to date any more."""
        if not self.up_to_date:
            return self
        if self._behind is None:
            other = copy.copy(self)
            other.headers = self.headers.copy()
            other.headers.popall(P.UP_TO_DATE, None)
            other.up_to_date = False
            other.raw_head = None
            self._behind = other
        return self._behind

    @staticmethod
    def joined(run: list[Answer], *, up_to_date: bool) -> Answer:
        """Consecutive answers as one page, as a read from the first one's start returns the
        same range: the bodies joined (one JSON array for a JSON stream), the ETag spanning
        them, the last one's other headers; Stream-Up-To-Date only when `up_to_date`."""
        first, last = run[0], run[-1]
        out = copy.copy(last)
        out.start = first.start
        if P.is_json(last.content_type):
            items = [a.body[1:-1] for a in run if len(a.body) > 2]
            out.body = b"[" + b",".join(items) + b"]"
        else:
            out.body = b"".join(a.body for a in run)
        out.headers = last.headers.copy()
        out.etag = _spanning_etag(first.etag, last.etag)
        if out.etag is None:
            out.headers.popall("ETag", None)
        else:
            out.headers["ETag"] = out.etag
        out.up_to_date = up_to_date
        if not up_to_date:
            out.headers.popall(P.UP_TO_DATE, None)
        out._sse_data = out.raw_head = out._behind = None
        return out

    def response(self, cursor: str | None, if_none_match: str | None) -> web.Response:
        """This answer to one long-poll client (with its cursor), or 304 when it has it."""
        if self.etag and P.etag_matches(if_none_match, self.etag):
            return web.Response(status=304, headers={"ETag": self.etag,
                                                     "Cache-Control": self.headers.get("Cache-Control", "")})
        headers = self.headers.copy()
        headers[P.CURSOR] = P.response_cursor(cursor)
        return web.Response(status=200, headers=headers, body=self.body)

    def sse_data(self) -> bytes:
        """The data event, framed once for every SSE client (b"" for an empty page)."""
        if self._sse_data is None:
            self._sse_data = data_event(self.body, self.content_type)
        return self._sse_data


def _spanning_etag(first: str | None, last: str | None) -> str | None:
    """The ingester's ETag of a read over both answers' ranges, "sid.start.end" (".c" at the
    end of a closed stream; ingester.http.data_response): the first one's start, the last
    one's end."""
    a, b = _etag_parts(first), _etag_parts(last)
    if a is None or b is None or a[0] != b[0]:
        return None
    return f'"{a[0]}.{a[1]}.{b[2]}{".c" if b[3] else ""}"'


def _etag_parts(etag: str | None) -> tuple[str, str, str, bool] | None:
    if etag is None or len(etag) < 2 or etag[0] != '"' or etag[-1] != '"':
        return None
    inner = etag[1:-1]
    closed = inner.endswith(".c")
    parts = inner.removesuffix(".c").split(".")
    if len(parts) != 3:
        return None
    return parts[0], parts[1], parts[2], closed


def data_event(body: bytes, content_type: str) -> bytes:
    """The SSE data event of a page, as the ingester frames it (base64 for binary streams)."""
    if not body or (body == b"[]" and P.is_json(content_type)):
        return b""
    if not P.is_text_for_sse(content_type):
        return sse.data_event(base64.b64encode(body).decode("ascii"))
    return sse.data_event(body.decode("utf-8", "replace"))


@dataclass(frozen=True, slots=True)
class Tick:
    """The channel's poll at `offset` timed out (keep-alive) or found the stream closed there."""

    offset: str
    closed: bool


class Listener(Protocol):
    """An SSE client attached to a channel (reader.sse_fanout.Subscriber)."""

    def take(self, item: Answer | Tick | None) -> None:
        """An answer, a tick, or None when the channel ends; called on the channel's loop."""


RIDE_OUT_SECONDS = 10.0  # how long a channel's waiters wait out an unreachable ingester (Channel._poll)
RIDE_OUT_DELAY_MAX = 0.5  # between its tries
HISTORY_ANSWERS = 64  # answers a channel keeps for long-polls that come back late ...
HISTORY_BYTES = 4 * 1024 * 1024  # ... within this many body bytes (the newest is always kept)


class Channel:
    def __init__(self, hub: LiveHub, path: str, offset: str) -> None:
        self.hub = hub
        self.path = path
        self.key = placement_key(path)  # what its owner is found by
        self.offset = offset  # where the running (or next) upstream long-poll starts
        self.latest: Answer | None = None  # the last answer, from its start to `offset`
        # the last answers by where they start, oldest first: a long-poll a few answers behind
        # (it took a while to come back) is answered from here, not forwarded as a read
        self.history: dict[str, Answer] = {}
        self._history_bytes = 0
        self._joined: dict[str, Answer] = {}  # since()'s answers until the next one arrives
        # long-polls parked at `offset`, in arrival order with their deadlines: one timer per
        # channel answers the expired ones (cheaper than a timeout per waiter)
        self.waiters: dict[asyncio.Future[Answer | Upstream | None], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.subscribers: set[Listener] = set()
        self.wanted = True  # someone waited on the channel during the current poll
        self.content_type: str | None = None  # the stream's, once a read or an answer said it
        self.task: asyncio.Task[None] | None = None
        # while the ingester cannot be reached (_poll rides it out): what a waiter whose time is
        # up gets instead of "nothing new", which the reader cannot vouch for then
        self.unreachable: IngesterUnreachable | None = None

    def park(self, timeout: float) -> asyncio.Future[Answer | Upstream | None]:
        """A future for the next answer; None when `timeout` passes first."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Answer | Upstream | None] = loop.create_future()
        deadline = loop.time() + timeout
        self.waiters[fut] = deadline
        self.wanted = True
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)
        return fut

    def _expire(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        for fut, deadline in list(self.waiters.items()):
            if deadline > now + 0.001:
                self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)
                return
            del self.waiters[fut]
            if not fut.done():
                if self.unreachable is not None:
                    fut.set_exception(self.unreachable)
                else:
                    fut.set_result(None)

    def _answer_waiters(self, result: Answer | Upstream | Exception) -> None:
        waiters, self.waiters = self.waiters, {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fut in waiters:
            if not fut.done():
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    def _publish(self, item: Answer | Tick | None) -> None:
        for sub in list(self.subscribers):
            sub.take(item)

    async def run(self) -> None:
        failure: Exception | None = None
        try:
            while True:
                self.wanted = bool(self.waiters or self.subscribers)
                up = await self._poll()
                if up.status == 200:
                    ans = Answer(self.offset, up)
                    self.latest, self.offset, self.content_type = ans, ans.next_offset, ans.content_type
                    self._remember(ans)
                    self._answer_waiters(ans)
                    self._publish(ans)
                elif up.status == 204 and up.headers.get(P.CLOSED) != "true":
                    self._publish(Tick(self.offset, closed=False))  # waiters keep their own time
                else:  # closed at our offset, or an error status: everyone gets it, and we stop
                    self._answer_waiters(up)
                    self._publish(Tick(self.offset, closed=True) if up.status == 204 else None)
                    return
                if not (self.wanted or self.waiters or self.subscribers):
                    return
        except DS3Error as e:
            failure = e
        except Exception as e:
            log.exception("the live channel of %r failed", self.path)
            failure = Unavailable(f"the live subscription failed ({type(e).__name__})", 1)
        finally:
            if self.hub.channels.get(self.path) is self:
                del self.hub.channels[self.path]
            self._answer_waiters(failure or ended())
            self._publish(None)
            self.subscribers.clear()

    def _remember(self, ans: Answer) -> None:
        self._joined.clear()
        history = self.history
        history[ans.start] = ans
        self._history_bytes += len(ans.body)
        while len(history) > HISTORY_ANSWERS or (self._history_bytes > HISTORY_BYTES and len(history) > 1):
            oldest = next(iter(history))
            self._history_bytes -= len(history.pop(oldest).body)

    def answer_from(self, offset: str) -> Answer | None:
        """The answer that began at `offset`, if the channel still has it."""
        return self.history.get(offset)

    def since(self, first: Answer) -> Answer:
        """All the channel has from `first` on, as one answer within hub.join_bytes: a client a
        few answers behind catches up in one round, as a read from its offset would let it
        (one answer a round would keep a client that polls slower than the stream grows
        behind for good)."""
        done = self._joined.get(first.start)
        if done is not None:
            return done
        run, size = [first], len(first.body)
        following = self.history.get(first.next_offset)
        while following is not None and size + len(following.body) <= self.hub.join_bytes:
            run.append(following)
            size += len(following.body)
            following = self.history.get(following.next_offset)
        last = run[-1]
        if len(run) == 1:
            done = last if last is self.latest else last.behind()
        else:
            done = Answer.joined(run, up_to_date=last is self.latest and last.up_to_date)
        self._joined[first.start] = done
        return done

    async def _poll(self) -> Upstream:
        """The next upstream long-poll. While the ingester cannot be reached (a restart: a
        draining ingester answers the channel's poll, then closes), the waiters stay parked and
        the poll is tried again, for up to RIDE_OUT_SECONDS: they get what comes after the
        restart, or, if their own timeout comes first, the 503 (the reader cannot say "nothing
        new" then). Failing them at once gave every follower of the stream a 503 at each planned
        restart (found by QA); an ingester still unreachable after that is one a client should
        hear about."""
        qs = f"{url_path(self.path)}?offset={self.offset}&live=long-poll"
        loop = asyncio.get_running_loop()
        give_up: float | None = None
        delay = 0.05
        while True:
            try:
                # the stream's owner now (reader.routing): a changed description moves the next poll
                up = await self.hub.router.poll(self.key, qs)
                self.unreachable = None
                return up
            except IngesterUnreachable as e:
                self.unreachable = e
                now = loop.time()
                give_up = give_up if give_up is not None else now + RIDE_OUT_SECONDS
                if now >= give_up or self.hub.stopped or not (self.waiters or self.subscribers):
                    raise
                await asyncio.sleep(delay)
                delay = min(RIDE_OUT_DELAY_MAX, delay * 2)


class LiveHub:
    def __init__(self, router: Router, read_page: PageReader, max_seconds: float,
                 long_poll_timeout: float, tail_cache: str = "no-store", join_bytes: int = 1 << 20) -> None:
        self.router = router
        self.join_bytes = join_bytes  # the most a late long-poll gets at once (Channel.since)
        self.tail_cache = tail_cache  # Cache-Control of a 204 (nothing new yet): see P.tail_cache_control
        self.read_page = read_page
        self.max_seconds = max_seconds  # an SSE response ends after this long
        self.long_poll_timeout = long_poll_timeout  # a parked long-poll answers 204 after this long
        self.channels: dict[str, Channel] = {}
        self.clients = 0  # SSE clients served now
        self.shared = 0  # SSE clients that attached to a running channel
        self.dropped = 0  # SSE clients cut loose because they stopped reading
        self.stopped = False  # the reader stops: no channel any more (end)
        self._forwarded: set[asyncio.Future[Any]] = set()  # long-polls forwarded as reads (forwarded)

    def channel(self, path: str, offset: str) -> Channel:
        """The stream's channel, started at `offset` when there is none."""
        ch = self.channels.get(path)
        if ch is None:
            ch = self.channels[path] = Channel(self, path, offset)
            ch.task = asyncio.create_task(ch.run(), name=f"ds3-live-{path[:40]}")
        return ch

    def stop(self) -> None:
        """End every channel (their waiters get ended()) and every forwarded long-poll, and
        follow nothing from now on."""
        self.stopped = True
        for ch in list(self.channels.values()):
            if ch.task is not None:
                ch.task.cancel()
        for fut in list(self._forwarded):
            fut.cancel()

    async def end(self) -> None:
        """stop(), and wait until every channel has ended (its waiters answered)."""
        self.stop()
        tasks = [ch.task for ch in list(self.channels.values()) if ch.task is not None]
        await asyncio.gather(*tasks, *self._forwarded, return_exceptions=True)
        await asyncio.sleep(0)  # (the waiters' callbacks, the fast lane's answers, run now)

    async def forwarded(self, call: Awaitable[T]) -> T:
        """A long-poll forwarded as a read (`call`, the upstream request): its answer, or
        ended() when the reader stops first, as a channel's waiters get it."""
        if self.stopped:
            if asyncio.iscoroutine(call):
                call.close()
            raise ended()
        fut: asyncio.Future[T] = asyncio.ensure_future(call)
        self._forwarded.add(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.stopped and fut.cancelled() and (task is None or not task.cancelling()):
                raise ended() from None
            raise
        finally:
            self._forwarded.discard(fut)

    # ------------------------------------------------------------------------ long-poll
    def follows(self, path: str, offset: str) -> bool:
        """A long-poll at `offset` is answered by the stream's live channel: it is where the
        channel polls (the tail, as far as this reader knows) or where one of its recent answers began."""
        ch = self.channels.get(path)
        return ch is not None and (ch.offset == offset or offset in ch.history)

    def join(self, path: str, offset: str) -> Answer | tuple[Channel, asyncio.Future[Answer | Upstream | None]] | None:
        """A long-poll at a concrete offset on the stream's channel: the answer it gets at once
        (one of the channel's recent answers began there), or the channel and a parked future for its
        next answer (None: the timeout passed first; the caller removes it from ch.waiters when
        done), or None: not the channel's, forward it as a read. ended() once the reader stops."""
        if self.stopped:
            raise ended()
        ch = self.channels.get(path)
        if ch is not None and ch.offset != offset:
            earlier = ch.answer_from(offset)
            if earlier is not None:
                ch.wanted = True
                self.router.collapsed += 1
                return ch.since(earlier)
            return None
        if ch is None:
            ch = self.channel(path, offset)
        else:
            self.router.collapsed += 1
        return ch, ch.park(self.long_poll_timeout)

    async def long_poll(self, request: web.Request, path: str, offset: str,
                        cursor: str | None) -> web.StreamResponse | None:
        """The answer to a long-poll at a concrete offset, or None: forward it as a read."""
        joined = self.join(path, offset)
        if joined is None:
            return None
        if isinstance(joined, Answer):
            return joined.response(cursor, request.headers.get("If-None-Match"))
        ch, fut = joined
        try:
            result = await fut
        finally:
            ch.waiters.pop(fut, None)
        if result is None:
            return self._no_content(offset, cursor)
        if isinstance(result, Answer):
            return result.response(cursor, request.headers.get("If-None-Match"))
        return to_response(result)

    def no_content_headers(self, offset: str, cursor: str | None) -> dict[str, str]:
        return {P.NEXT_OFFSET: offset, P.UP_TO_DATE: "true", "Cache-Control": self.tail_cache,
                P.CURSOR: P.response_cursor(cursor)}

    def _no_content(self, offset: str, cursor: str | None) -> web.Response:
        """Nothing new within the timeout: the ingester's own 204."""
        return web.Response(status=204, headers=self.no_content_headers(offset, cursor))
