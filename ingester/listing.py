"""ds3's own listings (not part of the Durable Streams protocol, so outside /v1/), for the
console (reader/console.py) and for operators:

    GET /ds3/streams?prefix=&after=&limit=   plain streams (/v1/stream/{path}), in path order
    GET /ds3/buckets?prefix=&after=&limit=   buckets, in id order

Paged and bounded like the bucket listing (ingester/buckets.py): one read transaction on the
read pool, a range scan of `streams` (or `buckets`) from max(prefix, after) that stops at the
first key without the prefix, decodes at most `limit` + 1 entries it shows, and passes over at
most MAX_SKIPPED it does not show (streams whose TTL ran out; streams and buckets the caller may
not read: private ones, when auth is on). When that budget runs out, the page ends early with
`has_more` true and `next_cursor` the last key it looked at, so a page can hold fewer than
`limit` entries (even none) and the caller goes on from the cursor. `limit` is 1..1000
(default 1000); invalid UTF-8 in the query, a repeated parameter or a bad limit is 400.

Bucketed streams are keyed `\\x00b/...` and plain paths never start with a control character
(protocol.validate_stream_path), so the plain-stream scan starts at b"\\x01" at the lowest and
never walks over bucketed keys.

Visibility follows the read rules (shared/auth.py): a stream or bucket that is private (a
--private grant covers it) is listed only for a caller whose token may read it. Readers
forward the caller's Authorization header; a bad token is 401 as on every other route."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import quote

import lmdb
from aiohttp import web

from ingester import buckets
from ingester.bucket_http import _one, _query, json_response, parse_limit
from ingester.records import StreamMeta
from ingester.service import SERVICE, IngesterService
from ingester.wal import WalEnv
from shared import protocol as P
from shared.auth import Principal, Target
from shared.authmw import AUTH
from shared.web import preflight

STREAMS_PATH: Final = "/ds3/streams"
BUCKETS_PATH: Final = "/ds3/buckets"
MAX_SKIPPED: Final = 10_000  # entries a page may pass over without showing them
PLAIN_LOW: Final = b"\x01"  # bucketed streams' keys start with NUL (sorting first); plain paths never do

Visible = Callable[[Target], bool]


async def visibility(request: web.Request) -> Visible:
    """Whether the caller may see a target's name: public reads, or a token that may read it.
    With auth on, a token that is sent is checked (Unauthorized for a bad one); with auth off
    every name is shown and tokens are ignored, as on every other route."""
    authn = request.app[AUTH]
    if not authn.enabled:
        return lambda _t: True
    header = request.headers.get("Authorization")
    caller: Principal | None = await authn.authenticate(header) if header is not None else None
    policy = authn.policy

    def visible(t: Target) -> bool:
        return not policy.is_private(t) or (caller is not None and caller.may("read", t))

    return visible


def _page_bounds(prefix: str | None, after: str | None, low_floor: bytes) -> tuple[bytes, bytes, bytes | None]:
    """(the prefix as bytes, where the scan starts, the key to skip up to (inclusive) or None)."""
    low = (prefix or "").encode("utf-8", "surrogatepass")
    start, skip = max(low, low_floor), None
    if after is not None:
        a = after.encode("utf-8", "surrogatepass")
        if a >= start:
            start = skip = a
    return low, start, skip


def list_plain_streams(
    txn: lmdb.Transaction, wal: WalEnv, *, prefix: str | None, after: str | None, limit: int, now: float,
    touches: dict[str, float], last_writes: dict[str, float], visible: Visible,
) -> dict[str, Any]:
    def describe(key: bytes, raw: Any) -> dict[str, Any] | None:
        path = key.decode("utf-8", "replace")
        if not visible(Target(None, path)):
            return None
        meta = StreamMeta.decode(raw)
        if not meta.soft_deleted and meta.expired(now, touches.get(meta.path)):
            if meta.refcount == 0:
                return None  # gone: reads answer 404, and the writer removes it shortly
            meta.soft_deleted = True  # expired, but forks read it
        entry = buckets.stream_entry(txn, wal, meta, path, now, last_writes)
        del entry["stream_id"]
        return {"path": path, "url": P.STREAM_PREFIX + quote(path, safe="/"), **entry}

    streams, cursor = _page(txn.cursor(wal.streams), _page_bounds(prefix, after, PLAIN_LOW), limit, describe)
    return {"prefix": prefix, "stream_count": len(streams), "streams": streams,
            "next_cursor": cursor, "has_more": cursor is not None}


def list_buckets(
    txn: lmdb.Transaction, wal: WalEnv, *, prefix: str | None, after: str | None, limit: int, visible: Visible,
) -> dict[str, Any]:
    def describe(key: bytes, raw: Any) -> dict[str, Any] | None:
        bucket_id = key.decode("utf-8", "replace")
        return buckets.BucketMeta.decode(raw).describe(bucket_id) if visible(Target(bucket_id, None)) else None

    found, cursor = _page(txn.cursor(wal.buckets), _page_bounds(prefix, after, b""), limit, describe)
    return _buckets_page(prefix, found, cursor is not None, cursor)


def _page(
    cur: lmdb.Cursor, bounds: tuple[bytes, bytes, bytes | None], limit: int,
    describe: Callable[[bytes, Any], dict[str, Any] | None],
) -> tuple[list[dict[str, Any]], str | None]:
    """One page of a listing: the entries `describe` shows (None: hidden), at most `limit`,
    passing over at most MAX_SKIPPED hidden ones; and the cursor to go on from, or None."""
    found: list[dict[str, Any]] = []
    skipped, last_key = 0, None
    for key, raw in buckets.scan_range(cur, *bounds):
        if len(found) == limit or skipped >= MAX_SKIPPED:
            return found, _decode(last_key)
        last_key = key
        entry = describe(key, raw)
        if entry is None:
            skipped += 1
        else:
            found.append(entry)
    return found, None


def _buckets_page(prefix: str | None, found: list[dict[str, Any]], has_more: bool, cursor: str | None) -> dict[str, Any]:
    return {"prefix": prefix, "bucket_count": len(found), "buckets": found, "next_cursor": cursor,
            "has_more": has_more}


def _decode(key: bytes | None) -> str | None:
    return None if key is None else key.decode("utf-8", "replace")


def not_allowed(method: str) -> web.Response:
    return web.Response(status=405, text=f"method {method} is not allowed on a listing\n",
                        headers={"Allow": "GET, HEAD, OPTIONS"})


async def handle(request: web.Request) -> web.StreamResponse:
    if request.method == "OPTIONS":
        return preflight()
    if request.method not in ("GET", "HEAD"):
        return not_allowed(request.method)
    svc: IngesterService = request.app[SERVICE]
    query = _query(request)
    prefix, after = _one(query, "prefix"), _one(query, "after")
    limit = parse_limit(_one(query, "limit"))
    visible = await visibility(request)
    wal = svc.wal
    listing_streams = request.path == STREAMS_PATH

    def page() -> dict[str, Any]:
        with wal.env.begin(buffers=False) as txn:
            if listing_streams:
                return list_plain_streams(
                    txn, wal, prefix=prefix, after=after, limit=limit, now=time.time(),
                    touches=svc.store.touches, last_writes=svc.store.last_writes, visible=visible,
                )
            return list_buckets(txn, wal, prefix=prefix, after=after, limit=limit, visible=visible)

    return json_response(200, await svc.reads.run(page))


def add_routes(app: web.Application) -> None:
    for path in (STREAMS_PATH, BUCKETS_PATH):
        app.router.add_route("*", path, handle)
