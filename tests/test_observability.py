"""Metrics, health, readiness, request ids and JSON logs (README "Metrics, health and logs").

In-process ingesters (aiohttp TestServer around create_app) for what one app shows; real
processes (tests/cluster.py) for sealing, the reader, a store outage through a TcpGate,
an ingester that goes away, and the logs of both processes for one forwarded request."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.registry import Collector

from shared import logs
from shared.config import AuthConfig
from shared.http.metrics import LATENCY_BUCKETS, ROUTES, LoopHistogram, route_of
from tests.cluster import Cluster, StoreView, append, create, parse_metrics, read_pages, scrape, wait_for
from tests.tcpgate import TcpGate

GENERATED_ID = re.compile(r"[0-9a-f]{16}")
TEXT = "text/plain"


async def metrics_of(client: TestClient[Any, Any]) -> dict[str, float]:
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    return parse_metrics(await r.text())


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def appends(route: str = "stream_append", status: int = 204) -> str:
    return f'ds3_http_requests_total{{route="{route}",status="{status}"}}'


# ---------------------------------------------------------------- pure pieces
@pytest.mark.parametrize(("method", "path", "live", "route"), [
    ("GET", "/v1/stream/a/b", None, "stream_read"),
    ("GET", "/v1/stream/a", "long-poll", "stream_long_poll"),
    ("GET", "/v1/stream/a", "sse", "stream_sse"),
    ("POST", "/v1/stream/a", None, "stream_append"),
    ("PUT", "/v1/stream/a", None, "stream_create"),
    ("DELETE", "/v1/stream/a", None, "stream_delete"),
    ("HEAD", "/v1/stream/a", None, "stream_head"),
    ("OPTIONS", "/v1/stream/a", None, "preflight"),
    ("PATCH", "/v1/stream/a", None, "other"),
    ("PUT", "/v1/stream/a/snapshot/0000000000000001_0000000000000005", None, "snapshot"),
    ("GET", "/v1/stream/a/snapshot", None, "snapshot"),
    ("GET", "/v1/stream/a/snapshot/%FF", None, "snapshot"),
    ("GET", "/v1/stream/a/bootstrap", None, "bootstrap"),
    ("PUT", "/v1/buckets/agents", None, "bucket"),
    ("GET", "/v1/buckets/agents/streams", None, "bucket"),
    ("POST", "/v1/buckets/agents/user-1", None, "stream_append"),
    ("GET", "/v1/buckets/agents/user-1/bootstrap", None, "bootstrap"),
    ("POST", "/_ds3/touch", None, "internal"),
    ("GET", "/ds3/streams", None, "listing"),
    ("GET", "/console/app.js", None, "console"),
    ("GET", "/metrics", None, "ops"),
    ("GET", "/readyz", None, "ops"),
    ("GET", "/favicon.ico", None, "other"),
])
def test_route_labels_are_a_small_fixed_set(method: str, path: str, live: str | None, route: str) -> None:
    assert route_of(method, path, live) == route
    assert route in ROUTES


@pytest.mark.parametrize(("incoming", "kept"), [
    ("abc-123", True), ("A.b:c_d-9", True), ("x" * 128, True),
    (None, False), ("", False), ("x" * 129, False), ("has space", False), ('quo"te', False),
    ("new\nline", False), ("ünï", False),
])
def test_request_ids_are_kept_only_when_sane(incoming: str | None, kept: bool) -> None:
    got = logs.accept_request_id(incoming)
    assert (got == incoming) is kept
    if not kept:
        assert GENERATED_ID.fullmatch(got)


def test_json_log_lines() -> None:
    formatter = logs.JsonFormatter()
    log = logging.getLogger("ds3.test")
    record = log.makeRecord("ds3.test", logging.WARNING, __file__, 1, "upload of %s failed", ("s/a",), None,
                            extra={"fields": {"status": 503}})
    token = logs.set_request_id("req-1")
    try:
        line = formatter.format(record)
    finally:
        logs.reset_request_id(token)
    out = json.loads(line)
    assert "\n" not in line
    assert out["level"] == "warning" and out["logger"] == "ds3.test" and out["msg"] == "upload of s/a failed"
    assert out["request_id"] == "req-1" and out["status"] == 503
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out["ts"]), out["ts"]
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        failed = log.makeRecord("ds3.test", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    out = json.loads(formatter.format(failed))
    assert "request_id" not in out and "ValueError: boom" in out["exc"]
    assert logs.printable("a\nb\x1bc") == "a\\x0ab\\x1bc"


# ---------------------------------------------------------------- one app, in process
async def test_ingester_metrics_follow_appends(make_ingester: Any, tmp_path: Path) -> None:
    c = await make_ingester()
    before = await metrics_of(c)
    assert (await c.put("/v1/stream/m", headers={"Content-Type": TEXT})).status == 201
    for i in range(20):
        r = await c.post("/v1/stream/m", data=f"message {i}".encode(), headers={"Content-Type": TEXT})
        assert r.status == 204
    assert (await c.post("/v1/stream/missing", data=b"x", headers={"Content-Type": TEXT})).status == 404
    after = await metrics_of(c)

    assert delta(after, before, appends()) == 20
    assert delta(after, before, appends(status=404)) == 1
    assert delta(after, before, appends("stream_create", 201)) == 1
    assert delta(after, before, 'ds3_http_request_duration_seconds_count{route="stream_append"}') == 21
    assert delta(after, before, "ds3_ingester_append_seconds_count") == 20  # acknowledged appends
    assert delta(after, before, "ds3_ingester_append_seconds_sum") > 0
    ops = delta(after, before, "ds3_wal_operations_total")
    assert ops >= 22  # the create, 20 appends, the refused append
    assert 1 <= delta(after, before, "ds3_wal_commits_total") <= ops
    assert delta(after, before, "ds3_wal_commit_batch_size_sum") == ops
    assert delta(after, before, "ds3_wal_commit_seconds_count") == delta(after, before, "ds3_wal_commits_total")
    assert after["ds3_wal_records"] == 20  # no store: everything stays in the WAL
    assert after["ds3_wal_record_bytes"] > 0 and after["ds3_wal_streams"] == 1
    assert "ds3_seal_uploads_total" not in after  # nothing seals without a store
    assert after["process_resident_memory_bytes"] > 0
    # the route label never carries a path
    assert not [k for k in after if "/v1/" in k or "missing" in k]

    # A second app in the same process has its own registry: nothing of the first shows.
    other = await make_ingester(data_dir=tmp_path / "other")
    assert appends() not in await metrics_of(other)


async def test_request_id_round_trip(make_ingester: Any) -> None:
    c = await make_ingester()
    r = await c.put("/v1/stream/r", headers={"Content-Type": TEXT, "X-Request-Id": "client-id.1"})
    assert r.status == 201 and r.headers["X-Request-Id"] == "client-id.1"
    ids = set()
    for bad in ("has space", "x" * 129, None):
        headers = {"X-Request-Id": bad} if bad is not None else {}
        r = await c.get("/v1/stream/nope", headers=headers)  # errors carry one too
        assert r.status == 404
        assert GENERATED_ID.fullmatch(r.headers["X-Request-Id"]), r.headers
        ids.add(r.headers["X-Request-Id"])
    assert len(ids) == 3
    # a streamed response (prepared by its handler) has it as well
    async with c.get("/v1/stream/r", params={"offset": "-1", "live": "sse"},
                     headers={"X-Request-Id": "sse-1"}) as r:
        assert r.status == 200 and r.headers["X-Request-Id"] == "sse-1"


async def test_live_connections_gauge(make_ingester: Any) -> None:
    c = await make_ingester(long_poll_timeout=10)
    r = await c.put("/v1/stream/live", headers={"Content-Type": TEXT})
    tail = r.headers["Stream-Next-Offset"]
    live = 'ds3_http_live_connections{mode="long-poll"}'
    assert (await metrics_of(c))[live] == 0
    poll = asyncio.create_task(c.get("/v1/stream/live", params={"offset": tail, "live": "long-poll"}))
    deadline = time.monotonic() + 5
    while (m := await metrics_of(c))[live] != 1:
        assert time.monotonic() < deadline, m[live]
        await asyncio.sleep(0.02)
    assert m["ds3_ingester_live_waiters"] == 1
    await c.post("/v1/stream/live", data=b"wake", headers={"Content-Type": TEXT})
    assert (await poll).status == 200
    m = await metrics_of(c)
    assert m[live] == 0 and m[appends("stream_long_poll", 200)] == 1


async def test_health_and_readiness_in_process(make_ingester: Any) -> None:
    c = await make_ingester()
    r = await c.get("/healthz")
    assert r.status == 200 and await r.text() == "ok\n"
    r = await c.get("/readyz")
    body = await r.json()
    assert r.status == 200 and body == {"status": "ready", "checks": {"wal": "ok"}}, body  # no store: no check


async def test_tokens_never_reach_json_logs(make_ingester: Any) -> None:
    good, bad = "obs-good-token-0123456789abcdef", "obs-bad-token-0123456789abcdef"
    tokens = json.dumps([{"token": good, "sub": "alice", "read": ["*"], "write": ["*"]}])
    c = await make_ingester(auth=AuthConfig(tokens=tokens))
    with CaptureJsonLogs() as out:
        r = await c.put("/v1/stream/t", headers={"Content-Type": TEXT, "Authorization": f"Bearer {good}"})
        assert r.status == 201
        r = await c.post("/v1/stream/t", data=b"x", headers={"Content-Type": TEXT, "Authorization": f"Bearer {bad}"})
        assert r.status == 401
    text = "\n".join(out)
    access = [json.loads(line) for line in out if '"ds3.access"' in line]
    assert [(a["status"], a.get("sub")) for a in access] == [(201, "sub:alice"), (401, None)], access
    assert good not in text and bad not in text and "Bearer" not in text


class CaptureJsonLogs:
    """Format every ds3 record as JSON while it is emitted (in the request's context)."""

    def __enter__(self) -> list[str]:
        self.lines: list[str] = []
        lines = self.lines

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(self.format(record))

        self.handler = Keep(logging.DEBUG)
        self.handler.setFormatter(logs.JsonFormatter())
        self.logger = logging.getLogger("ds3")
        self.level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self.handler)
        return lines

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


# ---------------------------------------------------------------- real processes
@pytest.fixture
def local_store(tmp_path: Path) -> StoreView:
    return StoreView.local(tmp_path / "objects")


async def test_metrics_of_sealing_and_sealed_reads(tmp_path: Path, local_store: StoreView) -> None:
    """Sealing moves the ingester's upload and store metrics; a catch-up read through the
    reader is served from the store for sealed chunks (no ingester request) and forwarded
    for the tail."""
    with Cluster(tmp_path, local_store, seal_bytes=1024) as c:
        url = f"{c.reader.url}/v1/stream/obs"
        async with aiohttp.ClientSession() as s:
            await create(s, url, TEXT)
            for _ in range(10):
                await append(s, url, b"x" * 300, TEXT)  # chunks roll at 1200 and 2400 bytes
            ing = wait_for(lambda: (m := scrape(c.ingester.url))["ds3_seal_uploads_total"] >= 2
                           and m["ds3_wal_records"] == 2 and m, 20, "two sealed chunks")
            assert ing["ds3_seal_upload_seconds_count"] >= 2 and ing["ds3_seal_backlog"] == 0
            assert ing['ds3_object_store_requests_total{operation="put"}'] >= 3  # 2 chunks + the descriptor
            assert ing['ds3_object_store_bytes_total{direction="written"}'] >= 2400
            assert ing["ds3_seal_upload_failures_total"] == 0 and ing["ds3_object_store_errors_total"] == 0
            assert ing[appends()] == 10

            before = scrape(c.reader.url)
            pages = await read_pages(s, url)
            after = scrape(c.reader.url)
        assert len(pages) == 3
        assert delta(after, before, "ds3_reader_sealed_responses_total") == 2
        assert delta(after, before, "ds3_reader_forwarded_total") == 1
        # the tail page, and whether the second sealed page ended at the tail (if the ingester was
        # asked: the chunk's upload may have raced the last appends)
        checks = delta(after, before, "ds3_reader_tail_checks_total")
        assert checks <= 1
        assert delta(after, before, "ds3_reader_ingester_requests_total") == 1 + checks
        assert delta(after, before, appends("stream_read", 200)) == 3
        assert delta(after, before, "ds3_reader_descriptor_cache_misses_total") >= 1
        assert delta(after, before, 'ds3_object_store_requests_total{operation="get"}') >= 3
        assert delta(after, before, 'ds3_object_store_bytes_total{direction="read"}') >= 2400


@pytest.fixture
def outage(tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> Iterator[tuple[Cluster, TcpGate]]:
    store, gate = gated_s3
    with Cluster(tmp_path, store, seal_bytes=1024, ingester_endpoint=gate.url) as c:
        yield c, gate


async def test_store_outage_shows_in_metrics_and_readiness(outage: tuple[Cluster, TcpGate]) -> None:
    c, gate = outage
    url = f"{c.ingester.url}/v1/stream/outage"
    async with aiohttp.ClientSession() as s:
        await create(s, url, TEXT)
        # Readiness checks time out after 2 s: on a loaded machine the first may need a retry.
        wait_for(lambda: http_get(f"{c.ingester.url}/readyz")[0] == 200, 15, "the ingester to be ready")
        gate.down()
        for _ in range(5):
            await append(s, url, b"y" * 300, TEXT)  # still acknowledged from the WAL
    # (local durability: the chunk's upload waits for the log, which cannot reach the store)
    failing = wait_for(lambda: (m := scrape(c.ingester.url))["ds3_log_upload_failures_total"] >= 1 and m,
                       30, "a failed upload")
    assert failing["ds3_seal_uploads_total"] == 0 and failing["ds3_log_held_store_effects"] >= 1
    assert failing["ds3_object_store_errors_total"] >= 1 and failing["ds3_log_lag_seconds"] > 0
    _status, body = wait_for(lambda: (got := http_get(f"{c.ingester.url}/readyz"))[0] == 503 and got, 15,
                            "the ingester to turn not ready")
    reasons = json.loads(body)["reasons"]
    assert json.loads(body)["checks"]["wal"] == "ok"
    # refused, reset or silent: which one depends on timing, but the reason names the check
    assert any(r.startswith("object_store: ") for r in reasons), reasons
    assert http_get(f"{c.ingester.url}/healthz") == (200, "ok\n")  # alive all the same
    # the reader reaches the store directly
    wait_for(lambda: http_get(f"{c.reader.url}/readyz")[0] == 200, 15, "the reader to stay ready")

    gate.up()
    wait_for(lambda: (m := scrape(c.ingester.url))["ds3_seal_uploads_total"] >= 1 and m["ds3_seal_backlog"] == 0,
             45, "the upload to succeed once the store is back")
    wait_for(lambda: http_get(f"{c.ingester.url}/readyz")[0] == 200, 15, "the ingester to be ready again")


async def test_reader_not_ready_without_its_ingester(tmp_path: Path, local_store: StoreView) -> None:
    with Cluster(tmp_path, local_store) as c:
        ready = json.loads(http_get(f"{c.reader.url}/readyz")[1])
        assert {k: ready[k] for k in ("status", "checks")} == {
            "status": "ready", "checks": {"object_store": "ok", "ingester": "ok"}}
        # no cluster description: everything goes to --ingester
        assert ready["cluster"]["generation"] is None and ready["cluster"]["default_ingester"] == c.ingester.url
        c.ingester.stop()
        _status, body = wait_for(lambda: (got := http_get(f"{c.reader.url}/readyz"))[0] == 503 and got, 15,
                                "the reader to turn not ready")
        got = json.loads(body)
        assert got["status"] == "not ready" and got["checks"]["object_store"] == "ok"
        assert [r for r in got["reasons"] if r.startswith("ingester: ") and c.ingester.url in r], got
        assert http_get(f"{c.reader.url}/healthz") == (200, "ok\n")
        assert scrape(c.reader.url)[appends("ops", 503)] >= 1
        c.ingester.start()
        wait_for(lambda: http_get(f"{c.reader.url}/readyz")[0] == 200, 15, "the reader to be ready again")


JSON_LOGS = ["--log-level", "info", "--log-format", "json"]


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)  # every line is one JSON object
            assert {"ts", "level", "logger", "msg"} <= record.keys(), record
            out.append(record)
    return out


async def test_one_request_id_in_both_logs(tmp_path: Path, local_store: StoreView) -> None:
    # The ingester's access log is off by default (its callers are readers): turn it on.
    with Cluster(tmp_path, local_store, ingester_args=[*JSON_LOGS, "--access-log"], reader_args=JSON_LOGS) as c:
        url = f"{c.reader.url}/v1/stream/logs"
        async with aiohttp.ClientSession() as s:
            await create(s, url, TEXT)
            async with s.post(url, data=b"hello", headers={"Content-Type": TEXT, "X-Request-Id": "obs-42"}) as r:
                assert r.status == 204 and r.headers["X-Request-Id"] == "obs-42"
            async with s.get(url, params={"offset": "-1"}, headers={"X-Request-Id": "has space"}) as r:
                assert r.status == 200 and await r.read() == b"hello"
                made = r.headers["X-Request-Id"]
        assert GENERATED_ID.fullmatch(made)
        ingester_log, reader_log = c.ingester.log_path, c.reader.log_path
        wait_for(lambda: "obs-42" in ingester_log.read_text() and made in reader_log.read_text(), 5, "log lines")
    ingester_lines, reader_lines = _json_lines(ingester_log), _json_lines(reader_log)

    def access(lines: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
        return [r for r in lines if r["logger"] == "ds3.access" and r.get("request_id") == rid]

    for rid, method, route, status in (("obs-42", "POST", "stream_append", 204), (made, "GET", "stream_read", 200)):
        for lines, service in ((reader_lines, "reader"), (ingester_lines, "ingester")):
            found = access(lines, rid)
            assert len(found) == 1, (rid, found)
            line = found[0]
            assert line["service"] == service
            assert (line["method"], line["route"], line["status"]) == (method, route, status), line
            assert line["path"].startswith("/v1/stream/logs") and line["client"] == "127.0.0.1"
            assert isinstance(line["duration_ms"], float) and line["duration_ms"] >= 0
            assert line["level"] == "info"
    assert access(reader_lines, made)[0]["bytes"] == 5
    assert not [r for r in reader_lines + ingester_lines if "has space" in json.dumps(r)]
    assert any("listening on" in r["msg"] for r in ingester_lines)


async def test_access_log_defaults_on_for_readers_and_off_for_the_ingester(
    tmp_path: Path, local_store: StoreView
) -> None:
    with Cluster(tmp_path, local_store, ingester_args=JSON_LOGS, reader_args=JSON_LOGS) as c:
        url = f"{c.reader.url}/v1/stream/quiet"
        async with aiohttp.ClientSession() as s:
            await create(s, url, TEXT)
            async with s.post(url, data=b"x", headers={"Content-Type": TEXT, "X-Request-Id": "default-7"}) as r:
                assert r.status == 204
        wait_for(lambda: "default-7" in c.reader.log_path.read_text(), 5, "the reader's access line")
        assert not [line for line in _json_lines(c.ingester.log_path) if line.get("logger") == "ds3.access"]


class _Only(Collector):
    def __init__(self, histogram: Histogram | LoopHistogram) -> None:
        self.histogram = histogram

    def collect(self) -> Any:
        return self.histogram.collect()


def _exposed(histogram: Histogram | LoopHistogram) -> str:
    registry = CollectorRegistry()
    registry.register(_Only(histogram))
    return generate_latest(registry).decode()


@pytest.mark.parametrize("values", [
    [],
    [0.0],
    [0.001, 0.0025, 0.005, 60.0],  # exactly on bounds: counted in that bucket (le)
    [0.0010001, 59.999, 60.0001, 1e9],  # just past bounds, and far past the last one
    [0.0004 * i for i in range(2000)],
])
def test_loop_histogram_exposes_what_prometheus_client_does(values: list[float]) -> None:
    """The hot-path histogram (LoopHistogram) must read exactly like prometheus-client's:
    same buckets, counts, sums and labels in the text format, so dashboards cannot tell."""
    theirs = Histogram("x_seconds", "Some latency.", ["route"], buckets=LATENCY_BUCKETS, registry=None)
    ours = LoopHistogram("x_seconds", "Some latency.", LATENCY_BUCKETS, ["route"])
    for i, v in enumerate(values):
        route = ("stream_append", "stream_read")[i % 2]
        theirs.labels(route).observe(v)
        ours.labels(route).observe(v)
    assert _exposed(ours) == _exposed(theirs)
    plain_theirs = Histogram("y_seconds", "Unlabelled.", buckets=(0.5, 1.0), registry=None)
    plain_ours = LoopHistogram("y_seconds", "Unlabelled.", (0.5, 1.0))
    for v in values:
        plain_theirs.observe(v)
        plain_ours.observe(v)
    assert _exposed(plain_ours) == _exposed(plain_theirs)


async def test_an_sse_client_that_leaves_is_logged_with_what_it_was_sent(tmp_path: Path, local_store: StoreView) -> None:
    """Found by QA: the access line of an SSE answer whose client hung up said 0 bytes."""
    with Cluster(tmp_path, local_store, reader_args=JSON_LOGS) as c:
        url = f"{c.reader.url}/v1/stream/sse-left"
        async with aiohttp.ClientSession() as s:
            await create(s, url, TEXT)
            async with s.post(url, data=b"x" * 500, headers={"Content-Type": TEXT}) as r:
                assert r.status == 204
            async with s.get(url, params={"offset": "-1", "live": "sse"}, headers={"X-Request-Id": "sse-left-1"}) as r:
                assert r.status == 200
                await r.content.readuntil(b"x" * 100)  # some of it, then hang up
        wait_for(lambda: "sse-left-1" in c.reader.log_path.read_text(), 10, "the SSE access line")
    line = next(r for r in _json_lines(c.reader.log_path) if r.get("request_id") == "sse-left-1"
                and r["logger"] == "ds3.access")
    assert line["bytes"] >= 500, line
