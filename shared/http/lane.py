"""A fast lane for plain requests, shared by the ingester (appends) and the reader (forwarding).

aiohttp spends ~75 us of CPU per request before a handler runs (a Request, a StreamReader, a
task, the middleware chain): more than an append's own work, and several times what the
reader's forwarding of a request needs. So both services' connections are LaneHandlers,
aiohttp's RequestHandler plus a lane for the plain requests of their hot path:

    METHOD /v1/stream/{path} HTTP/1.1   (keep-alive; a body only with Content-Length; no
                                         query, %-escapes, dot segments, Transfer-Encoding,
                                         Content-Encoding, Expect or Upgrade; a bucket's
                                         stream, /v1/buckets/{bucket}/{stream}, alike)

with METHOD one the service's Lane takes (both: POST, HEAD, and GET with a plain query the
Lane judges: a catch-up read on the ingester, a tail read or a followed long-poll on the reader).
Such a request that begins while aiohttp has nothing in progress on the connection is parsed
with httptools and handed to `Lane.serve`, which answers it from a callback (`LaneHandler.answer`):
no task, no Request object. The Lane does the same validation, limits, metrics and request ids
as its aiohttp handlers; tests compare the answers byte for byte (tests/test_fastlane.py,
tests/test_forward_lane.py).

This module is the lane's contract: which requests are plain (`Message`), and what a service's
`Lane` decides and does with them. The connection that takes them off the wire, keeps their
answers in order and writes them is shared/http/lane_connection.py.

The lane writes the access log line aiohttp's path would (shared.http.access.log_access). With
auth on it applies the auth middleware's checks (shared/http/auth.py) first and takes only what
they allow at once: a request with no Authorization header, a static token, or a JWT verified
in the last minute; a private stream's answers get the cache headers aiohttp's path gives them
(shared.http.auth.private_cache_headers). A refusal (401/403, with its challenge and log line)
and a JWT to verify (asynchronously) are aiohttp's. With DS3_FAST_LANE=0 aiohttp answers everything.
"""

from __future__ import annotations

import os
import re
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from shared import protocol as P
from shared.auth.authenticate import Authenticator
from shared.auth.policy import Principal, target_of
from shared.errors import DS3Error
from shared.http.auth import ACCEPTS_INTERNAL, AUTH, INTERNAL_HEADER
from shared.http.handlers import BODY_TIMEOUT
from shared.http.limits import LIMITS, Limits
from shared.http.metrics import METRICS, HttpMetrics

if TYPE_CHECKING:
    from shared.http.lane_connection import LaneHandler


COMMON_HEADERS: Final = (
    "X-Content-Type-Options: nosniff\r\n"
    f"Content-Security-Policy: {P.UNTRUSTED_CONTENT_CSP}\r\n"  # (shared.http.handlers.common_headers)
    "Cross-Origin-Resource-Policy: cross-origin\r\n"
    "Access-Control-Allow-Origin: *\r\n"
    f"Access-Control-Expose-Headers: {P.CORS_EXPOSE_HEADERS}\r\n"
    f"Server: {SERVER_SOFTWARE}\r\n"
)
MAX_BODY: Final = 1024 * 1024  # the lane holds a body in memory until it is complete
REASONS: Final = {s.value: s.phrase for s in HTTPStatus}
_INTERNAL_HEADER: Final = INTERNAL_HEADER.lower().encode("ascii")
_FORKED_FROM: Final = P.FORKED_FROM.lower().encode("ascii")
ROUTES: Final = {b"POST": "stream_append", b"HEAD": "stream_head", b"GET": "stream_read", b"PUT": "stream_create",
                  b"DELETE": "stream_delete"}  # (shared.http.metrics.STREAM_METHOD_ROUTES)
_HEADER_KEYS: dict[str, bytes] = {}


CONCRETE_OFFSET: Final = re.compile(rb"\d{16}_\d{16}")  # a concrete offset in a query


def catch_up_offset(query: bytes) -> str | None:
    """The offset of a plain catch-up query (`offset=<concrete offset>` and nothing else)."""
    key, _, value = query.partition(b"=")
    if key == b"offset" and CONCRETE_OFFSET.fullmatch(value):
        return value.decode()
    return None


def forks_or_has_a_delete_body(msg: Message) -> bool:
    """A create that forks another stream (auth, and the ingester, check its source too) or a
    DELETE with a body (aiohttp's path ignores it): writes both lanes leave to aiohttp."""
    return (msg.method == b"PUT" and _FORKED_FROM in msg.headers) or (
        msg.method == b"DELETE" and msg.total != msg.head_len)


class Message:
    """A request the lane took: where it ends in the buffer, its head, and (once in) its body."""

    __slots__ = ("caller", "head_len", "headers", "internal", "method", "note", "pairs", "path", "private", "query",
                 "reply", "route", "total", "url")

    def __init__(self, method: bytes, head_len: int, total: int, url: bytes, headers: dict[bytes, bytes],
                 pairs: list[tuple[bytes, bytes]]) -> None:
        self.method, self.head_len, self.total, self.url = method, head_len, total, url
        self.path, _, self.query = url.partition(b"?")  # the raw path, and the query (b"": none)
        self.headers = headers  # lower-cased names, the first of each
        self.pairs = pairs  # every header as sent, in order (what a forwarder passes on)
        self.route = ROUTES.get(method, "other")
        self.note: Any = None  # what a Lane's accepts() worked out, for its serve()
        self.caller: Principal | None = None  # who the Authorization header names (auth on)
        self.internal = False  # a reader sent the (checked) internal token
        self.private = False  # the answer must not be kept by shared caches (a private stream)
        self.reply: bytes | None = None  # its answer, ready while an earlier one is still pending

    def header(self, name: bytes) -> str | None:
        """A header's value decoded like aiohttp's (`name` lower case)."""
        v = self.headers.get(name)
        return None if v is None else v.decode("utf-8", "surrogateescape")

    def header_str(self, name: str) -> str | None:
        """A header's value by its name in any case (what validation code calls `header`)."""
        key = _HEADER_KEYS.get(name)
        if key is None:  # a handful of names, looked up for every request
            key = _HEADER_KEYS[name] = name.lower().encode("ascii")
        return self.header(key)


class Lane:
    """Per app: whether the lane may run, which requests it takes, and how it serves them.
    A service subclasses it (`ready`, `serve`, and `accepts` for checks of its own)."""

    methods: frozenset[bytes] = frozenset({b"POST"})
    query_methods: frozenset[bytes] = frozenset()  # methods whose URLs may have a query (accepts() judges it)
    # Methods taken while earlier answers of the same kind are pending (pipelined appends), at
    # most `max_alongside` at once on a connection.
    alongside: frozenset[bytes] = frozenset()
    max_alongside: int = 64

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.switched_on = os.environ.get("DS3_FAST_LANE", "1") not in ("0", "false", "no", "off")
        self.http: HttpMetrics | None = None
        self.limits: Limits | None = None
        self.auth: Authenticator | None = None
        self.accepts_internal = False  # the service takes the internal token (the ingester)
        self.served_by_route: dict[str, int] = {}  # requests answered by the lane, by route label
        self.prefixes = tuple(m + p for m in sorted(self.methods) for p in (b" /v1/stream/", b" /v1/buckets/"))
        self.alongside_prefixes = tuple(m + b" " for m in sorted(self.alongside))
        self._date = ""
        self._date_at = 0

    @property
    def served(self) -> int:
        """Requests answered by the lane."""
        return sum(self.served_by_route.values())

    def ready(self) -> bool:
        """Whether the lane may take requests now (the service is up)."""
        if not self.switched_on:
            return False
        if self.http is None:
            self.http = self.app[METRICS].http
            self.limits = self.app[LIMITS]
            self.auth = self.app[AUTH]
            self.accepts_internal = self.app[ACCEPTS_INTERNAL]
        return True

    def authorized(self, msg: Message) -> bool:
        """The auth middleware's checks (shared.http.auth.auth_middleware) where they pass at
        once (msg.private: the answer must be marked private); False leaves the request, and
        any refusal, to aiohttp."""
        auth = self.auth
        assert auth is not None
        if self.accepts_internal:
            presented = msg.headers.get(_INTERNAL_HEADER)
            if presented is not None:
                if not auth.is_internal(presented.decode("utf-8", "replace")):
                    return False  # aiohttp answers the 401 (and logs it)
                msg.internal = True
        if not auth.enabled:
            return True
        target = target_of(msg.path.decode("ascii"))
        if target is None:
            return False
        header = msg.header(b"authorization")
        caller = None
        if header is not None:
            caller = auth.known_caller(header)
            if caller is None:
                return False
        try:
            msg.private = auth.policy.check(msg.method.decode("ascii"), target, caller, internal=msg.internal)
        except DS3Error:
            return False
        msg.caller = caller
        return True

    def max_body(self) -> int:
        return MAX_BODY

    def accepts(self, handler: LaneHandler, msg: Message) -> bool:
        """Service-specific checks of a message the generic ones let through."""
        return True

    def serve(self, handler: LaneHandler, msg: Message, body: bytes, rid: str, started: float) -> None:
        """Answer `msg`: call handler.answer() (or handler.answer_failure()) exactly once, now
        or later."""
        raise NotImplementedError

    def body_timeout(self) -> float:
        return self.app.get(BODY_TIMEOUT, 60.0)

    def date(self) -> str:
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = formatdate(now, usegmt=True)
        return self._date


LANE: Final = web.AppKey("ds3_fast_lane", Lane)
