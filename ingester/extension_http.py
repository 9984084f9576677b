"""HTTP surface of snapshots and bootstrap on the ingester (extensions §2-3):

    PUT    {stream}/snapshot/{offset}   204 published; 400 / 404 / 409 / 410 / 413
    GET    {stream}/snapshot            307 to the latest snapshot; 404 when none
    GET    {stream}/snapshot/{offset}   200 the blob; 404 when not the latest
    DELETE {stream}/snapshot/{offset}   404 (not the latest) or 409 (the latest: bootstrap needs it)
    GET    {stream}/bootstrap           200 multipart/mixed: the snapshot, then every retained message
    GET    /_ds3/parts                  the readers' share of a bootstrap: message parts only
"""

from __future__ import annotations

from aiohttp import web

from ingester.service import SERVICE, IngesterService
from ingester.snapshots import parse_position
from shared import extensions
from shared import protocol as P
from shared.errors import BadRequest, Conflict, Retained
from shared.extensions import BOOTSTRAP, Endpoint
from shared.http.handlers import PREPARED, read_snapshot_body

READ_METHODS = "GET, HEAD, OPTIONS"


def _not_allowed(method: str, allow: str, hint: str = "") -> web.Response:
    return web.Response(status=405, text=f"method {method} is not allowed here{hint}\n", headers={"Allow": allow})


async def handle(request: web.Request, svc: IngesterService, path: str, ep: Endpoint) -> web.StreamResponse:
    method = request.method
    if ep.kind == BOOTSTRAP:
        if method not in ("GET", "HEAD"):
            return _not_allowed(method, READ_METHODS)
        if "live" in request.query:
            raise BadRequest("bootstrap is one-shot and has no live mode: tail from its Stream-Next-Offset")
        return await bootstrap(request, svc, path)
    if ep.offset is None:  # {stream}/snapshot: where the latest one is
        if method not in ("GET", "HEAD"):
            return _not_allowed(method, READ_METHODS, ": {stream}/snapshot redirects to the latest snapshot; "
                                "publish one with PUT {stream}/snapshot/{offset} (and 'snapshot' is not a "
                                "stream name of its own under a stream)" if method == "PUT" else "")
        latest = await svc.snapshots.latest(path)
        location = request.raw_path.split("?", 1)[0] + "/" + latest
        return web.Response(status=307, headers={"Location": location, "Cache-Control": "no-store"})
    if method == "PUT":
        body = await read_snapshot_body(request, svc.config.max_snapshot_bytes)
        await svc.snapshots.publish(path, ep.offset, request.headers.get("Content-Type"), body)
        return web.Response(status=204)
    if method in ("GET", "HEAD"):
        return await snapshot(request, svc, path, ep.offset)
    if method == "DELETE":
        await svc.snapshots.check_delete(path, ep.offset)  # always refuses: 404 or 409
        raise AssertionError("unreachable")
    return _not_allowed(method, "GET, HEAD, PUT, DELETE, OPTIONS")


async def snapshot(request: web.Request, svc: IngesterService, path: str, offset: str) -> web.StreamResponse:
    blob = await svc.snapshots.read(path, offset)
    headers = {
        "Content-Type": blob.content_type, "Content-Length": str(blob.size),
        P.SNAPSHOT_OFFSET: blob.offset, P.NEXT_OFFSET: blob.offset,
        P.UP_TO_DATE: "true" if blob.meta.tail_offset == blob.offset else "false",
        "Cache-Control": "no-store",  # superseded and collected at any time after a new publish
    }
    resp = web.StreamResponse(status=200, headers=headers)
    await resp.prepare(request)
    request[PREPARED] = True
    if request.method == "GET":
        async for piece in blob.body:
            await resp.write(piece)
    await resp.write_eof()
    return resp


async def bootstrap(request: web.Request, svc: IngesterService, path: str) -> web.StreamResponse:
    meta = await svc.head(path)
    boundary = extensions.new_boundary()
    blob = None
    if meta.snapshot_offset is not None:
        _size, blob = await svc.snapshots.blob(meta)
    headers = {
        "Content-Type": extensions.content_type(boundary),
        P.SNAPSHOT_OFFSET: meta.snapshot_offset or "-1", P.NEXT_OFFSET: meta.tail_offset,
        P.UP_TO_DATE: "true", "Cache-Control": "no-store",
    }
    if meta.closed:
        headers[P.CLOSED] = "true"
    resp = web.StreamResponse(status=200, headers=headers)
    await resp.prepare(request)
    request[PREPARED] = True
    if request.method == "HEAD":
        return resp
    first_type = meta.snapshot_type if blob is not None else extensions.EMPTY_SNAPSHOT_TYPE
    await resp.write(extensions.first_part_head(boundary, first_type))
    if blob is not None:
        async for piece in blob:
            await resp.write(piece)
    json_mode = P.is_json(meta.content_type)
    async for part in svc.snapshots.parts(path, meta.earliest, meta.tail, boundary, json_mode):
        await resp.write(part)
    await resp.write(extensions.closing(boundary))
    await resp.write_eof()
    return resp


async def parts(request: web.Request) -> web.StreamResponse:
    """For a reader's bootstrap: the parts of the messages in [from, until) of `path`, with
    the reader's boundary, for it to pass on unchanged after the parts it served itself."""
    svc = request.app[SERVICE]
    q = request.query
    path, start_text, until_text, boundary = q.get("path"), q.get("from"), q.get("until"), q.get("boundary", "")
    if path is None or start_text is None or until_text is None:
        raise BadRequest("parts: path, from and until are required")
    if svc.membership is not None:
        await svc.owned(path)
    if not extensions.valid_boundary(boundary):
        raise BadRequest("parts: invalid boundary")
    start = parse_position(start_text, "from offset").position
    until = parse_position(until_text, "until offset").position
    meta = await svc.head(path)
    if meta.snapshot_offset is not None and start < meta.earliest:
        raise Retained(meta.snapshot_offset)
    if not start <= until <= meta.tail:
        raise Conflict("parts: the range is not within the stream")
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/octet-stream", "Cache-Control": "no-store"})
    await resp.prepare(request)
    request[PREPARED] = True
    async for part in svc.snapshots.parts(path, start, until, boundary, P.is_json(meta.content_type)):
        await resp.write(part)
    await resp.write_eof()
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_get("/_ds3/parts", parts)
