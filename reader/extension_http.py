"""Snapshots and bootstrap on the reader (extensions §2-3).

Publishing and deleting go to the ingester; so do snapshot reads (rare, and only the
ingester knows the tail that Stream-Up-To-Date compares with). Bootstrap is where history
is read in bulk, so the reader serves it: the ingester says what it holds right now (a HEAD:
the snapshot offset and the tail), the snapshot and every sealed message come from the
object store, and only the unsealed rest is asked of the ingester, as ready-made multipart
parts with this response's boundary (GET /_ds3/parts)."""

from __future__ import annotations

import logging
from urllib.parse import urlencode

from aiohttp import web

from reader.proxy import IngesterClient, relay, to_response
from reader.state import ReaderState, servable
from shared import chunks, extensions, offsets
from shared import protocol as P
from shared.buckets import url_path
from shared.descriptor import Descriptor
from shared.errors import BadRequest, Gone, NotFound, ObjectNotFound, Unavailable
from shared.extensions import BOOTSTRAP, Endpoint
from shared.http.handlers import PREPARED, read_snapshot_body
from shared.placement import placement_key

log = logging.getLogger("ds3.reader")


async def handle(request: web.Request, st: ReaderState, path: str, ep: Endpoint) -> web.StreamResponse:
    method = request.method
    headers = IngesterClient._request_headers(request)
    if ep.kind == BOOTSTRAP and method in ("GET", "HEAD"):
        if "live" in request.query:
            raise BadRequest("bootstrap is one-shot and has no live mode: tail from its Stream-Next-Offset")
        return await bootstrap(request, st, path)
    if method in ("PUT", "DELETE") and ep.kind != BOOTSTRAP:
        body = await read_snapshot_body(request, st.config.max_snapshot_bytes) if method == "PUT" else None
        st.forwarded += 1
        written = await st.router.call(placement_key(path), method, request.path_qs, headers, body)
        st.descriptors.forget(path)
        return to_response(written)
    st.forwarded += 1
    async with st.router.open(placement_key(path), method, request.path_qs, headers) as up:
        return await relay(request, up)


async def bootstrap(request: web.Request, st: ReaderState, path: str) -> web.StreamResponse:
    st.forwarded += 1
    key = placement_key(path)
    head = await st.router.call(key, "HEAD", url_path(path), IngesterClient._request_headers(request), None)
    if head.status == 404:
        raise NotFound("stream not found")
    if head.status == 410:
        raise Gone("stream was deleted")
    if head.status != 200:
        raise Unavailable(f"the ingester answered {head.status} to a HEAD", 1)
    snapshot = head.headers.get(P.SNAPSHOT_OFFSET)
    tail = head.headers[P.NEXT_OFFSET]
    desc = await st.descriptors.get(path, max_age=0)
    if desc is None or not servable(desc) or desc.snapshot_offset != snapshot:
        return await _forward(request, st, key)  # a newer change than the store shows: the ingester knows
    size = None
    if desc.snapshot_key is not None:
        try:
            size = (await st.objects.head(desc.snapshot_key)).size
        except ObjectNotFound:
            return await _forward(request, st, key)  # superseded just now
    boundary = extensions.new_boundary()
    headers = {
        "Content-Type": extensions.content_type(boundary),
        P.SNAPSHOT_OFFSET: snapshot or "-1", P.NEXT_OFFSET: tail, P.UP_TO_DATE: "true", "Cache-Control": "no-store",
    }
    if head.headers.get(P.CLOSED) == "true":
        headers[P.CLOSED] = "true"
    resp = web.StreamResponse(status=200, headers=headers)
    await resp.prepare(request)
    request[PREPARED] = True  # from here on a failure cuts the body: never a short answer
    if request.method == "HEAD":
        return resp
    first_type = desc.snapshot_type if size is not None else extensions.EMPTY_SNAPSHOT_TYPE
    await resp.write(extensions.first_part_head(boundary, first_type))
    if desc.snapshot_key is not None:
        async for piece in st.objects.stream(desc.snapshot_key):
            await resp.write(piece)
    here = offsets.parse(snapshot) if snapshot else offsets.ZERO
    until = offsets.parse(tail).position
    here = await _sealed_parts(resp, st, desc, here, until, boundary)
    if here.position < until:
        query = urlencode({"path": path, "from": str(here), "until": tail, "boundary": boundary})
        async with st.router.open(key, "GET", "/_ds3/parts?" + query, {}) as up:
            if up.status != 200:
                raise Unavailable(f"the ingester answered {up.status} for the unsealed messages", 1)
            async for piece in up.content.iter_chunked(256 * 1024):
                await resp.write(piece)
    await resp.write(extensions.closing(boundary))
    await resp.write_eof()
    return resp


async def _sealed_parts(
    resp: web.StreamResponse, st: ReaderState, desc: Descriptor, here: offsets.Offset, until: int, boundary: str
) -> offsets.Offset:
    """Write the parts of sealed messages from `here` on (below `until`); return where they stop."""
    json_mode = P.is_json(desc.content_type)
    while here.position < until:
        found = await st.locator.find(desc, here)
        if found is None:
            break
        piece = found.piece
        data = await st.chunks.read(piece)
        st.sealed_responses += 1
        for end, message in chunks.messages_in(piece.head, piece.start, piece.end, data):
            if end > until:
                return here
            await resp.write(extensions.part_head(boundary, desc.content_type) + extensions.part_body(message, json_mode))
            here = offsets.Offset(found.chunk, end)
        here = offsets.parse(found.next_offset)
    return here


async def _forward(request: web.Request, st: ReaderState, key: str) -> web.StreamResponse:
    st.forwarded += 1
    async with st.router.open(key, "GET", request.path_qs, IngesterClient._request_headers(request)) as up:
        return await relay(request, up)
