"""The outermost middleware of both apps: a request id for every request, request metrics by
route and status, and the access log (logger `ds3.access`, one line per request).

Request ids: an incoming X-Request-Id is kept when it is sane (shared.logs), else one is
made; it is returned on the response, set for the request's logs, and forwarded by the
reader on every upstream request (reader.proxy), so a request that crossed both processes
has the same id in both logs.

The access log names the method, raw path (escaped, cut to 512 characters), route, status,
duration, bytes sent, request id, client and token subject. Never a header: tokens travel
in Authorization, which no log line includes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from yarl import URL

from shared import logs
from shared.http import health
from shared.http.auth import caller_of
from shared.http.limits import LIMITS
from shared.http.metrics import METRICS, AppMetrics, metrics_handler, route_of
from shared.limits import client_address

access_log = logging.getLogger("ds3.access")
REQUEST_ID: Final = web.RequestKey("ds3_request_id", str)
CLIENT_CLOSED: Final = 499  # nginx's status for "the client went away first"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def origin_form(target: str) -> str | None:
    """The origin form (`/path?query`) of a request target in absolute form
    (`http://host:port/path?query`), which RFC 9112 §3.2.2 says a server must accept; None if
    `target` is not one."""
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return None
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    tail = rest[cut:]
    return tail if tail.startswith("/") else "/" + tail


@web.middleware
async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not request.raw_path.startswith("/") and (origin := origin_form(request.raw_path)) is not None:
        # every handler and check reads raw_path (auth's scopes too): give them the origin
        # form (aiohttp routed it by that already)
        request = request.clone(rel_url=URL(origin, encoded=True))
    http = request.app[METRICS].http
    started = time.perf_counter()
    rid = logs.accept_request_id(request.headers.get(logs.REQUEST_ID_HEADER))
    request[REQUEST_ID] = rid
    token = logs.set_request_id(rid)
    raw_path = request.raw_path.split("?", 1)[0]
    live = request.query.get("live") if request.method == "GET" else None
    live = live if live in http.live else None
    route = route_of(request.method, raw_path, live)
    http.in_flight += 1
    if live is not None:
        http.live[live] += 1
    status = 500
    response: web.StreamResponse | None = None
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = CLIENT_CLOSED
        raise
    finally:
        http.in_flight -= 1
        if live is not None:
            http.live[live] -= 1
        seconds = time.perf_counter() - started
        http.observe(route, status, seconds)
        if access_log.isEnabledFor(logging.INFO) and not _sibling_scrape(request, raw_path):
            _log_access(request, response, route, status, seconds)
        logs.reset_request_id(token)


def _sibling_scrape(request: web.Request, raw_path: str) -> bool:
    """A reader worker's /metrics asked by a sibling over its private unix socket (each scrape
    of an N-worker reader's port made N access log lines: found by QA)."""
    if raw_path != "/metrics" or request.transport is None:
        return False
    return isinstance(request.transport.get_extra_info("sockname"), str)


def _log_access(request: web.Request, response: web.StreamResponse | None, route: str, status: int,
                seconds: float) -> None:
    # Body bytes (a streamed response without Content-Length: see below).
    if response is not None and response.content_length is not None:
        sent = response.content_length
    else:  # streamed (SSE), finished or left midway by its client: what went to the connection,
        # headers included (the response's body_length is only set at its end: a client that
        # left logged 0B, found by QA)
        sent = getattr(request.writer, "output_size", 0)
    lim = request.app.get(LIMITS)
    forwarded = request.headers.get("X-Forwarded-For")
    client = request.remote or "unknown"
    if lim is not None and forwarded is not None:
        client = client_address(request.remote, forwarded, lim.proxies) or client
    caller = caller_of(request)
    log_access(request.get(REQUEST_ID), request.method, request.raw_path, route, status, seconds, sent, client,
               caller.subject if caller is not None else None)


def log_access(rid: str | None, method: str, raw_path: str, route: str, status: int, seconds: float, sent: int,
               client: str, subject: str | None = None) -> None:
    """One access log line (aiohttp's requests above, the fast lanes' in shared/http/lane_connection.py)."""
    path = logs.printable(raw_path)
    duration_ms = round(seconds * 1000, 3)
    fields = {  # request_id too, so a handler that formats later (off the request's context) has it
        "request_id": rid, "method": method, "path": path, "route": route, "status": status, "duration_ms": duration_ms,
        "bytes": sent, "client": logs.printable(client, 64),
    }
    if subject is not None:
        fields["sub"] = logs.printable(subject, 128)
    if not logs.access_line(f"{method} {path} {status} {duration_ms:.1f}ms {sent}B", fields):
        access_log.info("%s %s %d %.1fms %dB", method, path, status, duration_ms, sent, extra={"fields": fields})


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers[logs.REQUEST_ID_HEADER] = rid


def install(app: web.Application, metrics_route: Handler | None = None) -> AppMetrics:
    """Add request ids, request metrics, the access log and the /healthz, /readyz and
    /metrics routes to `app`. The middleware goes first (outermost), so it sees the status of
    every answer, refusals of the other middlewares included. Readiness checks are added to
    app[health.READINESS]; metric collectors to the returned AppMetrics."""
    metrics = AppMetrics()
    app[METRICS] = metrics
    app[health.READINESS] = health.Readiness()
    app.middlewares.insert(0, access_middleware)
    app.on_response_prepare.append(_request_id_header)
    app.router.add_get("/healthz", health.healthz)
    app.router.add_get("/readyz", health.readyz)
    app.router.add_get("/metrics", metrics_route or metrics_handler)  # a reader's workers gather theirs
    return metrics
