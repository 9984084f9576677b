"""HTTP surface of the reader: sealed history from the object store, everything else
forwarded to the ingester, so one public URL serves the whole protocol."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import urlencode

import orjson
from aiohttp import web

from reader import extension_http, sse_fanout
from reader.fanout import Page
from reader.proxy import IngesterClient, Upstream, to_response
from reader.relay import Body, HeadStart, PageKey, splice_body
from reader.sealed import SealedRead, across_forks
from reader.state import READER, ReaderState, servable
from shared import extensions, jsonmode, offsets
from shared import protocol as P
from shared.buckets import url_path
from shared.chunkstore import RELAY_PIECE, Slice
from shared.descriptor import Descriptor
from shared.errors import (
    BadRequest,
    DS3Error,
    Forbidden,
    Gone,
    NotFound,
    ObjectStoreError,
    Retained,
    Unavailable,
)
from shared.http.handlers import (
    IMMUTABLE,
    PREPARED,
    live_mode,
    method_not_allowed,
    preflight,
    read_body,
    refuse_repeated_headers,
    start_offset,
    stream_location,
    stream_path_of,
)
from shared.objectstore import MappedRange
from shared.objectstore.open_body import OpenBody
from shared.placement import placement_key

log = logging.getLogger("ds3.reader")
START_URL_CACHE: Final = "public, max-age=60, stale-while-revalidate=300"
# Pages of a catch-up asked of the store ahead of their requests: the next one's time to first
# byte and the one after's pass while a page is sent (scripts/bench_catchup.py).
NEXT_PAGES_AHEAD: Final = 2
# How long the last sealed page waits to learn whether it ends at the tail (reader/http.py tail_of).
TAIL_CHECK_SECONDS: Final = 0.5
# How long a read of a stream with a TTL waits for the ingester to renew it before it serves the
# sealed history anyway (reader.http.renew).
TOUCH_WAIT: Final = 1.0


async def handle_stream(request: web.Request) -> web.StreamResponse:
    st = request.app[READER]
    method = request.method
    if method == "OPTIONS":
        return preflight()
    refuse_repeated_headers(request)
    raw, endpoint = extensions.split(request.raw_path.split("?", 1)[0])
    path = stream_path_of(raw, st.config.max_path_bytes)
    if endpoint is not None:
        return await extension_http.handle(request, st, path, endpoint)
    if method == "GET":
        return await handle_get(request, st, path)
    if method not in ("PUT", "POST", "DELETE", "HEAD"):
        return method_not_allowed(method)
    body = await read_body(request, st.config.max_body_bytes) if method in ("PUT", "POST") else None
    headers = IngesterClient._request_headers(request)
    st.forwarded += 1
    up = await st.router.call(placement_key(path), method, request.path_qs, headers, body)
    if method in ("PUT", "DELETE", "POST"):
        st.descriptors.forget(path)
    if "Location" in up.headers:
        up.headers["Location"] = stream_location(request, path)
    return to_response(up)


async def handle_get(request: web.Request, st: ReaderState, path: str) -> web.StreamResponse:
    given = start_offset(request)
    live = live_mode(request, given)
    if live == "sse":
        assert given is not None
        return await sse_fanout.serve(st.sse, request, path, _offset_text(given), request.query.get("cursor"))
    if live == "long-poll" and isinstance(given, offsets.Offset) and st.sse.follows(path, str(given)):
        # At the stream's live channel: nothing from here on is sealed that its answer does not
        # hold, so the store is not asked (two chunk lookups that miss, per long-poll).
        answered = await st.sse.long_poll(request, path, str(given), request.query.get("cursor"))
        if answered is not None:
            return answered
    desc: Descriptor | None = None
    start: offsets.Offset | None = None
    if given is None or isinstance(given, offsets.Offset) or given == offsets.START:
        start = given if isinstance(given, offsets.Offset) else offsets.ZERO
        try:
            # The start URL outlives a delete and re-create of the path: check which stream it is.
            fresh = 0.0 if not isinstance(given, offsets.Offset) else None
            if fresh is not None and (cached := st.descriptors.peek(path)) is not None \
                    and servable(cached) and cached.snapshot_offset is None:
                # Meanwhile the first page is asked of the store as the cached descriptor has it
                # (the same stream, most likely: then serve_sealed takes it; else it is dropped).
                _start_page(st, cached, start)
            desc = await st.descriptors.get(path, max_age=fresh)
            if desc is not None:
                check_retained(desc, given)
            if desc is not None and servable(desc):
                found = await st.locator.find(desc, start)
                run = None if found is None else await across_forks(st.locator, found)
                if run is not None:  # (None: the rest of the page is the ingester's)
                    tail = None
                    if desc.ttl is not None:
                        tail = await renew(st, path)
                    elif await _may_end_at_tail(st, run[-1]):
                        tail = await tail_of(st, path)
                    start_url = not isinstance(given, offsets.Offset)
                    if len(run) > 1:
                        return await serve_joined(request, st, run, live, start_url=start_url, tail=tail)
                    return await serve_sealed(request, st, run[0], live, start_url=start_url, tail=tail)
        except (ObjectStoreError, Unavailable) as e:
            if request.get(PREPARED):
                raise  # headers are out: a second response is impossible, drop the connection
            log.warning("object store read failed for %s (%s); asking the ingester", path, e)
    st.forwarded += 1
    try:
        if live == "long-poll" and isinstance(given, offsets.Offset):
            # waiters share the stream's live channel (reader.fanout)
            answered = await st.sse.long_poll(request, path, str(given), request.query.get("cursor"))
            if answered is not None:
                return answered
        key = placement_key(path)
        if given == offsets.NOW:  # "now" is the tail when this request came: never a shared one
            call = st.router.call(key, "GET", request.path_qs, IngesterClient._request_headers(request), None)
        else:
            call = st.router.get_collapsed(key, request.path_qs, IngesterClient._request_headers(request))
        # a long-poll waiting at the ingester ends as the live channels' waiters do when the reader stops
        up = await (st.sse.forwarded(call) if live == "long-poll" else call)
    except Unavailable:
        eof = _eof_from_descriptor(desc, given)
        if eof is not None:
            return eof
        if start is not None and desc is not None and servable(desc):
            # sealed since the store was last asked about it (reader/sealed.py remembers misses)?
            try:
                found = await st.locator.find(desc, start, remembered=False)
            except (ObjectStoreError, Unavailable):
                found = None
            if found is not None:
                return await serve_sealed(request, st, found, live, start_url=not isinstance(given, offsets.Offset))
        raise
    return to_response(up)


def _offset_text(given: offsets.Offset | str) -> str:
    return str(given) if isinstance(given, offsets.Offset) else given


async def read_page(st: ReaderState, path: str, offset: str) -> Page:
    """One catch-up read for an SSE client catching up: sealed if possible, else forwarded."""
    start = offsets.parse_query(offset)
    if not isinstance(start, str) or start == offsets.START:
        at = start if isinstance(start, offsets.Offset) else offsets.ZERO
        try:
            desc = await st.descriptors.get(path)
            if desc is not None:
                check_retained(desc, start)
            if desc is not None and servable(desc):
                found = await st.locator.find(desc, at)
                if found is not None:
                    data = await st.chunks.read(found.piece)
                    body = jsonmode.render_stored(data) if P.is_json(desc.content_type) else data
                    st.sealed_responses += 1
                    return Page(desc.content_type, body, found.next_offset, found.final, found.final)
        except (ObjectStoreError, Unavailable) as e:
            log.warning("object store read failed for %s (%s); asking the ingester", path, e)
    qs = f"{url_path(path)}?" + urlencode({"offset": offset})
    st.forwarded += 1
    key = placement_key(path)
    up = await (st.router.call(key, "GET", qs, {}, None) if offset == offsets.NOW
                else st.router.get_collapsed(key, qs, {}))
    if up.status != 200:
        raise _upstream_error(up)
    return Page(
        up.headers.get("Content-Type", ""), up.body, up.headers.get(P.NEXT_OFFSET, offset),
        up.headers.get(P.UP_TO_DATE) == "true", up.headers.get(P.CLOSED) == "true",
    )


def _upstream_error(up: Upstream) -> DS3Error:
    """The ingester's refusal of a catch-up read, as the same error of our own."""
    said = up.body.decode("utf-8", "replace").strip()[:300]
    if up.status == 410:
        retained = _retained_offset(up.body)
        return Retained(retained) if retained is not None else Gone(said or "stream was deleted")
    refusal = {400: BadRequest, 403: Forbidden, 404: NotFound}.get(up.status)
    if refusal is not None:
        return refusal(said or f"the ingester answered {up.status}")
    return Unavailable(f"the ingester answered {up.status} to a catch-up read", 1)


def check_retained(desc: Descriptor, given: offsets.Offset | str | None) -> None:
    """410 for reads before the earliest retained offset (the latest snapshot's), -1 included."""
    if desc.snapshot_offset is None:
        return
    if given is None or given == offsets.START or (isinstance(given, offsets.Offset) and given.position < desc.earliest):
        raise Retained(desc.snapshot_offset)


def _retained_offset(body: bytes) -> str | None:
    try:
        found = orjson.loads(body).get("earliest_offset")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def _eof_from_descriptor(desc: Descriptor | None, given: offsets.Offset | str | None) -> web.Response | None:
    """With the ingester down, the end of a closed stream is still known from its descriptor."""
    if desc is None or not desc.closed or desc.final_offset is None:
        return None
    if not isinstance(given, offsets.Offset) or given.position != offsets.parse(desc.final_offset).position:
        return None
    body = b"[]" if P.is_json(desc.content_type) else b""
    headers = {
        "Content-Type": desc.content_type, P.NEXT_OFFSET: desc.final_offset, P.UP_TO_DATE: "true",
        P.CLOSED: "true", "Cache-Control": "public, max-age=60",
    }
    return web.Response(status=200, body=body, headers=headers)


async def serve_sealed(
    request: web.Request, st: ReaderState, found: SealedRead, live: str | None, *, start_url: bool,
    tail: Tail | None = None,
) -> web.StreamResponse:
    """A sealed range: immutable under its offset URL. The start URL (offset -1) is not: a
    path deleted and created again keeps that URL, so caches may hold it only briefly. A page
    that ends at the tail (`tail`: the ingester's, when asked) says so, and is not immutable
    then, since the stream goes on; one that ends where the stream was closed says that."""
    desc, piece = found.descriptor, found.piece
    json_mode = P.is_json(desc.content_type)
    headers, etag, cache, final, at_tail = _page_headers(request, st, [found], live, start_url, tail)
    if P.etag_matches(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers={"ETag": etag, "Cache-Control": cache})
    size = piece.obj_end - piece.obj_start
    if json_mode:
        headers["Content-Length"] = str(size + 1 if size else 2)  # '[' + slice - ',' + ']'
    else:
        headers["Content-Length"] = str(size)
    # The local store maps the chunk's file: opened before the status line, so a missing
    # object is still an error answer and not a cut body.
    mapped = await st.chunks.mapped(piece)  # (HEAD is the ingester's: this is a GET)
    relay: HeadStart | None = None
    body: Body = None
    try:
        if mapped is None:
            # The store's body: asked for while the previous page was sent (NextPages), else now.
            relay = st.next_pages.take((piece.key, piece.obj_start, piece.obj_end))
            if relay is None:
                relay = HeadStart(_opener(st, (piece.key, piece.obj_start, piece.obj_end)))
            # The store's answer before ours: a store failing here is still an error answer
            # (or the ingester's), not a cut body.
            body = await relay.body()
            if not final and not at_tail:
                _start_next_page(st, found)
        resp = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        request[PREPARED] = True
        try:
            await _send_slice(request, resp, st, piece, json_mode, mapped, body)
            await resp.write_eof()
        except ConnectionResetError:  # the client left mid-body: nothing to answer, nothing to log
            pass
        except (ObjectStoreError, Unavailable) as e:
            # The status line is out: the client can only see a cut body, so the connection
            # is dropped (not kept waiting for bytes that will not come).
            log.warning("object store failed mid-body on %s: %s; the response is cut", request.path, e)
            if request.transport is not None:
                request.transport.abort()
        return resp
    finally:
        if relay is not None:
            await relay.aclose()
        if mapped is not None:
            mapped.close()


async def serve_joined(
    request: web.Request, st: ReaderState, run: list[SealedRead], live: str | None, *, start_url: bool,
    tail: Tail | None = None,
) -> web.Response:
    """One page of several sealed reads (reader.sealed.across_forks: inherited data, then the
    fork's own), read whole (a page of a fork's start: small, and rare enough)."""
    headers, etag, cache, _, _ = _page_headers(request, st, run, live, start_url, tail)
    if P.etag_matches(request.headers.get("If-None-Match"), etag):
        return web.Response(status=304, headers={"ETag": etag, "Cache-Control": cache})
    data = b"".join([await st.chunks.read(found.piece) for found in run])
    body = jsonmode.render_stored(data) if P.is_json(run[0].descriptor.content_type) else data
    return web.Response(status=200, body=body, headers=headers)


def _page_headers(
    request: web.Request, st: ReaderState, run: list[SealedRead], live: str | None, start_url: bool,
    tail: Tail | None,
) -> tuple[dict[str, str], str, str, bool, bool]:
    """A sealed page's headers, its ETag and Cache-Control, whether it ends where the stream
    was closed and whether at its tail. Counts the page as served from the store."""
    first, last = run[0], run[-1]
    desc, piece = last.descriptor, last.piece
    if P.is_json(desc.content_type) and not first.piece.head.is_boundary(first.piece.start):
        raise BadRequest("offset is not at a message boundary of this JSON stream")
    st.sealed_responses += 1
    at_tail = tail is not None and tail.position == piece.end and last.owner_uid == desc.uid
    final = last.final or (at_tail and tail is not None and tail.closed)
    # The ETag varies with closure (§8.1): a 304 must not hide that the stream ended here.
    # A page across a fork point names both ends' chunks: the start URL of a fork created
    # again from the same source must not match the old fork's page.
    range_tag = f"{first.owner_uid}.{first.chunk}.{first.piece.start}."
    if len(run) > 1:
        range_tag += f"{last.owner_uid}.{last.chunk}."
    etag = f'"{range_tag}{piece.end}{".c" if final else ""}"'
    cache = START_URL_CACHE if start_url else IMMUTABLE
    if at_tail and not final:
        cache = P.tail_cache_control(st.config.tail_max_age)
    headers = {
        "Content-Type": desc.content_type, P.NEXT_OFFSET: last.next_offset, "ETag": etag,
        "Cache-Control": cache,
    }
    if final:
        headers[P.CLOSED] = "true"
    if final or at_tail:
        headers[P.UP_TO_DATE] = "true"
    if live == "long-poll":
        headers[P.CURSOR] = P.response_cursor(request.query.get("cursor"))
    return headers, etag, cache, final, at_tail


def _start_next_page(st: ReaderState, found: SealedRead) -> None:
    """Ask the store for the pages after `found` now: a catch-up's client asks for them next."""
    _start_page(st, found.descriptor, offsets.parse(found.next_offset), NEXT_PAGES_AHEAD)


def _start_page(st: ReaderState, desc: Descriptor, start: offsets.Offset, ahead: int = 1) -> None:
    """Ask the store for the sealed page at `start` (if there is one) ahead of its request,
    and for the `ahead` - 1 pages after it (reader/relay.py NextPages: one already asked for
    is not asked again). Not for a store whose files are mapped instead (the local store:
    nothing to wait for)."""
    if getattr(st.objects, "open_body", None) is None:
        return

    async def find() -> PageKey | None:
        nxt = await st.locator.find(desc, start)
        if nxt is None or nxt.piece.obj_end <= nxt.piece.obj_start:
            return None
        if ahead > 1 and not nxt.final:
            _start_page(st, desc, offsets.parse(nxt.next_offset), ahead - 1)
        return nxt.piece.key, nxt.piece.obj_start, nxt.piece.obj_end

    st.next_pages.start(find, lambda k: _opener(st, k)())


def _opener(st: ReaderState, k: PageKey) -> Callable[[], Awaitable[Body]]:
    """What asks the store for object range `k`: its body to read or to take off its socket
    (S3), else its pieces."""
    open_body = getattr(st.objects, "open_body", None)
    if open_body is not None:
        return lambda: cast(Awaitable[Body], open_body(k[0], k[1], k[2]))

    async def pieces() -> Body:
        return st.objects.stream(k[0], k[1], k[2], RELAY_PIECE)
    return pieces


async def _send_slice(request: web.Request, resp: web.StreamResponse, st: ReaderState, piece: Slice,
                      json_mode: bool, mapped: MappedRange | None, body: Body) -> None:
    """The slice's bytes (a JSON slice as '[' + slice without its last ',' + ']'). A mapped
    slice goes to the socket as views of the file (no copy in Python). A store's body is moved
    from its socket to the client's in the kernel where both are plain TCP (splice_body), else
    relayed piece by piece."""
    if json_mode:
        await resp.write(b"[")
    if mapped is not None:
        view = mapped.view[:-1] if json_mode and len(mapped) else mapped.view
        for at in range(0, len(view), RELAY_PIECE):
            await resp.write(view[at:at + RELAY_PIECE])
    else:
        size = piece.obj_end - piece.obj_start
        if isinstance(body, OpenBody):
            transport = request.transport
            detached = None
            if transport is not None and transport.get_extra_info("sslcontext") is None and size:
                detached = body.detach()
            if detached is not None:
                assert transport is not None
                head, fd, _ = detached
                await splice_body(resp, transport, head, fd, size - 1 if json_mode else size,
                                  st.config.limits.send_timeout, body.took)
                if json_mode:
                    await resp.write(b"]")
                return
            body = body.pieces(RELAY_PIECE)
        if body is None:  # an empty range
            body = _nothing()
        held = b""  # a JSON slice's last byte (its ',') must not be sent
        async for part in body:
            if not part:
                continue
            if not json_mode:
                await resp.write(part)
                continue
            if held:
                await resp.write(held)
            held = part[-1:]
            await resp.write(memoryview(part)[:-1])
    if json_mode:
        await resp.write(b"]")


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


async def _may_end_at_tail(st: ReaderState, found: SealedRead) -> bool:
    """A page ending its chunk, the stream not closed there and no later chunk sealed: the
    stream's last sealed page, which ends at the tail if nothing was appended since."""
    piece = found.piece
    return piece.end == piece.head.header.end and not found.final and not await st.locator.sealed_after(found)


async def tail_of(st: ReaderState, path: str) -> Tail | None:
    """Where the ingester has the tail (renew, for a stream without a TTL, renews nothing).
    Asked only at the sealed history's end, and briefly: if the ingester is slow to say, the
    page goes out as any sealed page (without Stream-Up-To-Date; the next read says it)."""
    st.tail_checks += 1
    try:
        return await asyncio.wait_for(renew(st, path), TAIL_CHECK_SECONDS)
    except TimeoutError:
        return None


@dataclass(frozen=True, slots=True)
class Tail:
    position: int
    closed: bool


async def renew(st: ReaderState, path: str) -> Tail | None:
    """A stream with a sliding TTL: reads renew it, and only the ingester knows whether it
    has expired. Ask it (one request shared by concurrent readers of the stream), and where
    its tail is; with the ingester down, keep serving the sealed history rather than fail."""
    qs = "/_ds3/touch?" + urlencode({"path": path})
    call = st.router.collapsed_call(placement_key(path), "POST", qs, {}, flight="touch\x00" + path)
    try:
        # A frozen ingester answers nothing: the read waits TOUCH_WAIT at most, then gets the
        # sealed history as with the ingester down (found by QA: 60 s, the upstream timeout);
        # the touch goes on, shared by the stream's next readers.
        up = await asyncio.wait_for(asyncio.shield(call), TOUCH_WAIT)
    except (Unavailable, TimeoutError):
        return None
    if up.status == 404:
        st.descriptors.forget(path)
        raise NotFound("stream not found")
    if up.status == 410:
        st.descriptors.forget(path)
        raise Gone("stream was deleted")
    offset = up.headers.get(P.NEXT_OFFSET) if up.status == 204 else None
    try:
        return Tail(offsets.parse(offset).position, up.headers.get(P.CLOSED) == "true") if offset else None
    except ValueError:
        return None


def add_routes(app: web.Application) -> None:
    app.router.add_route("*", r"/v1/stream/{path:[\s\S]*}", handle_stream)  # `.` would miss "\n"
