"""aiohttp application factory for the ingester."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler

from ingester import bucket_http, listing, move_http
from ingester import metrics as ingester_metrics
from ingester.http import add_routes
from ingester.service import SERVICE, IngesterService
from shared.config import IngesterConfig
from shared.http import access, auth, limits
from shared.http.handlers import common_headers, errors_middleware

# Answered by a standby and a fenced ingester too (the rest: 503; a standby's names the owner,
# IngesterService.standby_refusal).
_STANDBY_SERVES: Final = frozenset({"/healthz", "/readyz", "/metrics"})


@web.middleware
async def ownership_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With a store: only the prefix's owner answers requests about streams (the fast lane
    leaves everything to aiohttp meanwhile, ingester/fastlane.py AppendLane.ready)."""
    svc = request.app.get(SERVICE)
    if svc is not None and request.path not in _STANDBY_SERVES:
        if svc.standing_by:
            raise svc.standby_refusal()
        if (refusal := svc.fenced_refusal()) is not None:
            raise refusal.with_traceback(None)  # (the same object every time: its traceback would grow)
    return await handler(request)


def create_app(config: IngesterConfig) -> web.Application:
    middlewares = [errors_middleware, ownership_middleware] if config.store is not None else [errors_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    metrics = access.install(app)  # request ids, access log, /metrics, /healthz, /readyz (outermost)
    ingester_metrics.install(app, metrics, config)
    auth.install(app, config.auth, accepts_internal=True)  # before the limits: they count per token subject
    limits.install(app, config.limits)

    async def service_ctx(app: web.Application) -> AsyncIterator[None]:
        svc = IngesterService(config)
        try:
            await svc.start()
        except BaseException:  # refused or failed: close what it opened (the store's HTTP sessions)
            with contextlib.suppress(Exception):
                await svc.stop()
            raise
        app[SERVICE] = svc
        yield
        await svc.stop()

    async def end_live_waits(app: web.Application) -> None:
        """The drain (SIGTERM): every long-poll waiting answers now as at its timeout (204,
        the same offset: its client asks again, of whoever serves next), every SSE response
        ends, instead of being cut when the requests in flight are given up on."""
        svc = app.get(SERVICE)
        if svc is None:
            return
        svc.draining = True
        svc.notifier.wake_all()  # the lane's long-polls read again and answer from the wake-up
        for _ in range(100):  # aiohttp's handlers and reads on the pool: a few loop turns
            await asyncio.sleep(0.01)
            if svc.notifier.waiting == 0:
                break

    app.on_shutdown.append(end_live_waits)
    app.cleanup_ctx.append(service_ctx)
    app.on_response_prepare.append(common_headers)
    add_routes(app)
    bucket_http.add_routes(app)
    move_http.add_routes(app)
    listing.add_routes(app)  # GET /ds3/streams, /ds3/buckets (the console's listings)
    return app
