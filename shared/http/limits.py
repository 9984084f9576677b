"""Per-client limits for aiohttp apps (ingester and reader alike): write and create rates,
live connections per client (429 beyond), and a watchdog that drops connections whose
client stopped taking what we send (an SSE reader that stopped reading, a stuck download).

Request bodies have their own deadline (shared.http.handlers.read_body, 408); the request head is
bounded by aiohttp's keep-alive timeout, which runs until a whole head has arrived."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from shared.config import LimitsConfig
from shared.errors import TooManyRequests
from shared.http.auth import INTERNAL, caller_of
from shared.http.handlers import BODY_TIMEOUT
from shared.limits import LiveCounts, TokenBuckets, client_address, client_identity, parse_networks

log = logging.getLogger("ds3.limits")

WRITE_METHODS: Final = frozenset({"PUT", "POST", "DELETE"})
LIMITED_PREFIXES: Final = ("/v1/",)
LIVE_RETRY_AFTER: Final = 5

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class StuckWriters:
    """Drops a connection whose transport has had writing paused (its send buffer full: the
    client takes nothing) for `timeout` seconds. One sweep a second over the connections
    seen; a closed one is forgotten at the next sweep."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._since: dict[Any, float | None] = {}  # RequestHandler -> when it got stuck
        self.dropped = 0

    def watch(self, request: web.Request) -> None:
        self.watch_protocol(request.protocol)

    def watch_protocol(self, proto: Any) -> None:
        """`proto`: an aiohttp RequestHandler (its transport and writing_paused)."""
        if proto not in self._since:
            self._since[proto] = None

    def sweep(self, now: float) -> None:
        for proto, since in list(self._since.items()):
            transport = proto.transport
            if transport is None or transport.is_closing():
                del self._since[proto]
            elif not proto.writing_paused:
                if since is not None:
                    self._since[proto] = None
            elif since is None:
                self._since[proto] = now
            elif now - since >= self.timeout:
                del self._since[proto]
                self.dropped += 1
                log.info("dropping a client that took nothing for %.0f s", now - since)
                transport.abort()

    async def run(self) -> None:
        interval = min(1.0, self.timeout / 4)
        while True:
            await asyncio.sleep(interval)
            self.sweep(time.monotonic())


class Limits:
    def __init__(self, config: LimitsConfig) -> None:
        self.config = config
        self.writes = TokenBuckets(config.write_rate, config.write_burst)
        self.creates = TokenBuckets(config.create_rate, config.create_burst)
        self.live = LiveCounts(config.max_live_per_client)
        self.proxies = parse_networks(config.trusted_proxies)
        self.stuck = StuckWriters(config.send_timeout)

    def client(self, request: web.Request) -> str | None:
        caller = caller_of(request)
        address = client_address(request.remote, request.headers.get("X-Forwarded-For"), self.proxies)
        return client_identity(caller.subject if caller is not None else None, address)

    def take(self, buckets: TokenBuckets, client: str, what: str) -> None:
        wait = buckets.take(client, time.monotonic())
        if wait > 0:
            raise TooManyRequests(
                f"too many {what}: at most {buckets.rate:g} a second per client (bursts of {buckets.burst:g}); "
                f"retry in {math.ceil(wait)} s",
                math.ceil(wait),
            )

    def take_write(self, client: str, create: bool) -> None:
        """A write's share of the client's limits (a create's of the create limit too): the
        middleware's and the fast lanes' one rule."""
        if create:
            self.take(self.creates, client, "creates")
        self.take(self.writes, client, "writes")


LIMITS: Final = web.AppKey("ds3_limits", Limits)


def _is_live(request: web.Request) -> bool:
    return request.method == "GET" and request.query.get("live") in ("long-poll", "sse")


@web.middleware
async def limits_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    lim = request.app[LIMITS]
    lim.stuck.watch(request)
    # A reader (internal token) limits its own clients; the ingester sees all of them via it.
    if request.get(INTERNAL) or not request.path.startswith(LIMITED_PREFIXES):
        return await handler(request)
    if request.method in WRITE_METHODS:
        client = lim.client(request)
        if client is None:
            return await handler(request)
        lim.take_write(client, request.method == "PUT")
        return await handler(request)
    if not _is_live(request):
        return await handler(request)
    client = lim.client(request)
    if client is None:
        return await handler(request)
    if not lim.live.acquire(client):
        raise TooManyRequests(
            f"too many live connections: at most {lim.live.cap} long-poll or SSE {'stream' if lim.live.cap == 1 else 'streams'} at once per client",
            LIVE_RETRY_AFTER,
        )
    try:
        return await handler(request)
    finally:
        lim.live.release(client)


def install(app: web.Application, config: LimitsConfig) -> Limits:
    """Add the limits to `app` (after the auth middleware: limits count per token subject)."""
    lim = Limits(config)
    app[LIMITS] = lim
    app[BODY_TIMEOUT] = config.body_timeout
    app.middlewares.append(limits_middleware)

    async def watchdog(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(lim.stuck.run(), name="ds3-stuck-writers")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(watchdog)
    return lim
