"""/metrics of a reader running as several workers: one scrape answers for all of them.

With SO_REUSEPORT a scrape of the public port lands on one worker, chosen by the kernel; its
counters alone would make no sense (a request rate that jumps between workers' totals). So the
worker that receives `GET /metrics` asks every sibling for its own exposition over that
sibling's private unix socket (`GET /metrics?scope=worker`), adds a `worker="<index>"` label to
every sample, and answers with the union: sum over `worker` for the reader's totals. A sibling
that does not answer (being replaced) is left out and counted in
`ds3_reader_worker_scrape_errors`. `?scope=worker` on the public port gives the answering
worker's own figures, unlabelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from reader.workers import WorkerIdentity
from shared.http.metrics import METRICS

SCRAPE_TIMEOUT = 2.0


def merge(expositions: dict[int, str]) -> list[Metric]:
    """Families of every worker's text exposition, each sample labelled with its worker."""
    families: dict[str, Metric] = {}
    for index, text in sorted(expositions.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            merged.samples.extend(
                Sample(s.name, {**s.labels, "worker": str(index)}, s.value, s.timestamp, s.exemplar)
                for s in fam.samples
            )
    return list(families.values())


class _Fixed(Collector):
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self._metrics


async def _own_text(app: web.Application) -> str:
    from prometheus_client import generate_latest

    return generate_latest(app[METRICS].registry).decode()


async def _sibling_text(me: WorkerIdentity, index: int) -> str:
    connector = aiohttp.UnixConnector(path=str(me.socket_path(index)))
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
            session.get("http://worker/metrics?scope=worker") as r:
        r.raise_for_status()
        return await r.text()


def handler(me: WorkerIdentity) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """GET /metrics for worker `me`: every worker's series, labelled (see the module doc)."""
    from shared.http.metrics import bad_scope, metrics_handler

    async def gather(request: web.Request) -> web.StreamResponse:
        if request.query.get("scope") == "worker":
            return await metrics_handler(request)
        if (refusal := bad_scope(request)) is not None:
            return refusal
        texts: dict[int, str] = {me.index: await _own_text(request.app)}
        others = [i for i in range(me.count) if i != me.index]
        results = await asyncio.gather(*(_sibling_text(me, i) for i in others), return_exceptions=True)
        errors = 0
        for i, result in zip(others, results, strict=True):
            if isinstance(result, BaseException):
                errors += 1
            else:
                texts[i] = result
        registry = CollectorRegistry(auto_describe=False)
        families = merge(texts)
        scrape_errors = Metric("ds3_reader_worker_scrape_errors", "Sibling workers that did not answer this "
                               "scrape (being replaced).", "gauge")
        scrape_errors.add_sample("ds3_reader_worker_scrape_errors", {}, errors)
        workers = Metric("ds3_reader_workers", "Worker processes of this reader.", "gauge")
        workers.add_sample("ds3_reader_workers", {}, me.count)
        registry.register(_Fixed([*families, workers, scrape_errors]))
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(registry), headers={"Content-Type": content_type,
                                                              "Cache-Control": "no-store"})

    return gather
