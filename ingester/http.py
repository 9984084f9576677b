"""HTTP surface of the ingester: /v1/stream/{path} with every Durable Streams operation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Final

from aiohttp import web

from ingester import extension_http, forks_across
from ingester.reads import ReadResult
from ingester.records import StreamMeta
from ingester.service import SERVICE, IngesterService
from ingester.writes import AppendRequest, AppendResult, CreateRequest, CreateResult
from shared import extensions, jsonmode, offsets, sse
from shared import protocol as P
from shared.buckets import fork_source_path
from shared.errors import BadRequest, Gone, Misdirected, NotFound
from shared.http.handlers import (
    live_mode,
    method_not_allowed,
    preflight,
    read_body,
    refuse_repeated_headers,
    start_offset,
    stream_location,
    stream_path_of,
)

log = logging.getLogger("ds3.http")
PUBLIC_CACHE: Final = "public, max-age=60, stale-while-revalidate=300"


# --- handlers ------------------------------------------------------------------------------


async def handle_stream(request: web.Request) -> web.StreamResponse:
    svc = request.app[SERVICE]
    method = request.method
    if method == "OPTIONS":
        return preflight()
    refuse_repeated_headers(request)
    raw, endpoint = extensions.split(request.raw_path.split("?", 1)[0])
    path = stream_path_of(raw, svc.config.max_path_bytes)
    if svc.membership is not None:  # another ingester's stream: 421 naming it; or wait for its move
        await svc.owned(path)
    if endpoint is not None:
        return await extension_http.handle(request, svc, path, endpoint)
    if method == "GET":
        return await handle_get(request, svc, path)
    if method == "POST":
        return await handle_post(request, svc, path)
    if method == "PUT":
        return await handle_put(request, svc, path)
    if method == "HEAD":
        return await handle_head(svc, path)
    if method == "DELETE":
        await svc.delete(path)
        return web.Response(status=204)
    return method_not_allowed(method)


async def handle_put(request: web.Request, svc: IngesterService, path: str) -> web.Response:
    req = create_request(request.headers.get, path, svc.config.max_path_bytes)
    body = await read_body(request, svc.config.max_body_bytes)
    status, headers = create_answer(await svc.create(dataclasses.replace(req, body=body)), stream_location(request, path))
    return web.Response(status=status, headers=headers)


def create_request(h: Callable[[str], str | None], path: str, max_path_bytes: int) -> CreateRequest:
    """A create's headers, validated (this handler and the fast lane alike; the body is the
    caller's to add). `h` looks a header up by name, case-insensitively."""
    content_type = h("Content-Type")
    if content_type is not None and not content_type.strip():
        content_type = None
    if content_type is not None and not P.is_valid_content_type(content_type):
        raise BadRequest(f"invalid Content-Type {content_type[:100]!r}")
    ttl_text, expires_text = h(P.TTL), h(P.EXPIRES_AT)
    if ttl_text is not None and expires_text is not None:
        raise BadRequest("send Stream-TTL or Stream-Expires-At, not both")
    ttl = P.parse_ttl(ttl_text) if ttl_text is not None else None
    expires_at = P.parse_expires_at(expires_text) if expires_text is not None else None
    if expires_at is not None and expires_at <= time.time():
        # (accepted, it answered 201 for a stream that no request could ever find)
        raise BadRequest("Stream-Expires-At is in the past: the stream would be expired at once")
    if ttl == 0:  # (the same: 201, then 404 at once)
        raise BadRequest("Stream-TTL is 0: the stream would be expired at once")
    if expires_at is not None and expires_at > time.time() + P.MAX_TTL_SECONDS:
        raise BadRequest(f"invalid Stream-Expires-At: at most {P.MAX_TTL_SECONDS} seconds (100 years) ahead, "
                         "as Stream-TTL")
    fork_from = h(P.FORKED_FROM)
    fork_offset = h(P.FORK_OFFSET)
    sub_text = h(P.FORK_SUB_OFFSET)
    if fork_from is not None:  # a plain stream path, or a bucketed stream's URL path
        fork_from = fork_source_path(fork_from, max_path_bytes)
    elif fork_offset is not None or sub_text is not None:
        raise BadRequest("Stream-Fork-Offset and Stream-Fork-Sub-Offset require Stream-Forked-From")
    if fork_offset is not None:
        try:
            offsets.parse(fork_offset)
        except offsets.OffsetSyntaxError as e:
            raise BadRequest(f"invalid Stream-Fork-Offset: {e}") from e
    sub = None
    if sub_text is not None:
        if len(sub_text) > 16 or not P.DECIMAL_RE.match(sub_text):
            raise BadRequest("invalid Stream-Fork-Sub-Offset: must be a non-negative decimal integer")
        sub = int(sub_text)
    return CreateRequest(
        path=path, content_type=content_type, ttl=ttl, expires_at=expires_at,
        expires_at_text=expires_text.strip() if expires_text else None,
        closed=P.flag_true(h(P.CLOSED)), body=b"", fork_from=fork_from,
        fork_offset=fork_offset, fork_sub_offset=sub,
    )


def create_answer(result: CreateResult, url: str) -> tuple[int, dict[str, str]]:
    """(status, headers): 201 with the stream's URL for a new stream, 200 for one that was there."""
    headers = {"Content-Type": result.stream.content_type, P.NEXT_OFFSET: result.stream.tail_offset}
    if result.stream.closed:
        headers[P.CLOSED] = "true"
    if result.created:
        headers["Location"] = url
    return 201 if result.created else 200, headers


async def handle_post(request: web.Request, svc: IngesterService, path: str) -> web.Response:
    body = await read_body(request, svc.config.max_body_bytes)
    req = append_request(request.headers.get, body, path)
    status, headers = append_answer(await svc.append(req), req)
    return web.Response(status=status, headers=headers)


def append_request(header: Callable[[str], str | None], body: bytes, path: str) -> AppendRequest:
    """An append's headers and body, validated (this handler and the fast lane alike).
    `header` looks a header up by name, case-insensitively."""
    close = P.flag_true(header(P.CLOSED))
    producer = P.parse_producer(header(P.PRODUCER_ID), header(P.PRODUCER_EPOCH), header(P.PRODUCER_SEQ))
    stream_seq = header(P.SEQ)
    if stream_seq is not None and stream_seq == "":
        raise BadRequest("Stream-Seq must not be empty")
    if stream_seq is not None and not P.is_utf8(stream_seq):
        raise BadRequest("invalid Stream-Seq: not valid UTF-8")
    content_type = header("Content-Type")
    messages = None
    if body:
        if not content_type or not content_type.strip():
            raise BadRequest("Content-Type is required when appending data")
        if not P.is_valid_content_type(content_type):
            raise BadRequest(f"invalid Content-Type {content_type[:100]!r}")
        if P.is_json(content_type):
            try:
                messages = jsonmode.split_messages(body, allow_empty_array=False)
            except BadRequest:  # the writer splits it again and says so, once the stream's state
                messages = None  # is known: a closed stream's 409 comes first (as the reference's)
    elif not close:
        raise BadRequest("empty body: an append needs data (or Stream-Closed: true to close)")
    return AppendRequest(path, content_type, body, messages, close=close, stream_seq=stream_seq, producer=producer)


def append_answer(result: AppendResult, req: AppendRequest) -> tuple[int, dict[str, str]]:
    """(status, headers): 200 for a producer's new data, 204 for everything else that succeeded."""
    headers = {P.NEXT_OFFSET: result.stream.tail_offset}
    if result.stream.closed:
        headers[P.CLOSED] = "true"
    if result.producer_epoch is not None:
        headers[P.PRODUCER_EPOCH] = str(result.producer_epoch)
        headers[P.PRODUCER_SEQ] = str(result.producer_seq)
    producer_appended = req.producer is not None and bool(req.body)
    return (200 if producer_appended and not result.duplicate else 204), headers


async def handle_head(svc: IngesterService, path: str) -> web.Response:
    return web.Response(status=200, headers=head_headers(await svc.head(path)))


def head_headers(meta: StreamMeta) -> dict[str, str]:
    """A HEAD's answer headers (aiohttp's path and the fast lane's)."""
    headers = {
        "Content-Type": meta.content_type,
        P.NEXT_OFFSET: meta.tail_offset,
        "Cache-Control": "no-store",
    }
    if meta.closed:
        headers[P.CLOSED] = "true"
    if meta.snapshot_offset is not None:
        headers[P.SNAPSHOT_OFFSET] = meta.snapshot_offset
    if meta.ttl is not None:
        headers[P.TTL] = str(meta.ttl)
    if meta.expires_at is not None:
        headers[P.EXPIRES_AT] = meta.expires_at_text or P.format_rfc3339(meta.expires_at)
    return headers


async def handle_get(request: web.Request, svc: IngesterService, path: str) -> web.StreamResponse:
    given = start_offset(request)
    live = live_mode(request, given)
    start = offsets.START if given is None else given
    cursor = request.query.get("cursor")
    if live == "sse":
        return await stream_sse(request, svc, path, start, cursor)
    seen = svc.notifier.version(path)
    res = await svc.read(path, start)
    if start == offsets.NOW and live is None:
        return tail_response(res)
    if live == "long-poll":
        deadline = time.monotonic() + svc.config.long_poll_timeout
        now = start == offsets.NOW
        here = offsets.parse(res.next_offset) if now else start
        while not res.messages:
            if res.closed_at_end:
                return _unshared(no_content(res, None, svc.config.tail_max_age), now)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or svc.draining:
                return _unshared(no_content(res, P.response_cursor(cursor), svc.config.tail_max_age), now)
            await svc.notifier.wait(path, seen, remaining)
            seen = svc.notifier.version(path)
            res = await svc.read(path, here)
        return _unshared(data_response(request, res, P.response_cursor(cursor), svc.config.tail_max_age, live=True),
                         now)
    return data_response(request, res, None, svc.config.tail_max_age)


def _unshared(response: web.Response, now: bool) -> web.Response:
    """A long-poll from `now` answers what came after the tail *this* request found: the same
    URL a moment later means a later tail, so no shared cache may answer it (long-poll answers
    are cacheable keyed by their offset, and "now" is not one)."""
    if now:
        response.headers["Cache-Control"] = "no-store"
    return response


def _read_headers(res: ReadResult) -> dict[str, str]:
    headers = {"Content-Type": res.meta.content_type, P.NEXT_OFFSET: res.next_offset}
    if res.up_to_date:
        headers[P.UP_TO_DATE] = "true"
    if res.closed_at_end:
        headers[P.CLOSED] = "true"
    return headers


def body_of(res: ReadResult) -> bytes:
    """A read's body: the messages, as a JSON array for a JSON stream."""
    data = b"".join(res.messages)
    return jsonmode.render_stored(data) if P.is_json(res.meta.content_type) else data


def tail_response(res: ReadResult) -> web.Response:
    headers = _read_headers(res)
    headers["Cache-Control"] = "no-store"
    return web.Response(status=200, body=body_of(res), headers=headers)


def no_content(res: ReadResult, cursor: str | None, tail_max_age: int) -> web.Response:
    return web.Response(status=204, headers=no_content_headers(res, cursor, tail_max_age))


def no_content_headers(res: ReadResult, cursor: str | None, tail_max_age: int) -> dict[str, str]:
    """A long-poll that found nothing new (or the end of a closed stream). Cacheable for
    --tail-max-age: keyed by offset and cursor, and the cursor it names differs from the one
    asked with, so a cached 204 answers one round of a client's polling, never the next."""
    headers = {P.NEXT_OFFSET: res.next_offset, P.UP_TO_DATE: "true",
               "Cache-Control": P.tail_cache_control(tail_max_age)}
    if res.meta.closed:
        headers[P.CLOSED] = "true"
    if cursor is not None and not res.meta.closed:
        headers[P.CURSOR] = cursor
    return headers


def data_response(request: web.Request, res: ReadResult, cursor: str | None, tail_max_age: int,
                  *, live: bool = False) -> web.Response:
    headers = data_headers(res, cursor, tail_max_age, live=live)
    etag = headers["ETag"]
    if P.etag_matches(request.headers.get("If-None-Match"), etag):  # (weak comparison, `*`: as the reader's)
        return web.Response(status=304, headers={"ETag": etag, "Cache-Control": headers["Cache-Control"]})
    return web.Response(status=200, body=body_of(res), headers=headers)


def data_headers(res: ReadResult, cursor: str | None, tail_max_age: int, *, live: bool = False) -> dict[str, str]:
    """A read's 200 headers (aiohttp's path and the fast lane's); `live`: a long-poll's."""
    headers = _read_headers(res)
    if cursor is not None:
        headers[P.CURSOR] = cursor
    headers["ETag"] = f'"{res.meta.sid}.{res.start}.{res.end}{".c" if res.closed_at_end else ""}"'
    headers["Cache-Control"] = _cache_control(res, tail_max_age, live)
    return headers


def _cache_control(res: ReadResult, tail_max_age: int, live: bool) -> str:
    if not res.messages or (not live and res.up_to_date and not res.closed_at_end):
        # A catch-up page that ends at an open stream's tail changes as soon as data arrives
        # (an empty one gains messages, one with messages grows): cacheable only briefly, as
        # the reader's last sealed page is. A client that got it goes on at its next offset,
        # so a cached one delays, never hides; but a client that reads once and stops would
        # take it for the stream's state. A long-poll's 200 keeps the long lifetime: it is
        # keyed by its cursor too, and its followers move on to their next offset at once.
        return P.tail_cache_control(tail_max_age)
    deadline = res.meta.deadline()
    if deadline is not None:
        left = int(deadline - time.time())
        if left < 60:
            return f"public, max-age={max(0, left)}"
    return PUBLIC_CACHE


async def stream_sse(
    request: web.Request, svc: IngesterService, path: str, start: offsets.Offset | str, cursor: str | None
) -> web.StreamResponse:
    seen = svc.notifier.version(path)
    res = await svc.read(path, start)  # 404/410 before the 200 is committed
    binary = not P.is_text_for_sse(res.meta.content_type)
    json_mode = P.is_json(res.meta.content_type)
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if binary:
        headers[P.SSE_ENCODING] = "base64"
    resp = web.StreamResponse(status=200, headers=headers)
    await resp.prepare(request)
    here = offsets.parse(res.next_offset) if start == offsets.NOW else start
    ends_at = time.monotonic() + svc.config.sse_max_seconds
    told_up_to_date = False
    with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
        while True:
            if res.messages:
                if binary:
                    payload = sse.encode_binary(b"".join(res.messages))
                elif json_mode:
                    payload = jsonmode.render_stored(b"".join(res.messages)).decode("utf-8", "replace")
                else:
                    payload = b"".join(res.messages).decode("utf-8", "replace")
                told_up_to_date = res.up_to_date
                # One write: a data event and its control event travel together, so a client
                # never sees the data without the control that says where it ends.
                await resp.write(
                    sse.data_event(payload)
                    + sse.control_event(
                        res.next_offset, cursor=P.response_cursor(cursor),
                        up_to_date=res.up_to_date, closed=res.closed_at_end,
                    )
                )
                if res.closed_at_end:
                    break
            elif res.closed_at_end:
                await resp.write(sse.control_event(res.next_offset, closed=True))
                break
            elif not told_up_to_date:
                await resp.write(
                    sse.control_event(res.next_offset, cursor=P.response_cursor(cursor), up_to_date=True)
                )
                told_up_to_date = True
            here = offsets.parse(res.next_offset)
            if res.up_to_date:
                remaining = ends_at - time.monotonic()
                if remaining <= 0 or svc.draining:
                    break
                changed = await svc.notifier.wait(path, seen, min(remaining, svc.config.long_poll_timeout))
                seen = svc.notifier.version(path)
                if not changed:  # keep-alive, and lets clients see the connection is healthy
                    if time.monotonic() >= ends_at:
                        break
                    await resp.write(
                        sse.control_event(res.next_offset, cursor=P.response_cursor(cursor), up_to_date=True)
                    )
            elif time.monotonic() >= ends_at:
                break
            try:
                res = await svc.read(path, here)
            except (NotFound, Gone, Misdirected):  # Misdirected: it moved to another ingester
                break
    with contextlib.suppress(Exception):
        await resp.write_eof()
    return resp


async def touch(request: web.Request) -> web.Response:
    """A reader served this stream from the object store: renew its sliding TTL, and say
    whether it still exists (204), expired or never did (404), or was deleted (410), and where
    its tail is and whether it is closed (so a sealed page ending there says so, §5.6)."""
    svc = request.app[SERVICE]
    path = request.query.get("path")
    if path is None:
        raise BadRequest("touch: the path parameter is required")
    if svc.membership is not None:
        await svc.owned(path)
    meta = await svc.head(path)  # NotFound / Gone map to 404 / 410
    svc.touch(meta)
    headers = {P.NEXT_OFFSET: meta.tail_offset}
    if meta.closed:
        headers[P.CLOSED] = "true"
    return web.Response(status=204, headers=headers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/_ds3/touch", touch)
    forks_across.add_routes(app)
    extension_http.add_routes(app)
    app.router.add_route("*", r"/v1/stream/{path:[\s\S]*}", handle_stream)  # `.` would miss "\n"
