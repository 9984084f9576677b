"""infra/nginx.conf in front of a real reader + ingester on moto S3: the cache collapses a
stampede of catch-up reads into one origin request per sealed chunk, keeps the origin's
immutable Cache-Control and ETag, and streams SSE unbuffered.

Needs the `nginx` binary (scripts/test installs it with apt when run as root). Without it the
test skips, except under CI=true, where it fails."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from shared import keys
from tests import procs
from tests.s3server import TEST_ENV, MotoS3

ROOT = Path(__file__).resolve().parent.parent
NGINX_CONF = ROOT / "infra" / "nginx.conf"
IMMUTABLE = "public, max-age=31536000, immutable"
START_URL_CACHE = "public, max-age=60, stale-while-revalidate=300"

SEAL_BYTES = 4096
MESSAGE = 1024  # 4 appends fill a chunk exactly: chunk k holds bytes [4096k, 4096(k+1))
SEALED_CHUNKS = 8
TAIL_MESSAGES = 2  # left in the ingester's WAL (--seal-age is far longer than the test)
CLIENTS = 100


# ---------------------------------------------------------------- nginx
def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx"):
        if os.access(p, os.X_OK):
            return p
    return None


def render_conf(template: str, port: int, reader_ports: list[int]) -> str:
    """infra/nginx.conf with the listen address and the upstream servers of this test; the
    rest (caching rules, paths relative to the prefix) is used as written."""
    conf, n = re.subn(r"^(\s*)listen 80;$", rf"\g<1>listen 127.0.0.1:{port};", template, flags=re.M)
    assert n == 1, "infra/nginx.conf: expected exactly one `listen 80;` line"
    servers = list(re.finditer(r"^(\s*)server reader\d+:4437;\n", conf, flags=re.M))
    assert servers, "infra/nginx.conf: expected `server readerN:4437;` lines in the upstream block"
    indent = servers[0].group(1)
    ours = "".join(f"{indent}server 127.0.0.1:{p};\n" for p in reader_ports)
    for m in reversed(servers[1:]):
        conf = conf[: m.start()] + conf[m.end() :]
    return conf[: servers[0].start()] + ours + conf[servers[0].end() :]


@dataclass
class Nginx:
    binary: str
    prefix: Path
    port: int
    reader_ports: list[int]
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.prefix / "nginx.log"

    def start(self, timeout: float = 10.0) -> Nginx:
        self.prefix.mkdir(parents=True, exist_ok=True)
        conf = self.prefix / "nginx.conf"
        conf.write_text(render_conf(NGINX_CONF.read_text(), self.port, self.reader_ports))
        directives = "daemon off;"
        if os.geteuid() == 0:
            # Workers would otherwise drop to `nobody`, who cannot enter pytest's 0700 tmp dirs.
            directives += " user root;"
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.popen = subprocess.Popen(
            [self.binary, "-p", f"{self.prefix}/", "-c", str(conf), "-g", directives],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"nginx exited early:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/nginx-health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx not ready in {timeout}s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)  # fast shutdown of master and workers
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


@pytest.fixture
def nginx_bin() -> str:
    found = nginx_binary()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nginx is not installed, and CI=true: scripts/test installs it (apt) when run as root")
        pytest.skip("nginx is not installed (scripts/test installs it with apt when run as root)")
    return found


# ---------------------------------------------------------------- the stack
@dataclass
class Stack:
    ingester: procs.Proc
    reader: procs.Proc
    nginx: Nginx


@pytest.fixture
def stack(tmp_path: Path, nginx_bin: str, s3_server: MotoS3, s3_bucket: str) -> Iterator[Stack]:
    store = f"s3://{s3_bucket}/streams"
    s3 = ("--store", store, "--s3-endpoint", s3_server.endpoint)
    ing = procs.ingester(
        tmp_path / "ingester" / "wal", *s3, "--seal-bytes", str(SEAL_BYTES), "--seal-age", "600",
        # SSE responses end after 3 s: the test's SSE connection is gone before teardown.
        "--long-poll-timeout", "5", "--sse-max-seconds", "3",
    )
    ing.env = dict(TEST_ENV)
    rd = procs.reader(tmp_path / "reader", ing.url, store, "--s3-endpoint", s3_server.endpoint,
                      "--long-poll-timeout", "5")
    rd.env = dict(TEST_ENV)
    ngx = Nginx(nginx_bin, tmp_path / "nginx", procs.free_port(), [rd.port])
    try:
        ing.start()
        rd.start()
        ngx.start()
        yield Stack(ing, rd, ngx)
    finally:
        ngx.stop()
        rd.stop()
        ing.stop()


# ---------------------------------------------------------------- helpers
async def metric(session: aiohttp.ClientSession, base: str, name: str) -> int:
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, flags=re.M)  # prometheus-client writes "3.0"
    assert m, f"{name} missing from {base}/metrics:\n{text}"
    return int(float(m.group(1)))


def chunk_keys(s3: MotoS3, bucket: str) -> list[str]:
    found = []
    for page in s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="streams/chunks/"):
        found += [o["Key"] for o in page.get("Contents", [])]
    return found


def has_object(s3: MotoS3, bucket: str, key: str) -> bool:
    return bool(s3.client().list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"))


@dataclass
class Seen:
    """What one catch-up client saw, per URL it fetched."""

    body: bytearray = field(default_factory=bytearray)
    cache: dict[str, str] = field(default_factory=dict)  # url -> X-Cache-Status
    cache_control: dict[str, str] = field(default_factory=dict)


async def catch_up(session: aiohttp.ClientSession, url: str) -> Seen:
    """Read from the start, following Stream-Next-Offset until Stream-Up-To-Date."""
    seen, offset = Seen(), "-1"
    for _ in range(100):
        u = f"{url}?offset={offset}"
        async with session.get(u) as r:
            assert r.status == 200, (u, r.status, await r.text())
            seen.body += await r.read()
            seen.cache[u] = r.headers.get("X-Cache-Status", "")
            seen.cache_control[u] = r.headers.get("Cache-Control", "")
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                return seen
    raise AssertionError("catch-up did not reach the tail in 100 requests")


# ---------------------------------------------------------------- infra files vs the CLI
def test_compose_matches_cli() -> None:
    """No Docker here: check that infra/docker-compose.yml only uses options the CLI has, and
    that nginx gets infra/nginx.conf and the readers it names."""
    import yaml  # type: ignore[import-untyped]

    from ds3.cli import main

    compose = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())
    services = compose["services"]
    roles: dict[str, list[str]] = defaultdict(list)
    described: dict[str, str] = {}
    for name, svc in services.items():
        cmd = svc.get("command")
        if not (cmd and cmd[0] == "ds3"):
            continue
        context = (ROOT / "infra" / svc["build"]["context"]).resolve()
        assert context == ROOT and (context / svc["build"]["dockerfile"]).is_file(), name
        if cmd[1] == "cluster":  # the one-shot that writes the description
            sub = main.commands["cluster"].commands[cmd[2]]  # type: ignore[attr-defined]
            cctx = sub.make_context(cmd[2], list(cmd[3:]))
            assert cctx.params["store"] == "s3://ds3/streams" and cctx.params["s3_endpoint"] == "http://minio:9000"
            described = dict(spec.split("=", 1) for spec in cctx.params["ingesters"])
            continue
        ctx = main.commands[cmd[1]].make_context(cmd[1], list(cmd[2:]))  # raises on unknown options
        assert ctx.params["host"] == "0.0.0.0" and ctx.params["port"] == 4437, name
        assert ctx.params["store"] == "s3://ds3/streams" and ctx.params["s3_endpoint"] == "http://minio:9000"
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(svc["environment"]), name
        roles[cmd[1]].append(name)
        if cmd[1] == "ingester":  # each one named in the description, at the URL it advertises
            assert described[ctx.params["ingester_id"]] == ctx.params["advertise_url"] == f"http://{name}:4437"
    assert roles["ingester"] == ["ingester1", "ingester2"] and len(roles["reader"]) >= 2
    assert sorted(described) == ["i1", "i2"]
    nginx = services["nginx"]
    assert "./nginx.conf:/etc/nginx/nginx.conf:ro" in nginx["volumes"]
    assert nginx["ports"] == ["127.0.0.1:4437:80"]  # this machine only: auth is off
    conf = NGINX_CONF.read_text()
    assert sorted(re.findall(r"^\s*server (reader\d+):4437;$", conf, flags=re.M)) == sorted(roles["reader"])


# ---------------------------------------------------------------- the test
@pytest.mark.slow
async def test_nginx_cache_in_front_of_reader(stack: Stack, s3_server: MotoS3, s3_bucket: str) -> None:
    t0 = time.monotonic()
    edge, origin = stack.nginx.url, stack.reader.url
    feed = "/v1/stream/feed"
    written = bytearray()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
    ) as session:
        # SSE first: its connection ends (--sse-max-seconds) while the rest runs.
        await check_sse(session, edge)
        await check_passthrough(session, edge)

        # Writes go through nginx too (uncached, bodies streamed).
        async with session.put(edge + feed, headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 201, await r.text()
        for i in range(SEALED_CHUNKS * SEAL_BYTES // MESSAGE + TAIL_MESSAGES):
            data = bytes([i % 251]) * (MESSAGE - 8) + f"{i:08d}".encode()
            async with session.post(edge + feed, data=data,
                                    headers={"Content-Type": "application/octet-stream"}) as r:
                assert r.status == 204, await r.text()
                assert r.headers.get("Stream-Next-Offset")
            written += data

        # Wait until the sealed chunks and the stream's descriptor are in the store (uploads
        # are asynchronous); the reader serves sealed history from those alone.
        descriptor = "streams/" + keys.descriptor_key("feed")
        deadline = time.monotonic() + 15
        while len(chunk_keys(s3_server, s3_bucket)) < SEALED_CHUNKS or not has_object(
            s3_server, s3_bucket, descriptor
        ):
            assert time.monotonic() < deadline, f"only {len(chunk_keys(s3_server, s3_bucket))} chunks sealed"
            await asyncio.sleep(0.1)
        assert len(chunk_keys(s3_server, s3_bucket)) == SEALED_CHUNKS

        sealed_before = await metric(session, origin, "ds3_reader_sealed_responses_total")
        forwarded_before = await metric(session, origin, "ds3_reader_ingester_requests_total")

        # The stampede: every client reads the whole stream from the start, at once.
        t_stampede = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*(catch_up(session, edge + feed) for _ in range(CLIENTS))), 30
        )
        t_stampede = time.monotonic() - t_stampede

        sealed_after = await metric(session, origin, "ds3_reader_sealed_responses_total")
        forwarded_after = await metric(session, origin, "ds3_reader_ingester_requests_total")

        for seen in results:
            assert bytes(seen.body) == bytes(written)
        # Every client walked the same chunk-aligned URLs: the sealed chunks, then the tail.
        urls = list(results[0].cache)
        assert all(list(s.cache) == urls for s in results)
        # Sealed chunks are immutable under their offset URLs; the start URL (offset=-1) serves
        # the first chunk too, but a re-created path keeps it, so it is cached only briefly.
        assert results[0].cache_control[urls[0]] == START_URL_CACHE
        sealed_urls = [u for u in urls[1:] if results[0].cache_control[u] == IMMUTABLE]
        assert len(sealed_urls) == SEALED_CHUNKS - 1, results[0].cache_control

        statuses: dict[str, Counter[str]] = defaultdict(Counter)
        for seen in results:
            for u, status in seen.cache.items():
                statuses[u][status] += 1
        origin_sealed = sealed_after - sealed_before
        print(f"\nnginx stampede: {CLIENTS} clients x {len(urls)} URLs in {t_stampede:.2f}s; "
              f"reader sealed responses {origin_sealed} for {SEALED_CHUNKS} chunks "
              f"({origin_sealed / SEALED_CHUNKS:.2f} per chunk); forwarded to ingester "
              f"{forwarded_after - forwarded_before}")
        for u in urls:
            print(f"  {u.split('?', 1)[1]:45} {dict(statuses[u])}")
        # At most one origin request per sealed chunk, whatever the interleaving.
        assert origin_sealed <= SEALED_CHUNKS
        for u in sealed_urls:
            assert statuses[u]["MISS"] <= 1, (u, statuses[u])
            assert statuses[u]["HIT"] + statuses[u]["MISS"] + statuses[u]["UPDATING"] == CLIENTS, (u, statuses[u])

        # A sealed chunk through nginx: the origin's immutable Cache-Control and strong ETag.
        chunk_url = sealed_urls[2]
        async with session.get(origin + chunk_url.removeprefix(edge)) as direct:
            direct_body = await direct.read()
        async with session.get(chunk_url) as cached:
            cached_body = await cached.read()
            assert cached.headers.get("X-Cache-Status") == "HIT"
        assert cached_body == direct_body
        assert direct.headers["Cache-Control"] == cached.headers["Cache-Control"] == IMMUTABLE
        etag = direct.headers["ETag"]
        assert etag.startswith('"') and cached.headers["ETag"] == etag
        for h in ("Stream-Next-Offset", "Content-Type", "Access-Control-Expose-Headers"):
            assert cached.headers.get(h) == direct.headers.get(h), h
        # nginx answers a matching If-None-Match itself, from the cache.
        async with session.get(chunk_url, headers={"If-None-Match": etag}) as r:
            assert r.status == 304
            assert r.headers.get("X-Cache-Status") == "HIT"
            assert r.headers.get("ETag") == etag

        # The last page is the unsealed tail, from the ingester: cacheable briefly, not immutable,
        # and also fetched from the origin once.
        tail = urls[-1]
        assert tail not in sealed_urls and "max-age=" in results[0].cache_control[tail]
        assert statuses[tail]["MISS"] <= 1, statuses[tail]
        # The ingester is asked for the tail page, and where the tail is by the last sealed
        # page's one origin request (it would say Stream-Up-To-Date if it ended there).
        assert forwarded_after - forwarded_before <= 2
        # Past the tail the page is empty: cacheable for --tail-max-age (1 s), so a crowd at the
        # tail costs one reader request a second; a client that got it goes live at that offset.
        async with session.get(tail) as r:
            end = f"{edge}{feed}?offset={r.headers['Stream-Next-Offset']}"
        t_end = time.monotonic()
        async with session.get(end) as r:
            assert r.status == 200 and await r.read() == b""
            assert r.headers["Cache-Control"] == "public, max-age=1"
            assert r.headers.get("X-Cache-Status") == "MISS"
        async with session.get(end) as r:
            assert r.status == 200 and await r.read() == b""
            if time.monotonic() - t_end < 0.9:
                assert r.headers.get("X-Cache-Status") == "HIT"
        await asyncio.sleep(1.1)
        async with session.post(edge + feed, data=b"after",
                                headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 204
        # Within about two seconds (nginx counts ages in whole seconds, and may answer one more
        # request with the stale page while it updates in the background) the new data shows;
        # a client given the empty page meanwhile goes live at the same offset, missing nothing.
        deadline = time.monotonic() + 3.5
        while True:
            async with session.get(end) as r:
                body = await r.read()
            if body == b"after" or time.monotonic() > deadline:
                break
            assert body == b""
            await asyncio.sleep(0.2)
        assert body == b"after"

    print(f"nginx test body took {time.monotonic() - t0:.1f}s")


async def check_sse(session: aiohttp.ClientSession, edge: str) -> None:
    """SSE through nginx: each append arrives as an event while the response stays open."""
    live = edge + "/v1/stream/live"
    async with session.put(live, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    async with session.get(f"{live}?offset=-1&live=sse",
                           timeout=aiohttp.ClientTimeout(total=None, sock_read=10)) as sse:
        assert sse.status == 200
        assert sse.headers["Content-Type"].startswith("text/event-stream")
        assert sse.headers.get("X-Cache-Status") is None  # never looked at the cache

        async def next_data() -> str:
            while True:
                line = await sse.content.readline()
                assert line, "SSE stream ended early"
                if line.startswith(b"data:") and not line.startswith(b"data:{"):
                    return line[5:].rstrip(b"\n").decode()

        # The first control event (up to date, empty stream) arrives before any data exists.
        line = await asyncio.wait_for(sse.content.readline(), 5)
        assert line.startswith(b"event: control"), line
        for i in range(3):
            sent = time.monotonic()
            async with session.post(live, data=f"event-{i}", headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 204
            assert await asyncio.wait_for(next_data(), 3) == f"event-{i}"
            print(f"SSE event {i} through nginx after {1000 * (time.monotonic() - sent):.0f} ms")
        assert not sse.content.at_eof()


async def check_passthrough(session: aiohttp.ClientSession, edge: str) -> None:
    """Writes, producer headers, HEAD and long-poll keep their meaning through nginx."""
    url = edge + "/v1/stream/misc"
    text = {"Content-Type": "text/plain"}
    async with session.put(url, headers=text) as r:
        assert r.status == 201
        assert r.headers["Location"].endswith("/v1/stream/misc")
    producer = {**text, "Producer-Id": "p1", "Producer-Epoch": "0", "Producer-Seq": "0"}
    async with session.post(url, data="one", headers=producer) as r:
        assert r.status == 200, await r.text()
        assert (r.headers["Producer-Epoch"], r.headers["Producer-Seq"]) == ("0", "0")
        tail = r.headers["Stream-Next-Offset"]
    async with session.post(url, data="one", headers=producer) as r:
        assert r.status == 204  # the retry is recognised as a duplicate
    # HEAD stays a HEAD upstream: stream metadata, never a cached GET page.
    for _ in range(2):
        async with session.head(url) as r:
            assert r.status == 200 and r.headers["Stream-Next-Offset"] == tail
            assert r.headers.get("X-Cache-Status") is None  # never stored: past the cache (and its lock)

    # A long-poll at the tail waits through nginx and gets the append.
    async def append_later() -> None:
        await asyncio.sleep(0.3)
        async with session.post(url, data="two", headers=text) as r:
            assert r.status == 204

    writer = asyncio.create_task(append_later())
    async with session.get(f"{url}?offset={tail}&live=long-poll") as r:
        assert r.status == 200 and await r.read() == b"two"
        assert r.headers.get("Stream-Cursor")
    await writer


# ---------------------------------------------------------------- live waits collapse at the edge
FOLLOWERS = 500
LIVE_MESSAGES = 20


async def follow(session: aiohttp.ClientSession, url: str, offset: str, want: int) -> list[bytes]:
    """A long-poll client (echoing the cursor it is given) until it has `want` messages."""
    got: list[bytes] = []
    cursor: str | None = None
    while len(got) < want:
        params = {"live": "long-poll", "offset": offset, **({"cursor": cursor} if cursor else {})}
        async with session.get(url, params=params) as r:
            assert r.status in (200, 204), (r.status, await r.text())
            body = await r.read()
            if r.status == 200 and body:
                got += [m for m in body.split(b"|") if m]
            offset = r.headers["Stream-Next-Offset"]
            cursor = r.headers.get("Stream-Cursor", cursor)
    return got


async def test_long_poll_crowd_collapses_at_the_edge(stack: Stack) -> None:
    """500 clients follow one stream through nginx while 20 messages are appended: each gets
    every message in order, and the reader sees at most 3 long-polls per message."""
    edge, origin = stack.nginx.url, stack.reader.url
    url = edge + "/v1/stream/crowd"
    route = 'ds3_http_requests_total{route="stream_long_poll",status="%s"}'
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.put(url, headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 201
            start = r.headers["Stream-Next-Offset"]
        before = {s: await metric_or_zero(session, origin, route % s) for s in ("200", "204")}
        followers = [asyncio.create_task(follow(session, url, start, LIVE_MESSAGES)) for _ in range(FOLLOWERS)]
        await asyncio.sleep(1.0)  # they are all waiting
        for i in range(LIVE_MESSAGES):
            async with session.post(url, data=f"m{i:02d}|".encode(), headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 204
            await asyncio.sleep(0.25)
        results = await asyncio.wait_for(asyncio.gather(*followers), 60)
        after = {s: await metric_or_zero(session, origin, route % s) for s in ("200", "204")}
    expected = [f"m{i:02d}".encode() for i in range(LIVE_MESSAGES)]
    assert all(r == expected for r in results)
    reader_polls = sum(after[s] - before[s] for s in after)
    print(f"\n{FOLLOWERS} long-poll followers, {LIVE_MESSAGES} messages: {reader_polls} reader long-polls "
          f"({reader_polls / LIVE_MESSAGES:.2f} per message)")
    assert reader_polls <= 3 * LIVE_MESSAGES, reader_polls


async def test_a_long_poll_from_now_is_not_served_from_the_cache(stack: Stack) -> None:
    """offset=now means the tail when the request comes: nginx kept the first subscriber's
    answer (the ingester sent it with max-age=60) and gave it at once to later subscribers
    of the same URL, old messages as if new (found by QA)."""
    url = stack.nginx.url + "/v1/stream/nowpoll"
    text = {"Content-Type": "text/plain"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.put(url, headers=text) as r:
            assert r.status == 201

        async def subscribe_then_append(message: str) -> bytes:
            async def append_later() -> None:
                await asyncio.sleep(0.5)
                async with session.post(url, data=message, headers=text) as r:
                    assert r.status == 204

            writer = asyncio.create_task(append_later())
            async with session.get(url, params={"offset": "now", "live": "long-poll"}) as r:
                assert r.status == 200
                assert r.headers.get("X-Cache-Status") != "HIT" and r.headers["Cache-Control"] == "no-store"
                body = await r.read()
            await writer
            return body

        assert await subscribe_then_append("first") == b"first"
        assert await subscribe_then_append("second") == b"second"


async def test_subscribers_from_now_at_once_all_get_the_next_message(stack: Stack) -> None:
    """Found by QA: behind the cache lock, 4 identical offset=now long-polls reached the reader
    one after another, each starting at a later tail: each got a different single message, and
    the last never saw the first three. They go past the cache and its lock now."""
    url = stack.nginx.url + "/v1/stream/nowcrowd"
    text = {"Content-Type": "text/plain"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.put(url, headers=text) as r:
            assert r.status == 201

        async def subscribe() -> bytes:
            async with session.get(url, params={"offset": "now", "live": "long-poll"}) as r:
                assert r.status == 200
                return await r.read()

        subscribers = [asyncio.create_task(subscribe()) for _ in range(4)]
        await asyncio.sleep(1.0)  # all parked
        for message in ("A", "B", "C"):
            async with session.post(url, data=message, headers=text) as r:
                assert r.status == 204
            await asyncio.sleep(0.5)
        assert await asyncio.gather(*subscribers) == [b"A"] * 4
        # HEADs (never stored) go past the lock too: at once, side by side
        heads = await asyncio.gather(*(session.head(url) for _ in range(6)))
        assert {h.status for h in heads} == {200} and {h.headers.get("X-Cache-Status") for h in heads} == {None}


async def test_an_expired_tail_page_is_not_served_stale(stack: Stack) -> None:
    """Found by QA: a catch-up page ending at the tail (max-age=1) was served 20 s later as it
    was (STALE: `proxy_cache_use_stale updating`), still Stream-Up-To-Date, a close missed."""
    url = stack.nginx.url + "/v1/stream/stalepage"
    text = {"Content-Type": "text/plain"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.put(url, data="v1;", headers=text) as r:
            assert r.status == 201
        async with session.get(url, params={"offset": "-1"}) as r:
            assert await r.read() == b"v1;"
        await asyncio.sleep(2.5)  # past its max-age
        async with session.post(url, data="v2;", headers={**text, "Stream-Closed": "true"}) as r:
            assert r.status == 204
        async with session.get(url, params={"offset": "-1"}) as r:
            assert r.headers.get("X-Cache-Status") != "STALE", dict(r.headers)
            assert await r.read() == b"v1;v2;" and r.headers.get("Stream-Closed") == "true"


async def metric_or_zero(session: aiohttp.ClientSession, base: str, name: str) -> int:
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, flags=re.M)
    return int(float(m.group(1))) if m else 0


async def test_buckets_streams_are_cached_and_readyz_is_not_public(
        stack: Stack, s3_server: MotoS3, s3_bucket: str) -> None:
    """A bucket's stream (/v1/buckets/{b}/{s}) is cached like /v1/stream/... (infra/nginx.conf
    routed only the latter to the cache); the readers' /readyz, which names the store and the
    ingesters, is not served to the public (found by QA)."""
    edge = stack.nginx.url
    url = edge + "/v1/buckets/bkt1/s"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), auto_decompress=False) as session:
        async with session.put(edge + "/v1/buckets/bkt1") as r:
            assert r.status == 201, await r.text()
        async with session.put(url, headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 201, await r.text()
        before = len(chunk_keys(s3_server, s3_bucket))
        n = 2 * SEAL_BYTES // MESSAGE + 2  # two sealed chunks and a tail
        for i in range(n):
            async with session.post(url, data=bytes([i]) * MESSAGE,
                                    headers={"Content-Type": "application/octet-stream"}) as r:
                assert r.status == 204, await r.text()
        deadline = time.monotonic() + 15
        while len(chunk_keys(s3_server, s3_bucket)) < before + 2:
            assert time.monotonic() < deadline, "no chunk sealed"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # (the reader's memory of chunks missing from the store: a second)
        first = await catch_up(session, url)
        again = await catch_up(session, url)
        assert again.body == first.body and len(first.body) == n * MESSAGE
        # the start URL (-1: the first chunk, max-age 60) and the second chunk (immutable) came
        # from the cache the second time
        sealed = [u for u, cc in first.cache_control.items() if "immutable" in cc]
        assert len(sealed) == 1, first.cache_control
        assert again.cache[sealed[0]] == "HIT" and again.cache[url + "?offset=-1"] == "HIT", again.cache
        async with session.get(edge + "/readyz") as r:
            assert r.status == 404
        async with session.get(stack.reader.url + "/readyz") as r:
            assert r.status == 200  # (the readers' own port still answers it)
