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

from pathlib import Path
from typing import Final

from aiohttp import web

from reader.proxy import IngesterClient, to_response
from reader.state import READER
from shared.http.handlers import preflight

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
    # the raw target: the ingester decodes the query strictly (invalid UTF-8 is 400)
    up = await st.ingester.call(request.method, request.raw_path, IngesterClient._request_headers(request), None)
    return to_response(up)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/console", redirect)
    app.router.add_get("/console/", static)
    app.router.add_get("/console/{name}", static)
    for path in LISTINGS:
        app.router.add_route("*", path, listing)
