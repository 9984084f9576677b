"""The reader's metrics and readiness checks, read from its state when scraped or probed
(shared/http/metrics.py, shared/http/health.py). The counters are the ones the reader keeps anyway;
their names predate prometheus-client here and tests rely on them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
from aiohttp import web
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from reader.proxy import REFUSED_INTERNAL_TOKEN, IngesterClient
from reader.state import READER
from shared.http.health import READINESS, store_check
from shared.http.lane import LANE
from shared.http.limits import LIMITS
from shared.http.metrics import AppMetrics, StoreCollector, counter, gauge
from shared.objectstore.base import ObjectStore

# below the readiness check's own 2 s: a frozen ingester's probe ends as "no answer", not the check
INGESTER_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=1.5)


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
    yield counter("ds3_reader_chunk_lookups", "Sealed chunks looked for to answer a catch-up read (cached "
                  "heads and remembered misses included).", st.locator.lookups)
    yield counter("ds3_reader_chunk_misses_remembered", "Chunk lookups answered 'not sealed yet' from "
                  "memory (reader/sealed.py, for --descriptor-ttl): object store requests avoided.",
                  st.locator.missing_hits)
    yield counter("ds3_reader_forwarded", "Client requests forwarded to the ingester (before collapsing).",
                  st.forwarded)
    yield counter("ds3_reader_tail_checks", "Sealed pages ending where the stream's sealed history ends, whose "
                  "tail the ingester was asked for, to say Stream-Up-To-Date (concurrent ones share one request, "
                  "counted in ds3_reader_ingester_requests).",
                  st.tail_checks)
    yield counter("ds3_reader_ingester_requests", "Requests sent to the ingester (after collapsing; SSE "
                  "subscriptions and TTL renewals included; all ingesters).", st.router.requests)
    router = st.router
    links = list(router.links.values())
    lane = app.get(LANE)
    if lane is not None:
        yield counter("ds3_http_fast_lane_requests", "Appends, HEADs, tail reads and long-polls answered by the fast lane "
                      "(reader/forwardlane.py), not by aiohttp's handlers.", lane.served)
        pools = [link for link in links if link.pool is not None]
        if pools:
            yield gauge("ds3_reader_lane_upstream_connections", "The fast lane's open connections to the "
                        "ingesters (all of them).", sum(link.pool.connections for link in pools if link.pool))
            per = GaugeMetricFamily("ds3_reader_upstream_connections", "The fast lane's open connections, by "
                                    "ingester (its id in the cluster description, empty without one).",
                                    labels=["ingester_id", "url"])
            for link in pools:
                assert link.pool is not None
                per.add_metric([link.ingester_id or "", link.url], link.pool.connections)
            yield per
    per_requests = CounterMetricFamily("ds3_reader_ingester_requests_per_ingester", "Requests sent to each ingester "
                                       "(ds3_reader_ingester_requests is their sum).", labels=["ingester_id", "url"])
    for link in links:
        per_requests.add_metric([link.ingester_id or "", link.url], link.client.requests)
    yield per_requests
    yield gauge("ds3_reader_cluster_generation", "Generation of the cluster description this reader routes by "
                "(0: none; every request goes to --ingester).", router.generation)
    cluster = router.cluster
    yield gauge("ds3_reader_cluster_ingesters", "Ingesters this reader routes to.",
                len(cluster.ingesters) if cluster is not None else (1 if router.default is not None else 0))
    yield counter("ds3_reader_misdirected", "421 Misdirected Request answers from ingesters (a description "
                  "changed under this reader).", router.misdirected)
    yield counter("ds3_reader_rerouted", "Requests sent again to another ingester after a 421.", router.rerouted)
    yield counter("ds3_reader_abandoned", "Requests waiting at an ingester answered 503 at once when a standby took "
                  "its place (it was frozen or cut off).", router.abandoned)
    if router.watcher is not None:
        yield counter("ds3_reader_cluster_description_read_failures", "Reads of the cluster description that "
                      "failed or were refused.", router.watcher.failures)
    owner = st.router.owner
    if owner is not None:
        yield counter("ds3_reader_owner_changes", "Times the store prefix's owner (the ingester this reader "
                      "forwards to without a cluster description) moved while it ran.", owner.changes)
    yield counter("ds3_reader_collapsed", "Requests that shared another client's upstream request.",
                  router.collapsed_total)
    yield counter("ds3_reader_sse_shared", "SSE clients that joined an existing upstream subscription at its offset, with no "
                  "read first (clients that caught up first and then attached are not counted).",
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

    async def probe(client: IngesterClient) -> str | None:
        url = client.base + "/healthz"
        try:
            async with client.session.get(url, headers=client.upstream_headers({}),
                                          timeout=INGESTER_PROBE_TIMEOUT) as r:
                if r.status == 401 and REFUSED_INTERNAL_TOKEN in r.headers.get("WWW-Authenticate", ""):
                    return (f"the ingester at {client.base} refused this reader's internal token "
                            "(--internal-token / DS3_INTERNAL_TOKEN differs between them)")
                if r.status != 200:
                    return f"the ingester at {client.base} answered {r.status} to /healthz"
        except (aiohttp.ClientError, TimeoutError) as e:
            return f"the ingester at {client.base} is unreachable ({type(e).__name__}: {e})"[:300]
        return None

    async def ingester() -> str | None:
        """The ingester answers its /healthz: without it only sealed history can be served. With
        a cluster: at least one ingester answers (one that is down takes only its own streams;
        every reader would be just as unready, so none is taken out of service for it)."""
        st = app.get(READER)
        if st is None:
            return "starting"
        links = st.router.all_links()
        if not links:
            return st.router.no_ingester_yet()
        # Ready as soon as one answers: waiting for all of them let one frozen ingester (its
        # probe timing out) make every reader unready (found by QA).
        probes = [asyncio.ensure_future(probe(link.client)) for link in links]
        why: list[str] = []
        try:
            for done in asyncio.as_completed(probes):
                w = await done
                if w is None:
                    return None
                why.append(w)
        finally:
            for p in probes:
                p.cancel()
        return "; ".join(why)[:600]

    def cluster() -> object:
        """The "cluster" field of /readyz: the description this reader routes by (None: one --ingester)."""
        st = app.get(READER)
        if st is None or st.router.watcher is None:
            return None
        router, watcher = st.router, st.router.watcher
        c = router.cluster
        return {
            "generation": c.generation if c is not None else None,
            "ingesters": [{"id": i.id, "url": i.url} for i in c.ingesters] if c is not None else [],
            "default_ingester": router.default.url if router.default is not None else None,
            "source": watcher.source.description,
            "error": watcher.error,
        }

    ready = app[READINESS]
    ready.add("object_store", store_check(store))
    ready.add("ingester", ingester)
    ready.describe("cluster", cluster)
