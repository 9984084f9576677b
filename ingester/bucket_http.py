"""HTTP surface of buckets on the ingester (extensions §1), beside /v1/stream/{path}:

    PUT    /v1/buckets/{bucket_id}            201 created; 409 exists; 400 invalid id
    GET    /v1/buckets/{bucket_id}            200 {"bucket_id", "streams", ...}; 404
    DELETE /v1/buckets/{bucket_id}            204; 409 not empty; 404
    GET    /v1/buckets/{bucket_id}/streams    the listing (?prefix=&after=&limit=)
    *      /v1/buckets/{bucket_id}/{stream}   every stream operation (ingester.http), and the
           .../{stream}/snapshot[/{offset}], .../{stream}/bootstrap endpoints (extension_http)
"""

from __future__ import annotations

import time
from typing import Any

import lmdb
import orjson
from aiohttp import web

from ingester import buckets
from ingester.http import handle_stream
from ingester.service import SERVICE, IngesterService
from shared import buckets as B
from shared import extensions
from shared.errors import BadRequest, NotFound
from shared.http.handlers import (
    BUCKET_METHODS,
    method_not_allowed,
    no_bucket_id,
    one_param,
    preflight,
    strict_query,
)
from shared.placement import bucket_placement_key

DEFAULT_LIMIT = 1000
MAX_LIMIT = 1000


def json_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json",
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


async def handle(request: web.Request) -> web.StreamResponse:
    svc = request.app[SERVICE]
    if request.method == "OPTIONS":
        return preflight()
    raw, _endpoint = extensions.split(request.raw_path.split("?", 1)[0])  # {stream}/snapshot...
    bucket_id, stream_id = B.parse_url(raw)
    if svc.membership is not None:  # a bucket and all its streams live on one ingester
        await svc.owned_key(bucket_placement_key(bucket_id))
    if stream_id is None:
        return await handle_bucket(request, svc, bucket_id)
    if stream_id == B.RESERVED_STREAM_ID and request.method in ("GET", "HEAD"):
        return await handle_listing(request, svc, bucket_id)
    try:
        return await handle_stream(request)
    except NotFound as e:
        raise await naming_missing_bucket(svc, bucket_id, e) from None


async def naming_missing_bucket(svc: IngesterService, bucket_id: str, error: NotFound) -> NotFound:
    """A bucketed stream's NotFound, or the bucket's when the bucket itself is missing."""
    if await bucket_stored(svc, bucket_id) is None:
        return NotFound(f"bucket {bucket_id!r} not found")
    return error


async def bucket_stored(svc: IngesterService, bucket_id: str) -> buckets.BucketMeta | None:
    return await svc.read_stored(lambda txn: buckets.get(txn, svc.wal, bucket_id))


async def handle_bucket(request: web.Request, svc: IngesterService, bucket_id: str) -> web.Response:
    method = request.method
    if method == "PUT":

        def create(txn: lmdb.Transaction) -> buckets.BucketMeta:
            if svc.store.guard is not None:  # still ours, on the writer (a move may have taken it)
                svc.store.guard(B.bucket_key_prefix(bucket_id), None)
            return svc.store.buckets.create(txn, bucket_id, time.time())

        meta = await svc.committer.submit(create)
        return json_response(201, meta.describe(bucket_id), {"Location": str(request.url.with_query(None))})
    if method in ("GET", "HEAD"):
        found = await bucket_stored(svc, bucket_id)
        if found is None:
            raise NotFound(f"bucket {bucket_id!r} not found")
        return json_response(200, found.describe(bucket_id))
    if method == "DELETE":

        def delete(txn: lmdb.Transaction) -> None:
            if svc.store.guard is not None:
                svc.store.guard(B.bucket_key_prefix(bucket_id), None)
            svc.store.buckets.delete(txn, bucket_id, lambda path: svc.store.expire_due(txn, path))

        await svc.committer.submit(delete)
        return web.Response(status=204)
    return method_not_allowed(method, "a bucket", BUCKET_METHODS)


def parse_limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIMIT
    if not text.isascii() or not text.isdigit() or len(text) > 6 or not 1 <= int(text) <= MAX_LIMIT:
        raise BadRequest(f"invalid limit {text[:40]!r}: must be an integer from 1 to {MAX_LIMIT}")
    return int(text)


async def handle_listing(request: web.Request, svc: IngesterService, bucket_id: str) -> web.Response:
    query = strict_query(request)
    prefix, after = one_param(query, "prefix"), one_param(query, "after")
    limit = parse_limit(one_param(query, "limit"))

    def page(txn: lmdb.Transaction) -> dict[str, Any]:
        return buckets.list_streams(
            txn, svc.wal, bucket_id, prefix=prefix, after=after, limit=limit, now=time.time(),
            touches=svc.store.touches, last_writes=svc.store.last_writes,
        )

    return json_response(200, await svc.read_stored(page))


def add_routes(app: web.Application) -> None:
    app.router.add_route("*", "/v1/buckets", no_bucket_id)
    app.router.add_route("*", r"/v1/buckets/{rest:[\s\S]*}", handle)
