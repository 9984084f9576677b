"""Buckets on the reader (extensions §1): bucket create, metadata, delete and the listing are
forwarded to the ingester; stream operations under /v1/buckets/{bucket_id}/{stream_id} are
served like plain ones (reader.http), sealed reads from the object store included: a
bucketed stream is an ordinary stream under its internal path (shared/buckets.py)."""

from __future__ import annotations

from aiohttp import web

from reader.http import handle_stream
from reader.proxy import IngesterClient, to_response
from reader.state import READER
from shared import buckets as B
from shared import extensions
from shared.http.handlers import BUCKET_METHODS, method_not_allowed, no_bucket_id, preflight, read_body
from shared.placement import bucket_placement_key


async def handle(request: web.Request) -> web.StreamResponse:
    st = request.app[READER]
    method = request.method
    if method == "OPTIONS":
        return preflight()
    raw, _endpoint = extensions.split(request.raw_path.split("?", 1)[0])  # {stream}/snapshot...
    bucket_id, stream_id = B.parse_url(raw)  # 400 when invalid
    listing = stream_id == B.RESERVED_STREAM_ID and method in ("GET", "HEAD")
    if stream_id is not None and not listing:
        return await handle_stream(request)
    if method not in ("PUT", "GET", "HEAD", "DELETE"):
        return method_not_allowed(method, "a bucket", BUCKET_METHODS)
    body = await read_body(request, st.config.max_body_bytes) if method == "PUT" else None
    st.forwarded += 1
    up = await st.router.call(bucket_placement_key(bucket_id), method, request.path_qs, IngesterClient._request_headers(request), body)
    if "Location" in up.headers:
        up.headers["Location"] = str(request.url.with_query(None))
    return to_response(up)


def add_routes(app: web.Application) -> None:
    app.router.add_route("*", "/v1/buckets", no_bucket_id)
    app.router.add_route("*", r"/v1/buckets/{rest:[\s\S]*}", handle)
