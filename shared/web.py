"""aiohttp pieces both services use: the one mapping of domain errors to HTTP responses,
the headers every response carries, CORS preflight, stream paths, bodies, offsets."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import unquote

from aiohttp import web

from shared import buckets, offsets
from shared import protocol as P
from shared.errors import (
    BadRequest,
    DS3Error,
    Gone,
    NotFound,
    ObjectStoreError,
    PayloadTooLarge,
    ProducerSeqGap,
    StaleProducerEpoch,
    StreamClosed,
    Unavailable,
)

log = logging.getLogger("ds3.http")
IMMUTABLE: Final = "public, max-age=31536000, immutable"


def error_response(e: DS3Error) -> web.Response:
    """The one place a domain error becomes an HTTP status."""
    headers: dict[str, str] = {}
    if isinstance(e, BadRequest):
        status = 400
    elif isinstance(e, NotFound):
        status = 404
    elif isinstance(e, Gone):
        status = 410
    elif isinstance(e, StaleProducerEpoch):
        status = 403
        headers[P.PRODUCER_EPOCH] = str(e.current_epoch)
    elif isinstance(e, StreamClosed):
        status = 409
        headers[P.CLOSED] = "true"
        headers[P.NEXT_OFFSET] = e.final_offset
    elif isinstance(e, ProducerSeqGap):
        status = 409
        headers[P.PRODUCER_EXPECTED_SEQ] = str(e.expected)
        headers[P.PRODUCER_RECEIVED_SEQ] = str(e.received)
    elif isinstance(e, PayloadTooLarge):
        status = 413
    elif isinstance(e, Unavailable):
        status = 503
        headers["Retry-After"] = str(e.retry_after)
    elif isinstance(e, ObjectStoreError):
        status = 502
    else:  # Conflict, and anything else a write can refuse
        status = 409
    return web.Response(status=status, text=e.message + "\n", headers=headers, content_type="text/plain")


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except DS3Error as e:
        if isinstance(e, Unavailable | ObjectStoreError):
            log.warning("%s %s: %s", request.method, request.path, e.message)
        return error_response(e)
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return web.Response(status=500, text="internal server error; nothing was changed\n")


async def common_headers(request: web.Request, response: web.StreamResponse) -> None:
    h = response.headers
    h["X-Content-Type-Options"] = "nosniff"
    h["Cross-Origin-Resource-Policy"] = "cross-origin"
    h["Access-Control-Allow-Origin"] = "*"
    h["Access-Control-Expose-Headers"] = P.CORS_EXPOSE_HEADERS


def preflight() -> web.Response:
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Methods": P.CORS_ALLOW_METHODS,
            "Access-Control-Allow-Headers": P.CORS_ALLOW_HEADERS,
            "Access-Control-Max-Age": "86400",
        },
    )


def method_not_allowed(method: str) -> web.Response:
    return web.Response(
        status=405, text=f"method {method} is not allowed on a stream\n", headers={"Allow": P.CORS_ALLOW_METHODS}
    )


def stream_path(request: web.Request, max_bytes: int) -> str:
    """The stream path from the raw URL (not normalized: '..' is rejected, not resolved)."""
    raw = request.raw_path.split("?", 1)[0]
    if raw.startswith(buckets.BUCKETS_PREFIX):  # a bucketed stream: its internal path
        return buckets.stream_path_from_url(raw)
    if not raw.startswith(P.STREAM_PREFIX):
        raise NotFound("not a stream URL")
    try:
        path = unquote(raw[len(P.STREAM_PREFIX) :], errors="strict")
    except UnicodeDecodeError as e:
        raise BadRequest("stream path is not valid UTF-8") from e
    return P.validate_stream_path(path, max_bytes)


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    buf = bytearray()
    async for chunk in request.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    return bytes(buf)


def start_offset(request: web.Request) -> offsets.Offset | str | None:
    """The `offset` query parameter: None when absent, else START, NOW or an Offset."""
    values = request.query.getall("offset", [])
    if len(values) > 1:
        raise BadRequest("send one offset parameter, not several")
    if not values:
        return None
    if values[0] == "":
        raise BadRequest("offset parameter is empty")
    try:
        return offsets.parse_query(values[0])
    except offsets.OffsetSyntaxError as e:
        raise BadRequest(str(e)) from e


def live_mode(request: web.Request, given: offsets.Offset | str | None) -> str | None:
    live = request.query.get("live")
    if live not in (None, "long-poll", "sse"):
        raise BadRequest(f"unknown live mode {live[:40]!r}: use long-poll or sse")
    if live is not None and given is None:
        raise BadRequest(f"live={live} requires an offset parameter")
    return live
