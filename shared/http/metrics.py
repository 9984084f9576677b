"""Prometheus metrics shared by the ingester and the reader (prometheus-client).

Each app has its own CollectorRegistry (AppMetrics), never the global one, so tests that
build several apps in one process do not collide. Most values are counters the components
keep anyway (plain ints on the event loop) and are read when /metrics is scraped, by
collectors (`collect()` callbacks): the request path pays nothing for them. Histograms are
created unregistered by the component that observes them and collected the same way:
prometheus-client Histograms, or LoopHistograms where every append observes one.

Request metrics are labelled by `route`, a small fixed set (ROUTES), never the raw path:
stream names would make the series count unbounded."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client import disable_created_metrics as _disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from shared import extensions
from shared.buckets import BUCKETS_PREFIX
from shared.errors import BadRequest
from shared.objectstore.base import ObjectStore
from shared.protocol import STREAM_PREFIX

# `_created` series double the series count of every counter and histogram and Prometheus
# ignores them in the text format: these processes expose none (a process-wide setting).
_disable_created_metrics()  # type: ignore[no-untyped-call]

ROUTES: Final = (
    "stream_read", "stream_long_poll", "stream_sse", "stream_append", "stream_create", "stream_delete",
    "stream_head", "preflight", "snapshot", "bootstrap", "bucket", "listing", "console", "internal", "ops",
    "other",
)
OPS_PATHS: Final = frozenset({"/healthz", "/readyz", "/metrics"})
INTERNAL_PREFIX: Final = "/_ds3/"
LISTING_PREFIX: Final = "/ds3/"  # the console's listings of streams and buckets
# Seconds; long-polls and SSE connections last up to their timeouts (30 s, 60 s by default).
LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0, 60.0)
STREAM_METHOD_ROUTES: Final = {"POST": "stream_append", "PUT": "stream_create", "DELETE": "stream_delete",
                               "HEAD": "stream_head", "OPTIONS": "preflight"}


def route_of(method: str, raw_path: str, live: str | None) -> str:
    """The route label of a request: what it does, from its method, raw URL path (no query)
    and `live` query parameter. Pure and cheap (it runs for every request)."""
    if raw_path.startswith(STREAM_PREFIX):
        stream = raw_path
    elif raw_path.startswith(BUCKETS_PREFIX):
        rest = raw_path[len(BUCKETS_PREFIX):]
        _bucket, slash, stream_id = rest.partition("/")
        if not slash or not stream_id or stream_id == "streams":
            return "preflight" if method == "OPTIONS" else "bucket"
        stream = raw_path
    elif raw_path in OPS_PATHS:
        return "ops"
    elif raw_path.startswith(INTERNAL_PREFIX):
        return "internal"
    elif raw_path.startswith(LISTING_PREFIX):
        return "listing"
    elif raw_path == "/console" or raw_path.startswith("/console/"):
        return "console"
    else:
        return "other"
    if method == "OPTIONS":
        return "preflight"
    try:
        endpoint = extensions.split(stream)[1]
    except BadRequest:  # a snapshot offset that is not UTF-8: still a snapshot request
        return "snapshot"
    if endpoint is not None:
        return endpoint.kind  # "snapshot" or "bootstrap"
    if method == "GET":
        if live == "long-poll":
            return "stream_long_poll"
        return "stream_sse" if live == "sse" else "stream_read"
    return STREAM_METHOD_ROUTES.get(method, "other")


class LoopHistogram:
    """A histogram observed on the event loop thread only: observe() is a bisect and two
    additions. prometheus-client's Histogram takes a lock per bucket and per sum (about 1.2 us
    per observation here), which is most of what metrics cost an append. Exposed exactly like
    a prometheus-client Histogram (cumulative `le` buckets, `_count`, `_sum`)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(float(b) for b in buckets)
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], _Series] = {}
        self._unlabelled = self.labels() if not labelnames else None

    def labels(self, *values: str) -> _Series:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _Series(self.bounds)
        return series

    def observe(self, value: float) -> None:
        assert self._unlabelled is not None, f"{self.name} has labels: observe through labels()"
        self._unlabelled.observe(value)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labelnames))
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for values, series in sorted(self._series.items()):
            counts, total = list(series.counts), series.sum  # one copy: count and +Inf agree
            cumulative, running = [], 0
            for le, n in zip(les, counts, strict=True):
                running += n
                cumulative.append((le, running))
            family.add_metric(list(values), cumulative, total)
        yield family


class _Series:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value


class HttpMetrics:
    """Requests by route and status, their durations, and what is in flight now."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (route, status) -> count
        self.duration = LoopHistogram(
            "ds3_http_request_duration_seconds", "Time from a request's arrival to its response's end, by route.",
            LATENCY_BUCKETS, ["route"],
        )
        self.in_flight = 0
        self.live = {"long-poll": 0, "sse": 0}

    def observe(self, route: str, status: int, seconds: float) -> None:
        key = (route, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        self.duration.labels(route).observe(seconds)

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("ds3_http_requests", "HTTP requests answered, by route and status.",
                                       labels=["route", "status"])
        for (route, status), n in sorted(self.requests.items()):
            requests.add_metric([route, status], n)
        yield requests
        yield from self.duration.collect()
        yield GaugeMetricFamily("ds3_http_requests_in_flight", "Requests being handled now.", value=self.in_flight)
        live = GaugeMetricFamily("ds3_http_live_connections", "Long-polls and SSE connections open now.",
                                 labels=["mode"])
        for mode, n in self.live.items():
            live.add_metric([mode], n)
        yield live


class StoreCollector(Collector):
    """Object store requests, errors and bytes (shared.objectstore StoreCounters), summed over
    the stores `stores()` returns at scrape time (none before the app has started)."""

    def __init__(self, stores: Callable[[], Iterable[ObjectStore]]) -> None:
        self.stores = stores

    def collect(self) -> Iterator[Metric]:
        ops = {"get": 0, "put": 0, "head": 0, "list": 0, "delete": 0}
        errors = bytes_read = bytes_written = 0
        for store in {id(s): s for s in self.stores()}.values():
            c = store.counters
            ops["get"] += c.gets
            ops["put"] += c.puts
            ops["head"] += c.heads
            ops["list"] += c.lists
            ops["delete"] += c.deletes
            errors += c.errors
            bytes_read += c.bytes_in
            bytes_written += c.bytes_out
        requests = CounterMetricFamily("ds3_object_store_requests", "Object store requests, by operation.",
                                       labels=["operation"])
        for op, n in ops.items():
            requests.add_metric([op], n)
        yield requests
        yield CounterMetricFamily("ds3_object_store_errors", "Object store requests that failed "
                                  "(unreachable, refused; not 'not found').", value=errors)
        moved = CounterMetricFamily("ds3_object_store_bytes", "Bytes read from and written to the object store.",
                                    labels=["direction"])
        moved.add_metric(["read"], bytes_read)
        moved.add_metric(["written"], bytes_written)
        yield moved


class _Collect(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return self._collect()


class AppMetrics:
    """One app's registry: HTTP metrics, the process's own (CPU, memory, fds, GC), and what
    the app's components add with `add`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.http = HttpMetrics()
        self.add(self.http.collect)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def add(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Register a function yielding metric families at scrape time."""
        self.registry.register(_Collect(collect))


METRICS: Final = web.AppKey("ds3_metrics", AppMetrics)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    """A counter read at scrape time (`name` without `_total`: the exposition adds it)."""
    return CounterMetricFamily(name, doc, value=value)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


SCOPES: Final = ("worker",)  # ?scope=worker: one reader worker's own series (reader/worker_metrics.py)


def bad_scope(request: web.Request) -> web.Response | None:
    """400 for a `?scope=` that names no scope (it was ignored: a typo gave every worker's)."""
    scope = request.query.get("scope")
    if scope is None or scope in SCOPES:
        return None
    return web.Response(status=400, text=f"unknown metrics scope {scope[:40]!r}: leave it out for every series, "
                        "or scope=worker for the answering reader worker's own\n", headers={"Cache-Control": "no-store"})


async def metrics_handler(request: web.Request) -> web.Response:
    """GET /metrics: the Prometheus text format (or OpenMetrics when the scraper asks)."""
    if (refusal := bad_scope(request)) is not None:
        return refusal
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    body = encode(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": content_type, "Cache-Control": "no-store"})
