"""The ingester's fast lane: plain appends answered straight from the connection's bytes.

A writer's keep-alive connection that does nothing but POST is the ingester's hot path, and
aiohttp's per-request machinery costs more than an append's own work. shared/http/lane.py
takes a plain append

    POST /v1/stream/{path} HTTP/1.1   (keep-alive, Content-Length body; see shared/http/lane.py)

off the connection without a task or a Request object; AppendLane answers it from a callback
on its group commit: the same validation (ingester.http.append_request), the same answers
(append_answer, shared.http.handlers.error_response), the same headers, metrics and limits.
tests/test_fastlane.py compares its answers with aiohttp's, byte for byte.

Plain creates and deletes (a fork's create is aiohttp's) run as a task each: a create is answered
once readers find its descriptor, a delete once they cannot, as ingester.http's handlers do.

A reader forwards every HEAD and every read at a stream's unsealed tail, so the lane also takes
plain HEADs and catch-up reads (`GET ...?offset=<offset>`, nothing else in the query), answered
with the headers aiohttp's handlers use (ingester.http.head_headers, data_headers). And plain
long-polls (`offset=<offset>&live=long-poll[&cursor=N]`): every reader's live channel keeps one
per stream it follows, renewed after each answer, so with many streams live they are most of
what the ingester serves. `_LongPoll` runs ingester.http.handle_get's loop without a task: read;
nothing new, so watch the stream's version (Notifier.watch) until a commit changes it or the
timeout comes; read again; answer.

Reads run on the loop when small (a HEAD's metadata; a read with at most 64 KiB to look at,
Reads.read_small: at the tail, what the last commits wrote, in the page cache), else on the read
pool, answered from the future's callback. A hand-off to the pool costs two thread switches and
the GIL passed back and forth, more than such a read: with 500 streams live (1.3 long-polls per
message) the ingester spent 6.5 CPU seconds on 6,000 messages with every read on the pool, 4.2
with the small ones on the loop (scripts/bench_fanout.py --streams 500).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from ingester.bucket_http import naming_missing_bucket
from ingester.http import (
    append_answer,
    append_request,
    body_of,
    create_answer,
    create_request,
    data_headers,
    head_headers,
    no_content_headers,
)
from ingester.reads import ReadResult
from ingester.sealed_reads import complete_read
from ingester.service import SERVICE, IngesterService
from ingester.writes import CreateRequest
from shared import offsets
from shared import protocol as P
from shared.buckets import split_internal
from shared.errors import DS3Error, NotFound, Unavailable
from shared.http.handlers import stream_path_of
from shared.http.lane import LANE, Lane, Message, catch_up_offset, forks_or_has_a_delete_body
from shared.http.lane_connection import LaneHandler
from shared.http.lane_live import live_slot, long_poll_query
from shared.http.lane_runner import LaneRunner
from shared.tasks import spawn


class AppendLane(Lane):
    """Plain appends, committed by the group committer and answered from its callback; creates
    and deletes; HEADs, catch-up reads (`?offset=<offset>` alone) and long-polls, read on the
    loop or the read pool."""

    methods = frozenset({b"POST", b"HEAD", b"GET", b"PUT", b"DELETE"})
    query_methods = frozenset({b"GET"})
    # A reader pipelines the appends of many clients down one connection (reader/upstream.py):
    # each is submitted as it arrives, so they share group commits, and answered in order.
    alongside = frozenset({b"POST"})

    def __init__(self, app: web.Application) -> None:
        super().__init__(app)
        self.svc: IngesterService | None = None

    def ready(self) -> bool:
        if self.svc is None:
            if SERVICE not in self.app:
                return False
            self.svc = self.app[SERVICE]
        if self.svc.standing_by or self.svc.fenced_refusal() is not None:  # aiohttp's path answers their 503
            return False
        return super().ready()

    def max_body(self) -> int:
        assert self.svc is not None
        return min(super().max_body(), self.svc.config.max_body_bytes)

    def accepts(self, handler: LaneHandler, msg: Message) -> bool:
        if forks_or_has_a_delete_body(msg):
            return False
        if msg.method == b"GET":  # a catch-up read or a long-poll; SSE, `now`, -1 and 304s are aiohttp's
            if b"if-none-match" in msg.headers or msg.total != msg.head_len:
                return False
            live = long_poll_query(msg.query)
            if live is not None:
                msg.note, msg.route = live, "stream_long_poll"
            else:
                offset = catch_up_offset(msg.query)
                if offset is None:
                    return False
                msg.note = offset
        svc = self.svc
        if svc is not None and svc.moves is not None and svc.membership is not None:
            # A stream moving in (aiohttp's path waits for it), or one we may not own (it re-reads
            # the description before refusing): not for the lane.
            try:
                path = self._path(handler, msg)
            except DS3Error:
                return True  # serve() answers the error
            return svc.membership.owns(path) and not svc.moves.needs_pull(path)
        return True

    def _read(self, handler: LaneHandler, msg: Message, rid: str, started: float) -> None:
        """A HEAD, a catch-up read or a long-poll."""
        svc = self.svc
        assert svc is not None
        path = self._path(handler, msg)
        if svc.membership is not None:
            svc.membership.check(path)
        if msg.route == "stream_long_poll":
            offset, cursor = msg.note
            release = live_slot(self, handler, msg)
            _LongPoll(svc, handler, msg, path, rid, started).begin(offsets.parse(offset), cursor, release)
        elif msg.method == b"HEAD":
            _Head(svc, handler, msg, path, rid, started).run()
        else:
            _Read(svc, handler, msg, path, rid, started).run(offsets.parse(msg.note))

    def _path(self, handler: LaneHandler, msg: Message) -> str:
        assert self.svc is not None
        url = msg.path  # (a read has a query)
        if url == handler.path_of[0]:
            return handler.path_of[1]
        path = stream_path_of(url.decode("utf-8", "surrogateescape"), self.svc.config.max_path_bytes)
        handler.path_of = (url, path)
        return path

    def serve(self, handler: LaneHandler, msg: Message, body: bytes, rid: str, started: float) -> None:
        svc, lim = self.svc, self.limits
        assert svc is not None and lim is not None
        if msg.method == b"HEAD" or msg.method == b"GET":
            self._read(handler, msg, rid, started)
            return
        if not msg.internal:  # a reader limits its own clients
            client = handler.client(msg)
            if client is not None:
                lim.take_write(client, msg.method == b"PUT")
        path = self._path(handler, msg)
        if svc.membership is not None:  # another ingester's stream: 421 naming it, like aiohttp's
            svc.membership.check(path)
        if msg.method == b"PUT":
            create = dataclasses.replace(create_request(msg.header_str, path, svc.config.max_path_bytes), body=body)
            _start(_create(svc, handler, msg, create, rid, started))
            return
        if msg.method == b"DELETE":
            _start(_delete(svc, handler, msg, path, rid, started))
            return
        req = append_request(msg.header_str, body, path)

        def done(result: Any, ok: bool) -> None:
            if not ok:
                _refused(svc, path, result, handler, msg, rid, started)
                return
            svc.append_seconds.observe(time.perf_counter() - started)
            status, answer_headers = append_answer(result, req)
            handler.answer(msg, status, answer_headers, b"", rid, started)

        svc.committer.submit_callback(lambda txn: svc.store.append(txn, req), done)


async def _create(svc: IngesterService, handler: LaneHandler, msg: Message, req: CreateRequest, rid: str,
                  started: float) -> None:
    """A create, answered as ingester.http.handle_put answers it (once readers find it)."""
    try:
        result = await svc.create(req)
    except asyncio.CancelledError:  # (the server stops)
        handler.abandoned(msg, started)
        raise
    except Exception as e:
        _refused(svc, req.path, e, handler, msg, rid, started)
        return
    host = (msg.header(b"host") or "").strip()
    status, headers = create_answer(result, f"http://{host}{msg.url.decode('ascii')}")
    handler.answer(msg, status, headers, b"", rid, started)


async def _delete(svc: IngesterService, handler: LaneHandler, msg: Message, path: str, rid: str,
                  started: float) -> None:
    """A delete, answered once readers will not find the stream (as ingester.http's)."""
    try:
        await svc.delete(path)
    except asyncio.CancelledError:
        handler.abandoned(msg, started)
        raise
    except Exception as e:
        _refused(svc, path, e, handler, msg, rid, started)
        return
    handler.answer(msg, 204, {}, b"", rid, started)


def _refused(svc: IngesterService, path: str, error: BaseException, handler: LaneHandler, msg: Message, rid: str,
             started: float) -> None:
    """A failure's answer; a bucketed stream not found names a missing bucket as such."""
    if isinstance(error, NotFound) and (bucket := split_internal(path)) is not None:
        _start(_bucket_refusal(svc, bucket[0], error, handler, msg, rid, started))
    else:
        handler.answer_failure(msg, error, rid, started)


async def _bucket_refusal(svc: IngesterService, bucket_id: str, error: NotFound, handler: LaneHandler,
                          msg: Message, rid: str, started: float) -> None:
    """A bucketed stream not found: a missing bucket is named as such (ingester/bucket_http.py)."""
    try:
        error = await naming_missing_bucket(svc, bucket_id, error)
    except Exception as e:  # (answer exactly once, whatever happens)
        handler.answer_failure(msg, e, rid, started)
        return
    handler.answer_failure(msg, error, rid, started)


_pending: set[asyncio.Task[None]] = set()  # bucket checks in progress (kept from the collector)


def _start(coro: Coroutine[Any, Any, None]) -> None:
    spawn(coro, _pending, "a fast-lane request")


class _LaneRead:
    """A HEAD or a read (an object, not closures: no reference cycle), answered from the
    loop, or from its future's callback when it ran on the read pool."""

    __slots__ = ("handler", "msg", "path", "rid", "started", "svc")

    def __init__(self, svc: IngesterService, handler: LaneHandler, msg: Message, path: str, rid: str,
                 started: float) -> None:
        self.svc, self.handler, self.msg, self.path, self.rid, self.started = svc, handler, msg, path, rid, started

    def failed(self, fut: asyncio.Future[Any]) -> bool:
        """Whether the read failed (then its refusal is answered)."""
        if fut.cancelled():  # (the read pool shut down under it)
            self.refused(Unavailable("the ingester is shutting down"))
            return True
        error = fut.exception()
        if error is not None:
            self.refused(error)
            return True
        return False

    def refused(self, error: BaseException) -> None:
        _refused(self.svc, self.path, error, self.handler, self.msg, self.rid, self.started)


class _Head(_LaneRead):
    """A HEAD: the stream's metadata, read on the loop (one small LMDB get, in the page cache)."""

    __slots__ = ()

    def run(self) -> None:
        try:
            meta = self.svc.reads.head_sync(self.path)
        except Exception as e:
            self.refused(e)
            return
        self.handler.answer(self.msg, 200, head_headers(meta), b"", self.rid, self.started)


class _Read(_LaneRead):
    """A catch-up read, from the object store too when it starts in a sealed chunk
    (IngesterService.read's steps, answered as ingester.http.data_response)."""

    __slots__ = ()

    def run(self, start: offsets.Offset) -> None:
        """Read on the loop when the read is small (Reads.read_small), else on the read pool."""
        svc = self.svc
        try:
            res = svc.reads.read_small(self.path, start, svc.config.max_read_bytes)
        except Exception as e:
            self.refused(e)
            return
        if res is not None:
            self.got(res)
            return
        try:
            fut = svc.reads.submit(svc.reads.read_sync, self.path, start, svc.config.max_read_bytes)
        except RuntimeError:  # (the read pool shut down: the ingester is stopping)
            self.refused(Unavailable("the ingester is shutting down"))
            return
        fut.add_done_callback(self.done)

    def done(self, fut: asyncio.Future[ReadResult]) -> None:
        if not self.failed(fut):
            self.got(fut.result())

    def got(self, res: ReadResult) -> None:
        if res.sealed is not None or res.continues:
            _start(self._sealed(res))
        else:
            self.finish(res)

    async def _sealed(self, res: ReadResult) -> None:
        svc = self.svc
        try:
            await complete_read(svc.reads, svc.chunk_reader, self.path, res, svc.config.max_read_bytes)
        except Exception as e:  # (answer exactly once, whatever happens)
            self.refused(e)
            return
        self.finish(res)

    def finish(self, res: ReadResult) -> None:
        svc = self.svc
        svc.touch(res.meta)  # a read renews a stream's TTL (IngesterService.read)
        self.handler.answer(self.msg, 200, data_headers(res, None, svc.config.tail_max_age), body_of(res), self.rid,
                            self.started)


class _LongPoll(_Read):
    """A long-poll: ingester.http.handle_get's loop (read; nothing new: wait for a commit to
    change the stream, or the timeout; read again) with callbacks for its awaits. Holds its
    place among the live requests (live_slot) until it answers or the client leaves."""

    __slots__ = ("cursor", "deadline", "gone", "release", "seen", "start", "timer", "watching")

    def begin(self, start: offsets.Offset, cursor: str | None, release: Callable[[], None]) -> None:
        self.start, self.cursor, self.release = start, cursor, release
        self.deadline = time.monotonic() + self.svc.config.long_poll_timeout
        self.timer: asyncio.TimerHandle | None = None
        self.gone = self.watching = False
        self.handler.pending_cancel = self.cancel
        self.read()

    def read(self) -> None:
        self.seen = self.svc.notifier.version(self.path)  # before the read: a commit after it wakes us
        self.run(self.start)

    def done(self, fut: asyncio.Future[ReadResult]) -> None:
        if not self.gone:
            super().done(fut)

    def refused(self, error: BaseException) -> None:
        if self.gone:  # (cancel() accounted for it)
            return
        self.end()
        super().refused(error)

    def finish(self, res: ReadResult) -> None:
        if self.gone:
            return
        svc = self.svc
        svc.touch(res.meta)  # every read renews a stream's TTL (IngesterService.read)
        tail_max_age = svc.config.tail_max_age
        if res.messages:
            self.end()
            headers = data_headers(res, P.response_cursor(self.cursor), tail_max_age, live=True)
            self.handler.answer(self.msg, 200, headers, body_of(res), self.rid, self.started)
        elif res.closed_at_end or time.monotonic() >= self.deadline or svc.draining:
            self.end()
            cursor = None if res.closed_at_end else P.response_cursor(self.cursor)
            self.handler.answer(self.msg, 204, no_content_headers(res, cursor, tail_max_age), b"", self.rid,
                                self.started)
        elif svc.notifier.watch(self.path, self.seen, self.woke):
            self.watching = True
            if self.timer is None:
                self.timer = asyncio.get_running_loop().call_later(self.deadline - time.monotonic(), self.timed_out)
        else:  # a commit came while it read
            self.read()

    def woke(self) -> None:
        if not self.watching:  # (ended while the commit's wake-ups ran)
            return
        self.watching = False
        self.read()

    def timed_out(self) -> None:
        self.timer = None
        if self.watching:  # (aiohttp's path reads once more after its wait times out)
            self.watching = False
            self.svc.notifier.forget(self.path, self.woke)
            self.read()

    def end(self) -> None:
        """It answers now (or the client left): give back its place, its timer and its watch."""
        self.release()
        self.handler.pending_cancel = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.watching:
            self.watching = False
            self.svc.notifier.forget(self.path, self.woke)

    def cancel(self) -> None:
        """The client left, or the server stops, while it waited."""
        self.gone = True
        self.end()
        self.handler.abandoned(self.msg, self.started)


class FastLaneRunner(LaneRunner):
    """web.AppRunner whose connections get the append lane (use it like an AppRunner)."""

    lane_class = AppendLane
    drain_on_signal = True  # SIGTERM: requests in flight are answered first (ingester/app.py end_live_waits)


def served(app: web.Application) -> tuple[int, int] | None:
    """(appends, requests) the lane answered, or None when the app runs without one."""
    lane = app.get(LANE)
    return None if lane is None else (lane.served_by_route.get("stream_append", 0), lane.served)
