"""aiohttp application factory for the ingester."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from ingester import bucket_http, listing
from ingester import metrics as ingester_metrics
from ingester.http import add_routes
from ingester.service import SERVICE, IngesterService
from shared.config import IngesterConfig
from shared.http import access, auth, limits
from shared.http.handlers import common_headers, errors_middleware


def create_app(config: IngesterConfig) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=config.max_body_bytes)
    metrics = access.install(app)  # request ids, access log, /metrics, /healthz, /readyz (outermost)
    ingester_metrics.install(app, metrics, config)
    auth.install(app, config.auth, accepts_internal=True)  # before the limits: they count per token subject
    limits.install(app, config.limits)

    async def service_ctx(app: web.Application) -> AsyncIterator[None]:
        svc = IngesterService(config)
        await svc.start()
        app[SERVICE] = svc
        yield
        await svc.stop()

    app.cleanup_ctx.append(service_ctx)
    app.on_response_prepare.append(common_headers)
    add_routes(app)
    bucket_http.add_routes(app)
    listing.add_routes(app)  # GET /ds3/streams, /ds3/buckets (the console's listings)
    return app
