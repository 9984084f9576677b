"""The ingester's fast lane: plain appends answered straight from the connection's bytes.

A writer's keep-alive connection that does nothing but POST is the ingester's hot path, and
aiohttp's per-request machinery costs more than an append's own work. shared/http/lane.py
takes a plain append

    POST /v1/stream/{path} HTTP/1.1   (keep-alive, Content-Length body; see shared/http/lane.py)

off the connection without a task or a Request object; AppendLane answers it from a callback
on its group commit: the same validation (ingester.http.append_request), the same answers
(append_answer, shared.http.handlers.error_response), the same headers, metrics and limits.
tests/test_fastlane.py compares its answers with aiohttp's, byte for byte.

A reader forwards every HEAD and every read at a stream's unsealed tail, so the lane also takes
plain HEADs and catch-up reads (`GET ...?offset=<offset>`, nothing else in the query): read on
the read pool and answered from the future's callback with the headers aiohttp's handlers use
(ingester.http.head_headers, data_headers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from ingester.bucket_http import naming_missing_bucket
from ingester.http import append_answer, append_request, body_of, data_headers, head_headers
from ingester.reads import ReadResult
from ingester.records import StreamMeta
from ingester.sealed_reads import read_sealed
from ingester.service import SERVICE, IngesterService
from shared import offsets
from shared.buckets import split_internal
from shared.errors import DS3Error, NotFound, Unavailable
from shared.http.handlers import stream_path_of
from shared.http.lane import LANE, Lane, LaneHandler, LaneRunner, Message, catch_up_offset


class AppendLane(Lane):
    """Plain appends, committed by the group committer and answered from its callback; HEADs
    and catch-up reads (`?offset=<offset>` alone), read on the read pool and answered from its
    future's callback."""

    methods = frozenset({b"POST", b"HEAD", b"GET"})
    query_methods = frozenset({b"GET"})

    def __init__(self, app: web.Application) -> None:
        super().__init__(app)
        self.svc: IngesterService | None = None

    def ready(self) -> bool:
        if self.svc is None:
            if SERVICE not in self.app:
                return False
            self.svc = self.app[SERVICE]
        if self.svc.standing_by:  # aiohttp's path answers a standby's 503
            return False
        return super().ready()

    def max_body(self) -> int:
        assert self.svc is not None
        return min(super().max_body(), self.svc.config.max_body_bytes)

    def accepts(self, handler: LaneHandler, msg: Message) -> bool:
        if msg.method == b"GET":  # a catch-up read; live ones, `now`, -1 and 304s are aiohttp's
            offset = catch_up_offset(msg.query)
            if offset is None or b"if-none-match" in msg.headers or msg.total != msg.head_len:
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

    def _pool_read(self, handler: LaneHandler, msg: Message, rid: str, started: float) -> None:
        """A HEAD or a catch-up read, on the read pool."""
        svc = self.svc
        assert svc is not None
        path = self._path(handler, msg)
        if svc.membership is not None:
            svc.membership.check(path)
        if msg.method == b"HEAD":
            head = _Head(svc, handler, msg, path, rid, started)
            svc.reads.submit(svc.reads.head_sync, path).add_done_callback(head.done)
        else:
            read = _Read(svc, handler, msg, path, rid, started)
            start = offsets.parse(msg.note)
            svc.reads.submit(svc.reads.read_sync, path, start, svc.config.max_read_bytes).add_done_callback(read.done)

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
        if msg.method != b"POST":
            self._pool_read(handler, msg, rid, started)
            return
        if not msg.internal:  # a reader limits its own clients
            client = handler.client(msg)
            if client is not None:
                lim.take(lim.writes, client, "writes")
        path = self._path(handler, msg)
        if svc.membership is not None:  # another ingester's stream: 421 naming it, like aiohttp's
            svc.membership.check(path)
        req = append_request(msg.header_str, body, path)

        def done(result: Any, ok: bool) -> None:
            if not ok:
                _refused(svc, path, result, handler, msg, rid, started)
                return
            svc.append_seconds.observe(time.perf_counter() - started)
            status, answer_headers = append_answer(result, req)
            handler.answer(msg, status, answer_headers, b"", rid, started)

        svc.committer.submit_callback(lambda txn: svc.store.append(txn, req), done)


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
    task = asyncio.ensure_future(coro)
    _pending.add(task)
    task.add_done_callback(_pending.discard)


class _PoolRead:
    """A HEAD or a read on its way through the read pool (an object, not closures: no
    reference cycle), answered from its future's callback."""

    __slots__ = ("handler", "msg", "path", "rid", "started", "svc")

    def __init__(self, svc: IngesterService, handler: LaneHandler, msg: Message, path: str, rid: str,
                 started: float) -> None:
        self.svc, self.handler, self.msg, self.path, self.rid, self.started = svc, handler, msg, path, rid, started

    def failed(self, fut: asyncio.Future[Any]) -> bool:
        """Whether the read failed (then its refusal is answered)."""
        if fut.cancelled():  # (the read pool shut down under it)
            self.handler.answer_failure(self.msg, Unavailable("the ingester is shutting down"), self.rid, self.started)
            return True
        error = fut.exception()
        if error is not None:
            _refused(self.svc, self.path, error, self.handler, self.msg, self.rid, self.started)
            return True
        return False


class _Head(_PoolRead):
    __slots__ = ()

    def done(self, fut: asyncio.Future[StreamMeta]) -> None:
        if not self.failed(fut):
            self.handler.answer(self.msg, 200, head_headers(fut.result()), b"", self.rid, self.started)


class _Read(_PoolRead):
    """A catch-up read, from the object store too when it starts in a sealed chunk
    (IngesterService.read's steps, answered as ingester.http.data_response)."""

    __slots__ = ()

    def done(self, fut: asyncio.Future[ReadResult]) -> None:
        if self.failed(fut):
            return
        res = fut.result()
        if res.sealed is not None:
            _start(self._sealed(res))
        else:
            self.finish(res)

    async def _sealed(self, res: ReadResult) -> None:
        svc = self.svc
        try:
            assert svc.chunk_reader is not None  # (something sealed: there is a store)
            await read_sealed(svc.chunk_reader, res, svc.config.max_read_bytes)
        except Exception as e:  # (answer exactly once, whatever happens)
            self.handler.answer_failure(self.msg, e, self.rid, self.started)
            return
        self.finish(res)

    def finish(self, res: ReadResult) -> None:
        svc = self.svc
        svc.touch(res.meta)  # a read renews a stream's TTL (IngesterService.read)
        self.handler.answer(self.msg, 200, data_headers(res, None, svc.config.tail_max_age), body_of(res), self.rid,
                            self.started)


class FastLaneRunner(LaneRunner):
    """web.AppRunner whose connections get the append lane (use it like an AppRunner)."""

    lane_class = AppendLane


def served(app: web.Application) -> tuple[int, int] | None:
    """(appends, requests) the lane answered, or None when the app runs without one."""
    lane = app.get(LANE)
    return None if lane is None else (lane.served_by_route.get("stream_append", 0), lane.served)
