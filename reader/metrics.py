"""The reader's metrics and readiness checks, read from its state when scraped or probed
(shared/http/metrics.py, shared/http/health.py). The counters are the ones the reader keeps anyway;
their names predate prometheus-client here and tests rely on them."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
from aiohttp import web
from prometheus_client.metrics_core import Metric

from reader.state import READER
from shared.http.health import READINESS, store_check
from shared.http.lane import LANE
from shared.http.limits import LIMITS
from shared.http.metrics import AppMetrics, StoreCollector, counter, gauge
from shared.objectstore.base import ObjectStore

INGESTER_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2)


def collect(app: web.Application) -> Iterator[Metric]:
    st = app.get(READER)
    if st is None:  # not started yet
        return
    yield counter("ds3_reader_sealed_responses", "Catch-up reads answered from the object store: ingester "
                  "requests avoided.", st.sealed_responses)
    yield counter("ds3_reader_next_pages_started", "Sealed pages asked of the object store before their "
                  "client asked (reader/relay.py NextPages).", st.next_pages.started)
    yield counter("ds3_reader_next_pages_taken", "Pages asked for ahead that their client then took.",
                  st.next_pages.taken)
    yield counter("ds3_reader_forwarded", "Client requests forwarded to the ingester (before collapsing).",
                  st.forwarded)
    yield counter("ds3_reader_ingester_requests", "Requests sent to the ingester (after collapsing; SSE "
                  "subscriptions and TTL renewals included).", st.ingester.requests)
    lane = app.get(LANE)
    if lane is not None:
        yield counter("ds3_http_fast_lane_requests", "Appends and HEADs forwarded by the fast lane "
                      "(reader/forwardlane.py), not by aiohttp's handlers.", lane.served)
        if st.upstream is not None:
            yield gauge("ds3_reader_lane_upstream_connections", "The fast lane's open connections to the ingester.",
                        st.upstream.connections)
    yield counter("ds3_reader_collapsed", "Requests that shared another client's upstream request.",
                  st.ingester.collapsed)
    yield counter("ds3_reader_sse_shared", "SSE clients that joined an existing upstream subscription.",
                  st.sse.shared)
    yield gauge("ds3_reader_sse_upstreams", "Live channels (one upstream subscription per stream, for "
                "long-poll and SSE) open now.", len(st.sse.channels))
    yield gauge("ds3_reader_sse_clients", "SSE clients served through the fan-out now.", st.sse.clients)
    yield gauge("ds3_reader_long_poll_waiters", "Long-polls parked on a live channel now.",
                sum(len(c.waiters) for c in list(st.sse.channels.values())))
    yield counter("ds3_reader_sse_dropped", "SSE clients cut loose because they stopped reading.", st.sse.dropped)
    yield counter("ds3_reader_descriptor_cache_hits", "Descriptor lookups served from memory.", st.descriptors.hits)
    yield counter("ds3_reader_descriptor_cache_misses", "Descriptor lookups that read the object store.",
                  st.descriptors.misses)
    lim = app.get(LIMITS)
    if lim is not None:
        yield counter("ds3_slow_clients_dropped", "Connections dropped because the client took nothing sent to it "
                      "for --send-timeout.", lim.stuck.dropped)


def _stores(app: web.Application) -> list[ObjectStore]:
    st = app.get(READER)
    return [] if st is None else [st.objects]


def install(app: web.Application, metrics: AppMetrics) -> None:
    metrics.add(lambda: collect(app))
    metrics.add(StoreCollector(lambda: _stores(app)).collect)

    def store() -> ObjectStore | None:
        st = app.get(READER)
        return None if st is None else st.objects

    async def ingester() -> str | None:
        """The ingester answers its /healthz: without it only sealed history can be served."""
        st = app.get(READER)
        if st is None:
            return "starting"
        url = st.ingester.base + "/healthz"
        try:
            async with st.ingester.session.get(url, headers=st.ingester.upstream_headers({}),
                                               timeout=INGESTER_PROBE_TIMEOUT) as r:
                if r.status != 200:
                    return f"the ingester at {st.ingester.base} answered {r.status} to /healthz"
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"the ingester at {st.ingester.base} is unreachable ({type(e).__name__}: {e})"[:300]
        return None

    ready = app[READINESS]
    ready.add("object_store", store_check(store))
    ready.add("ingester", ingester)
