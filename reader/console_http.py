"""The console: a small web page at /console (static files in reader/console/, shipped as
package data) that lists buckets and streams, shows a stream's metadata, tails it over SSE and
shows a few metrics. It uses only the public protocol, plus the listings below.

    GET /console                      302 to /console/
    GET /console/                     the page (index.html)
    GET /console/{console.js,...}     its script and style sheet (nothing else is served)
    GET /ds3/streams, /ds3/buckets    the listings (ingester/listing.py), forwarded with the
                                      caller's Authorization: the ingester shows private names
                                      only to a token that may read them
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlencode

import orjson
from aiohttp import web

from reader.proxy import Headers, IngesterClient, Upstream, to_response
from reader.routing import Link
from reader.state import READER
from shared.errors import BadRequest, Unavailable
from shared.http.handlers import one_param, preflight, strict_query

STATIC_DIR: Final = Path(__file__).resolve().parent / "console"
FILES: Final = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
# The page loads only its own script and style and talks only to its own origin.
CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
LISTINGS: Final = ("/ds3/streams", "/ds3/buckets")
DEFAULT_LIMIT: Final = 1000  # as ingester/bucket_http.py
MAX_LIMIT: Final = 1000


async def redirect(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(request.path + "/")


async def static(request: web.Request) -> web.StreamResponse:
    name = request.match_info.get("name") or "index.html"
    content_type = FILES.get(name)
    if content_type is None:
        raise web.HTTPNotFound(text="no such console file\n")
    try:
        body = (STATIC_DIR / name).read_bytes()
    except OSError:  # an install without the package data
        raise web.HTTPNotFound(text="the console's files are not installed\n") from None
    headers = {
        "Content-Type": content_type,
        "Cache-Control": "no-cache",
        "Content-Security-Policy": CSP,
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }
    return web.Response(body=body, headers=headers)


async def listing(request: web.Request) -> web.StreamResponse:
    if request.method == "OPTIONS":
        return preflight()
    if request.method not in ("GET", "HEAD"):
        return web.Response(status=405, text=f"method {request.method} is not allowed on a listing\n",
                            headers={"Allow": "GET, HEAD, OPTIONS"})
    st = request.app[READER]
    st.forwarded += 1
    links = st.router.all_links()
    if not links:
        raise Unavailable("no cluster description read yet", 2)
    headers = IngesterClient._request_headers(request)
    if len(links) == 1:
        # the raw target: the ingester decodes the query strictly (invalid UTF-8 is 400)
        up = await links[0].client.call(request.method, request.raw_path, headers, None)
        return to_response(up)
    return await merged_listing(request, links, headers)


# --- a listing over several ingesters -----------------------------------------------------

COMPOSITE_MARK: Final = "~~"  # a merged cursor (an ingester's own sealed cursors start with one "~")






def encode_cursor(positions: dict[str, str | None]) -> str:
    raw = json.dumps(positions, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    return COMPOSITE_MARK + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(after: str) -> dict[str, str | None] | None:
    if not after.startswith(COMPOSITE_MARK) or not after.isascii():
        return None
    token = after[len(COMPOSITE_MARK):]
    try:
        found = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (binascii.Error, ValueError):
        return None
    if not isinstance(found, dict) or not all(isinstance(v, str | None) for v in found.values()):
        return None
    return found


def _sort_key(name: str) -> bytes:
    return name.encode("utf-8", "surrogatepass")


async def merged_listing(request: web.Request, links: list[Link], headers: Headers) -> web.Response:
    """/ds3/streams or /ds3/buckets over every ingester: each is asked for a page from the same
    place, the pages are merged in key order (UTF-8 bytes, as each ingester sorts) and cut where
    the first ingester that has more stopped, so no later page can hold a name that sorts before
    this page's last. `next_cursor` is the last name shown, as from one ingester; when an
    ingester's page ended on names the caller may not see (its cursor is sealed), the cursor is
    a merged one (`~~` + base64url of {ingester id: where it goes on}) that only readers read."""
    query = strict_query(request)
    prefix, after, limit_text = one_param(query, "prefix"), one_param(query, "after"), one_param(query, "limit")
    limit = DEFAULT_LIMIT
    if limit_text is not None:
        if not limit_text.isascii() or not limit_text.isdigit() or len(limit_text) > 6 \
                or not 1 <= int(limit_text) <= MAX_LIMIT:
            raise BadRequest(f"invalid limit {limit_text[:40]!r}: must be an integer from 1 to {MAX_LIMIT}")
        limit = int(limit_text)
    positions = decode_cursor(after) if after is not None else None
    streams = request.path == "/ds3/streams"
    name_field, list_field, count_field = (("path", "streams", "stream_count") if streams
                                           else ("bucket_id", "buckets", "bucket_count"))

    async def page(link: Link) -> tuple[Link, str | None, Any] | None:
        start = after
        if positions is not None:
            key = link.ingester_id or link.url
            if key in positions and positions[key] is None:
                return None  # this ingester has nothing more
            start = positions.get(key)
        q: dict[str, str] = {"limit": str(limit)}
        if prefix is not None:
            q["prefix"] = prefix
        if start:  # "" in a merged cursor: from the beginning
            q["after"] = start
        up = await link.client.call("GET", request.path + "?" + urlencode(q), headers, None)
        if up.status != 200:
            raise _Refused(up)
        return link, start, orjson.loads(up.body)

    try:
        pages = [p for p in await asyncio.gather(*(page(link) for link in links)) if p is not None]
    except _Refused as e:
        return to_response(e.up)
    # where the merged page must stop: the smallest name up to which an ingester that has more
    # is known to have listed everything (its plain cursor; the last name it showed, or where
    # it started, when its cursor is sealed)
    bound: bytes | None = None
    sealed = False
    for _link, start, body in pages:
        if not body.get("has_more"):
            continue
        cursor = body.get("next_cursor") or ""
        if cursor.startswith("~"):
            sealed = True
            shown = body.get(list_field) or []
            reached = shown[-1][name_field] if shown else (start or "")
        else:
            reached = cursor
        b = _sort_key(reached)
        bound = b if bound is None or b < bound else bound
    every: list[tuple[bytes, int, dict[str, Any]]] = []
    for n, (_link, _start, body) in enumerate(pages):
        every += ((_sort_key(e[name_field]), n, e) for e in body.get(list_field) or [])
    every.sort(key=lambda e: e[0])
    entries = [e for e in every if bound is None or e[0] <= bound]
    more = bound is not None or len(entries) > limit
    shown = entries[:limit]
    cut = shown[-1][0] if len(entries) > limit else bound  # nothing past it is shown
    next_cursor: str | None = None
    if more and not sealed and positions is None and shown:
        next_cursor = shown[-1][2][name_field]
    elif more:
        where: dict[str, str | None] = dict(positions or {})
        for n, (link, start, body) in enumerate(pages):
            shown_here = [e[2][name_field] for e in shown if e[1] == n]
            if cut is not None and any(e[0] > cut for e in every if e[1] == n):
                # it has names past the cut: go on after the last one shown, or from where this
                # page started ("" for the beginning: None would say it has nothing more)
                where[link.ingester_id or link.url] = shown_here[-1] if shown_here else (start or "")
            else:
                where[link.ingester_id or link.url] = body.get("next_cursor") if body.get("has_more") else None
        next_cursor = encode_cursor(where)
    out = {"prefix": prefix, count_field: len(shown), list_field: [e[2] for e in shown],
           "next_cursor": next_cursor, "has_more": more}
    return web.Response(body=orjson.dumps(out), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


class _Refused(Exception):
    def __init__(self, up: Upstream) -> None:
        super().__init__(up.status)
        self.up = up


def add_routes(app: web.Application) -> None:
    app.router.add_get("/console", redirect)
    app.router.add_get("/console/", static)
    app.router.add_get("/console/{name}", static)
    for path in LISTINGS:
        app.router.add_route("*", path, listing)
