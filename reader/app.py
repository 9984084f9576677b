"""aiohttp application factory for the reader."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from reader import bucket_http, console_http, worker_metrics, workers
from reader import metrics as reader_metrics
from reader.descriptors import DescriptorCache
from reader.fanout import LiveHub, Page
from reader.http import add_routes, read_page
from reader.proxy import IngesterClient
from reader.routing import Router
from reader.sealed import SealedLocator
from reader.state import READER, ReaderState
from reader.upstream import UpstreamPool
from shared import protocol as P
from shared.chunkstore import ChunkReader
from shared.cluster import ClusterWatcher, FileSource, StoreSource
from shared.config import ConfigError, ReaderConfig
from shared.http import access, auth, limits
from shared.http.handlers import common_headers, errors_middleware
from shared.objectstore import open_store
from shared.objectstore.url import FileStoreURL, parse_store_url
from shared.owner_watch import MemberOwners, OwnerWatcher

log = logging.getLogger("ds3.reader")
STARTUP_READ_TIMEOUT = 3.0  # seconds the reader waits for its first read of the cluster description


def create_app(config: ReaderConfig) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=config.max_body_bytes)
    worker = workers.identity()  # one of `ds3 reader --workers N`: /metrics answers for all of them
    # request ids, access log, /metrics, /healthz, /readyz (outermost)
    metrics = access.install(app, worker_metrics.handler(worker) if worker is not None else None)
    reader_metrics.install(app, metrics)
    auth.install(app, config.auth, accepts_internal=False)  # before the limits: they count per token subject
    limits.install(app, config.limits)

    async def clients_ctx(app: web.Application) -> AsyncIterator[None]:
        _warn_if_no_local_store(config.store)
        objects = open_store(config.store, s3_endpoint=config.s3_endpoint)
        session = aiohttp.ClientSession(
            auto_decompress=False, connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        )
        chunks = ChunkReader(objects)
        descriptors = DescriptorCache(objects, config.descriptor_ttl)
        def make_client(url: str) -> IngesterClient:
            return IngesterClient(url, session, config.long_poll_timeout, internal_token=config.auth.internal_token)

        def make_pool(url: str) -> UpstreamPool | None:
            try:
                return UpstreamPool(url, read_timeout=config.long_poll_timeout + 30)
            except ValueError as e:
                log.info("%s; forwarding to it goes through aiohttp's client", e)
                return None

        source: FileSource | StoreSource = (FileSource(config.cluster) if config.cluster is not None
                                            else StoreSource(objects))
        watcher = ClusterWatcher(source, config.cluster_refresh, optional=config.cluster is None)
        # the first read, briefly waited for (a store that is slow now: it goes on in the background,
        # and requests go to --ingester meanwhile, whose 421s would trigger a re-read anyway)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STARTUP_READ_TIMEOUT):
                await watcher.refresh()
        if config.cluster is not None and watcher.current is None:
            raise ConfigError(f"cluster (DS3_CLUSTER): {watcher.error}")
        # no --ingester (and no --cluster): the prefix owner's advertised URL (shared/owner_watch.py)
        owner = OwnerWatcher(objects) if config.cluster is None and config.ingester is None else None
        if owner is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STARTUP_READ_TIMEOUT):
                    await owner.refresh()
            owner.start()
        router = Router(config.ingester, make_client, make_pool, watcher,
                        internal_headers=make_client(config.ingester or "http://127.0.0.1").internal_headers,
                        owner=owner, members=MemberOwners(objects))
        watcher.start()
        router.start()
        state: ReaderState | None = None

        async def page(path: str, offset: str) -> Page:
            assert state is not None
            return await read_page(state, path, offset)

        state = app[READER] = ReaderState(
            config=config, objects=objects, chunks=chunks, descriptors=descriptors,
            locator=SealedLocator(descriptors, chunks, config.max_read_bytes, config.descriptor_ttl), router=router,
            sse=LiveHub(router, page, config.sse_max_seconds, config.long_poll_timeout,
                       P.tail_cache_control(config.tail_max_age), config.max_read_bytes),
        )
        if watcher.current is not None:
            log.info("routing by the cluster description from %s (generation %d: %s)", source.description,
                     watcher.current.generation, ", ".join(i.describe() for i in watcher.current.ingesters))
        yield
        state.sse.stop()
        await state.next_pages.close()
        await router.close()
        await session.close()
        await objects.close()

    app.cleanup_ctx.append(clients_ctx)

    async def end_live(app: web.Application) -> None:
        # Stopping (after the listening sockets closed, before the connections are waited for):
        # parked long-polls get the live channel's end (503, Retry-After), wherever they wait
        # (the fast lane's or aiohttp's), and SSE responses end, instead of being cut when
        # the shutdown timeout runs out or the loop ends (reader/fanout.py LiveHub.end).
        st = app.get(READER)
        if st is not None:
            await st.sse.end()

    app.on_shutdown.append(end_live)
    app.on_response_prepare.append(common_headers)
    add_routes(app)
    bucket_http.add_routes(app)
    console_http.add_routes(app)  # /console and the listings it uses
    return app


def _warn_if_no_local_store(url: str) -> None:
    """A local store that does not exist yet: said, since the reader creates it empty and a
    typo in --store would otherwise serve no sealed history without a word (an ingester
    creates its store; a reader only reads one)."""
    parsed = parse_store_url(url)  # (valid: the config checked it)
    if isinstance(parsed, FileStoreURL):
        root = parsed.root
        if not root.exists():
            log.warning("the local store %s does not exist: created it empty; no sealed history is served from "
                        "it until an ingester writes there (check --store if one already does)", root)
