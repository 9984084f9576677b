"""aiohttp pieces both services use: the one mapping of domain errors to HTTP responses,
the headers every response carries, CORS preflight, stream paths, bodies, offsets."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Final
from urllib.parse import parse_qsl

import orjson
from aiohttp import web

from shared import buckets, logs, offsets
from shared import protocol as P
from shared.errors import (
    BadRequest,
    DS3Error,
    Forbidden,
    Gone,
    Misdirected,
    NotFound,
    ObjectStoreError,
    PayloadTooLarge,
    ProducerSeqGap,
    RequestTimeout,
    Retained,
    StaleProducerEpoch,
    StreamClosed,
    Superseded,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    UnreadableBody,
    UnsupportedMediaType,
)
from shared.http import codings
from shared.ownership import FENCED_HEADER
from shared.placement import GENERATION_HEADER, OWNER_HEADER, OWNER_ID_HEADER

log = logging.getLogger("ds3.http")
# 503s of one cause, logged once per 10 s: a standby, a fenced ingester or a reader whose
# ingester is down answers every request with one
_unavailable: Final = logs.RepeatedWarnings(log)
IMMUTABLE: Final = "public, max-age=31536000, immutable"
# Set once a handler has sent its status line: an error after that can only cut the body.
PREPARED: Final = web.RequestKey("ds3_prepared", bool)
BODY_TIMEOUT: Final = web.AppKey("ds3_body_timeout", float)  # seconds a request body may take (read_body)
REALM: Final = 'Bearer realm="ds3"'


def error_response(e: DS3Error) -> web.Response:
    """The one place a domain error becomes an HTTP status. Never stored by a shared cache:
    a refusal is the state of a moment (a 404 until the stream is created, a 410 of a deleted
    path that can be used again), and without Cache-Control a CDN may keep one heuristically
    (found by QA)."""
    headers: dict[str, str] = {"Cache-Control": "no-store"}
    if isinstance(e, Retained):
        body = {"error": e.message, "earliest_offset": e.earliest_offset, "snapshot_offset": e.earliest_offset}
        headers[P.SNAPSHOT_OFFSET] = e.earliest_offset
        return web.Response(status=410, body=orjson.dumps(body), headers=headers, content_type="application/json")
    if isinstance(e, Unauthorized | Forbidden | TooManyRequests | RequestTimeout):
        return _access_error(e)
    if isinstance(e, Misdirected):  # another ingester owns the stream: a router follows DS3-Owner
        headers[OWNER_HEADER] = e.owner_url
        headers[OWNER_ID_HEADER] = e.owner_id
        headers[GENERATION_HEADER] = str(e.generation)
        return web.Response(status=421, text=e.message + "\n", headers=headers, content_type="text/plain")
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
    elif isinstance(e, UnsupportedMediaType):
        status = 415
        headers["Accept-Encoding"] = codings.ACCEPTED
    elif isinstance(e, Unavailable):
        status = 503
        headers["Retry-After"] = str(e.retry_after)
        if isinstance(e, Superseded):
            headers[FENCED_HEADER] = "true"
    elif isinstance(e, ObjectStoreError):
        status = 502
    else:  # Conflict, and anything else a write can refuse
        status = 409
    return web.Response(status=status, text=e.message + "\n", headers=headers, content_type="text/plain")


def _access_error(e: Unauthorized | Forbidden | TooManyRequests | RequestTimeout) -> web.Response:
    """401 / 403 (RFC 6750 WWW-Authenticate), 429 with Retry-After, 408. Never stored by a
    cache: the same URL answers differently with other credentials or a moment later."""
    headers = {"Cache-Control": "no-store"}
    if isinstance(e, Unauthorized):
        status = 401
        challenge = REALM
        if e.error is not None:  # credentials were sent but are unusable
            why = "".join(c for c in e.message if c.isprintable() and c not in '"\\')[:200]
            challenge += f', error="{e.error}", error_description="{why}"'
        headers["WWW-Authenticate"] = challenge
    elif isinstance(e, Forbidden):
        status = 403
        headers["WWW-Authenticate"] = REALM + ', error="insufficient_scope"'
    elif isinstance(e, TooManyRequests):
        status = 429
        headers["Retry-After"] = str(e.retry_after)
    else:
        status = 408
        headers["Connection"] = "close"
    return web.Response(status=status, text=e.message + "\n", headers=headers, content_type="text/plain")


async def _send_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Send `response`, then close the connection at once: aiohttp would otherwise keep
    reading (lingering) what is left of a body that is arriving too slowly."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


# RFC 9112 §3.2 / RFC 3986 §3.2.2: uri-host [":" port], the host an IP-literal, or a reg-name
# (IPv4 included) of unreserved, sub-delims and percent-encoded octets. Nothing else may reach
# a Location header (a space, '/', '@', a byte over 0x7f), nor a port yarl refuses (a 500).
_HOST: Final = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*)(?::([0-9]*))?")


def host_problem(values: Sequence[str], *, required: bool = True) -> str | None:
    """Why the request's Host header lines are not one valid Host (a 400, RFC 9112 §3.2), or
    None. `required`: HTTP/1.1 (an HTTP/1.0 request may leave it out)."""
    if len(values) > 1:
        return "send one Host header, not several"
    if not values:
        return "send a Host header" if required else None
    m = _HOST.fullmatch(values[0])
    if m is None or (m.group(1) and int(m.group(1)) > 65535):
        return f"the Host header is not a valid host[:port]: {values[0][:100]!r}"
    return None


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    if request.version.major != 1:  # (RFC 9110 §15.6.6: HTTP/2 and 3 are not spoken on this port in plain text)
        return web.Response(status=505, text=f"HTTP/{request.version.major}.{request.version.minor} is not "
                            "supported here: send HTTP/1.1 (or 1.0)\n", headers={"Connection": "close"})
    if (why := host_problem(request.headers.getall("Host", ()), required=request.version >= (1, 1))) is not None:
        return error_response(BadRequest(why))
    try:
        return await handler(request)
    except DS3Error as e:
        if isinstance(e, Unavailable | ObjectStoreError):
            _unavailable.warning(e.message[:120], "%s %s: %s", request.method, request.path, e.message)
        if request.get(PREPARED):
            raise  # the status line is out: aiohttp drops the connection, the client sees a cut body
        if isinstance(e, RequestTimeout | UnreadableBody):
            return await _send_and_close(request, error_response(e))
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
    # A stream's bytes (or a snapshot's) are whatever a writer sent, with the Content-Type it
    # chose: opened in a browser tab, text/html ran as a page of this origin, the console's
    # (whose token sits in sessionStorage; found by QA). Sandboxed, such a page runs no script
    # and has an origin of its own; fetch, XHR and EventSource clients are not affected. (The
    # console's pages send their own policy.)
    h.setdefault("Content-Security-Policy", P.UNTRUSTED_CONTENT_CSP)
    if response.status >= 400:  # (aiohttp's own 404s and 405s too: see error_response)
        h.setdefault("Cache-Control", "no-store")
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


BUCKET_METHODS = "GET, HEAD, PUT, DELETE, OPTIONS"


def method_not_allowed(method: str, what: str = "a stream", allow: str = P.CORS_ALLOW_METHODS) -> web.Response:
    return web.Response(status=405, text=f"method {method} is not allowed on {what}\n", headers={"Allow": allow})


def refuse_repeated_headers(request: web.Request) -> None:
    """400 for a protocol header sent more than once (P.SINGLE_VALUE_HEADERS): the fast lanes
    hand such requests here, so both paths answer alike."""
    for name in P.SINGLE_VALUE_HEADERS:
        if name in request.headers and len(request.headers.getall(name)) > 1:
            raise BadRequest(f"send one {name} header, not several")


def stream_path(request: web.Request, max_bytes: int) -> str:
    """The stream path from the raw URL (not normalized: '..' is rejected, not resolved)."""
    return stream_path_of(request.raw_path.split("?", 1)[0], max_bytes)


def stream_path_of(raw: str, max_bytes: int) -> str:
    """The stream path a raw URL path (no query) names."""
    if raw.startswith(buckets.BUCKETS_PREFIX):  # a bucketed stream: its internal path
        return buckets.stream_path_from_url(raw)
    if not raw.startswith(P.STREAM_PREFIX):
        raise NotFound("not a stream URL")
    return P.validate_stream_path(P.decode_stream_url(raw), max_bytes)


async def no_bucket_id(request: web.Request) -> web.Response:
    """/v1/buckets itself: not a resource; say where the buckets are."""
    raise NotFound(f"a bucket's URL is {buckets.BUCKETS_PREFIX}{{bucket_id}}; GET /ds3/buckets lists them")


def stream_location(request: web.Request, path: str) -> str:
    """The absolute URL of the stream at internal `path`, as a create's Location names it:
    spelled canonically (buckets.url_path), not as the request spelled it (a dot segment
    dropped by the URL parser would name another stream)."""
    return str(request.url.with_path(buckets.url_path(path), encoded=True).with_query(None))


async def read_snapshot_body(request: web.Request, limit: int) -> bytes:
    """A snapshot's body (read_body), whose 413 names the snapshot limit and its setting: it
    said "request body is larger than N bytes", which a user could not tell from the append
    limit (found by QA)."""
    try:
        return await read_body(request, limit)
    except PayloadTooLarge:
        raise PayloadTooLarge(f"a snapshot is at most {limit} bytes (--max-snapshot-bytes, "
                              "DS3_MAX_SNAPSHOT_BYTES)") from None


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, decoded from its Content-Encoding (shared.http.codings: 415 for a
    coding not decoded, 400 for a stream that does not decode whole); `limit` holds for the
    body as sent and as decoded (413)."""
    encoded = codings.parse(request.headers.getall("Content-Encoding", ()))
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    buf = bytearray()
    # A whole body must arrive within the body timeout: a client trickling it (slowloris)
    # would otherwise hold a connection and a handler for as long as it likes.
    timeout = request.app.get(BODY_TIMEOUT, 60.0)
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.content.iter_any():
                buf += chunk
                if len(buf) > limit:
                    raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout:g} s") from None
    except web.RequestPayloadError as e:  # e.g. a body cut short of its Content-Length
        raise UnreadableBody(f"the request body could not be read: {str(e).splitlines()[-1].strip()[:200]}") from None
    # (total_compressed_bytes is set when aiohttp decoded the body itself: a runner with its
    # auto_decompress on, not the services' LaneRunner, e.g. aiohttp's TestServer in tests)
    if encoded and request.content.total_compressed_bytes is None:
        return await codings.decode_async(bytes(buf), encoded, limit)
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
    values = request.query.getall("live", [])
    if len(values) > 1:  # (the first one won, as SSE or long-poll by their order: found by QA)
        raise BadRequest("send one live parameter, not several")
    live = values[0] if values else None
    if live not in (None, "long-poll", "sse"):
        raise BadRequest(f"unknown live mode {live[:40]!r}: use long-poll or sse")
    if live is not None and given is None:
        raise BadRequest(f"live={live} requires an offset parameter")
    return live


def strict_query(request: web.Request) -> dict[str, list[str]]:
    """The raw query string decoded strictly (aiohttp's decoding replaces invalid UTF-8)."""
    raw = request.raw_path.partition("?")[2]
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, errors="strict")
    except UnicodeDecodeError as e:
        raise BadRequest("query parameters are not valid UTF-8") from e
    out: dict[str, list[str]] = {}
    for k, v in pairs:
        out.setdefault(k, []).append(v)
    return out


def one_param(query: dict[str, list[str]], name: str) -> str | None:
    """A query parameter given at most once (400 when repeated)."""
    values = query.get(name, [])
    if len(values) > 1:
        raise BadRequest(f"send one {name} parameter, not several")
    return values[0] if values else None
