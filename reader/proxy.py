"""Forwarding to the ingester: writes, the open tail, long-poll and SSE.

One aiohttp ClientSession per process. Identical GETs in flight at the same time (same
path and query: clients waiting on the same stream, offset and cursor) share one upstream
request, so ingester connections grow with readers × active streams, not with clients."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from reader.singleflight import SingleFlight
from reader.upstream import unreachable
from shared.errors import Unavailable
from shared.http.auth import INTERNAL_HEADER
from shared.http.handlers import PREPARED
from shared.logs import REQUEST_ID_HEADER, RepeatedWarnings, request_id

log = logging.getLogger("ds3.reader.proxy")
_token_warnings: Final = RepeatedWarnings(log)
# The ingester's challenge when the internal token a reader sent is not its own (shared/http/auth.py).
REFUSED_INTERNAL_TOKEN: Final = "invalid internal token"


def refused_internal_token(status: int, challenge: str | bytes | None, ingester: str) -> Unavailable | None:
    """The ingester refused this reader's internal token: the operator's mistake (the two
    processes' DS3_INTERNAL_TOKEN differ), not the client's, whose own token may be fine. Passed
    on as it came, it told clients their token was invalid; now a 503 that says what is wrong,
    and an error in the reader's log (once per 10 s)."""
    if status != 401 or challenge is None:
        return None
    text = challenge if isinstance(challenge, str) else challenge.decode("latin-1")
    if REFUSED_INTERNAL_TOKEN not in text:
        return None
    _token_warnings.warning("refused", "the ingester at %s refused this reader's internal token: "
                            "--internal-token (DS3_INTERNAL_TOKEN) differs between them; requests it "
                            "forwards answer 503", ingester)
    return Unavailable("the reader cannot reach its ingester with its credentials (a configuration error "
                       "on the server's side, not the client's); try again later", 5)

# Hop-by-hop headers (RFC 9110 §7.6.1) and ones the reader sets itself.
DROP_REQUEST: Final = frozenset(
    {"host", "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "content-length", "accept-encoding", INTERNAL_HEADER.lower(),
     # read_body decodes the body from its Content-Encoding (shared.http.codings): what is
     # forwarded is the decoded body, which must not say it is still encoded
     "content-encoding",
     REQUEST_ID_HEADER.lower()}  # replaced by the id this reader accepted or made (shared.http.access)
)
DROP_RESPONSE: Final = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server", "trailer"}
)

# The client's request goes on as it came: no Content-Type or User-Agent of aiohttp's own
# (a POST without Content-Type must still get its 400 from the ingester).
SKIP_AUTO: Final = frozenset({"Content-Type", "User-Agent", "Accept", "Accept-Encoding"})


Headers = Mapping[str, str]  # a request's headers: a dict, or a CIMultiDict with repeats


@dataclass(frozen=True, slots=True)
class Upstream:
    status: int
    headers: CIMultiDict[str]
    body: bytes


def upstream_url(url: str) -> URL | str:
    """The client's (already encoded) target goes on unchanged: parsed as unencoded, it would
    lose dot segments (a bucketed stream may be called '.') and have escapes rewritten."""
    return URL(url, encoded=True) if url.isascii() else url


class IngesterClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, long_poll_timeout: float,
                 internal_token: str | None = None) -> None:
        self.base = base_url.rstrip("/")
        self.session = session
        # Sent with every request: the ingester lets this reader read private streams for
        # callers it checked and call /_ds3/, and leaves limiting its clients to it.
        self.internal_headers = {INTERNAL_HEADER: internal_token} if internal_token else {}
        self._timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_read=long_poll_timeout + 30)
        self._inflight: SingleFlight[str, Upstream] = SingleFlight("upstream")
        self.requests = 0
        self.collapsed = 0
        # Completed by abandon() (the ingester here was replaced): calls waiting on it fail.
        self._abandoned: asyncio.Future[Unavailable] | None = None
        self._calling = 0
        # When each call waiting now began (loop time), long-polls aside: stalled_for().
        self._waiting_since: dict[int, float] = {}
        self._next_call = 0

    def stalled_for(self) -> float:
        """Seconds the longest-waiting call (long-polls aside) has waited: a frozen or cut-off
        ingester shows here long before the read timeout (reader/routing.py watch_stalls)."""
        since = self._waiting_since
        return asyncio.get_running_loop().time() - min(since.values()) if since else 0.0

    @staticmethod
    def _request_headers(request: web.Request) -> Headers:
        """The caller's headers as sent, repeated ones included (its Authorization too: the
        ingester checks writes again), with the caller's address added to X-Forwarded-For as
        proxies do."""
        out = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in DROP_REQUEST)
        if request.remote:
            prior = request.headers.get("X-Forwarded-For")
            out.popall("X-Forwarded-For", None)
            out["X-Forwarded-For"] = f"{prior}, {request.remote}" if prior else request.remote
        return out

    def upstream_headers(self, headers: Headers) -> CIMultiDict[str]:
        """`headers` plus the internal token and the request id of the request being served
        (a shared upstream request carries the id of the request that started it)."""
        out = CIMultiDict(headers)
        out.update(self.internal_headers)
        rid = request_id()
        if rid is not None:
            out[REQUEST_ID_HEADER] = rid
        return out

    def abandon(self, error: Unavailable) -> int:
        """Calls waiting here fail with (a copy of) `error` now; how many."""
        waiting, abandoned = self._calling, self._abandoned
        self._abandoned = None
        if abandoned is not None and not abandoned.done():
            abandoned.set_result(error)
        return waiting

    async def call(self, method: str, path_qs: str, headers: Headers, body: bytes | None) -> Upstream:
        """The ingester's answer; Unavailable if it cannot be reached, or is replaced meanwhile."""
        if self._abandoned is None:
            self._abandoned = asyncio.get_running_loop().create_future()
        abandoned = self._abandoned
        calling = asyncio.ensure_future(self._call(method, path_qs, headers, body))
        self._calling += 1
        token = self._next_call = self._next_call + 1
        if "live=" not in path_qs:  # (a long-poll or SSE waits by design)
            self._waiting_since[token] = asyncio.get_running_loop().time()
        try:
            await asyncio.wait((calling, abandoned), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            if not calling.done():
                calling.cancel()
            elif not calling.cancelled():
                calling.exception()  # it failed as we were cancelled: retrieved (asyncio would log it)
            raise
        finally:
            self._calling -= 1
            self._waiting_since.pop(token, None)
        if calling.done():
            return calling.result()
        calling.cancel()
        error = abandoned.result()
        raise Unavailable(error.message, error.retry_after)

    async def _call(self, method: str, path_qs: str, headers: Headers, body: bytes | None) -> Upstream:
        self.requests += 1
        try:
            async with self.session.request(
                method, upstream_url(self.base + path_qs), headers=self.upstream_headers(headers),
                data=body, allow_redirects=False,
                timeout=self._timeout, skip_auto_headers=SKIP_AUTO,
            ) as up:
                data = await up.read()
                if (refusal := refused_internal_token(up.status, up.headers.get("WWW-Authenticate"),
                                                      self.base)) is not None:
                    raise refusal
                out = CIMultiDict((k, v) for k, v in up.headers.items() if k.lower() not in DROP_RESPONSE)
                return Upstream(up.status, out, data)
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            raise unreachable(type(e).__name__, self.base) from e

    @contextlib.asynccontextmanager
    async def open(self, method: str, path_qs: str, headers: Headers) -> AsyncIterator[aiohttp.ClientResponse]:
        """A request whose response body the caller streams (snapshots, bootstrap parts)."""
        self.requests += 1
        try:
            up = await self.session.request(
                method, upstream_url(self.base + path_qs), headers=self.upstream_headers(headers),
                allow_redirects=False, timeout=self._timeout, skip_auto_headers=SKIP_AUTO,
            )
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            raise unreachable(type(e).__name__, self.base) from e
        if (refusal := refused_internal_token(up.status, up.headers.get("WWW-Authenticate"), self.base)) is not None:
            up.release()
            raise refusal
        try:
            yield up
        finally:
            up.release()

    async def get_collapsed(self, path_qs: str, headers: Headers) -> Upstream:
        """GETs with the same path and query share one upstream request while it runs."""
        return await self.collapsed_call("GET", path_qs, headers, key=path_qs + "\x00" + headers.get("If-None-Match", ""))

    async def collapsed_call(self, method: str, path_qs: str, headers: Headers, *, key: str) -> Upstream:
        """Calls with the same key share one upstream request while it runs (reader.singleflight:
        a caller that goes away does not take the others' answer with it)."""
        if key in self._inflight:
            self.collapsed += 1
        return await self._inflight.do(key, lambda: self.call(method, path_qs, headers, None))


def to_response(up: Upstream) -> web.Response:
    return web.Response(status=up.status, headers=up.headers, body=up.body if up.status != 304 else None)


async def relay(request: web.Request, up: aiohttp.ClientResponse) -> web.StreamResponse:
    """Pass an upstream response on as it arrives (bodies that may be large)."""
    headers = CIMultiDict((k, v) for k, v in up.headers.items() if k.lower() not in DROP_RESPONSE)
    resp = web.StreamResponse(status=up.status, headers=headers)
    if up.content_length is not None:
        resp.content_length = up.content_length
    await resp.prepare(request)
    request[PREPARED] = True
    if request.method != "HEAD":
        async for piece in up.content.iter_chunked(256 * 1024):
            await resp.write(piece)
    await resp.write_eof()
    return resp
