"""Per-client limits and slow clients: write and create rate limits (429 + Retry-After),
live connections per client, X-Forwarded-For only from trusted proxies, a reader limiting
its own clients (the ingester exempts it), a slowloris body and a slow request head cut off
without delaying anyone else, and SSE readers that stop reading dropped while others keep
up. In-process ingesters (aiohttp TestServer) where a request cannot wedge the server, real
processes elsewhere."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from shared.config import AuthConfig, LimitsConfig
from shared.limits import LiveCounts, TokenBuckets, client_address, client_identity, parse_networks
from tests.cluster import Cluster, StoreView, wait_for
from tests.procs import Proc, ingester

S = "/v1/stream/"
TEXT = {"Content-Type": "text/plain"}
TIMEOUT = aiohttp.ClientTimeout(total=30)
TOKENS = json.dumps([
    {"token": "alice-token-0123456789", "sub": "alice", "read": ["*"], "write": ["*"]},
    {"token": "bob-token-0123456789ab", "sub": "bob", "read": ["*"], "write": ["*"]},
])
ALICE = {"Authorization": "Bearer alice-token-0123456789"}
BOB = {"Authorization": "Bearer bob-token-0123456789ab"}
INTERNAL = "internal-token-for-tests-0123456789"

MakeClient = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def make_client(make_ingester: MakeClient, tmp_path: Path) -> MakeClient:
    """An in-process ingester; keyword arguments are LimitsConfig fields, `auth` an AuthConfig."""
    made = [0]

    async def make(auth: AuthConfig | None = None, **limits: Any) -> TestClient[Any, Any]:
        made[0] += 1
        return await make_ingester(data_dir=tmp_path / f"data{made[0]}", long_poll_timeout=3,
                                   auth=auth or AuthConfig(), limits=LimitsConfig(**limits))

    return make


async def _status(resp: aiohttp.ClientResponse) -> int:
    await resp.read()
    return resp.status


async def test_write_rate_limit_per_client(make_client: MakeClient) -> None:
    c = await make_client(AuthConfig(tokens=TOKENS), write_rate=0.5, write_burst=5, create_burst=100)
    assert await _status(await c.put(S + "w", headers={**TEXT, **ALICE})) == 201
    for _ in range(4):  # the PUT took one of the 5
        assert await _status(await c.post(S + "w", data=b"x", headers={**TEXT, **ALICE})) == 204
    r = await c.post(S + "w", data=b"x", headers={**TEXT, **ALICE})
    text = await r.text()
    assert r.status == 429, text
    assert 1 <= int(r.headers["Retry-After"]) <= 2
    assert "too many writes" in text and "0.5 a second" in text
    assert r.headers["Cache-Control"] == "no-store"
    # another client (token subject) has its own bucket; reads are not rate limited
    assert await _status(await c.post(S + "w", data=b"y", headers={**TEXT, **BOB})) == 204
    for _ in range(20):
        assert await _status(await c.get(S + "w", params={"offset": "-1"}, headers=ALICE)) == 200
    # refusals changed nothing: alice's 5 writes and bob's one are all there is
    assert await (await c.get(S + "w", params={"offset": "-1"})).read() == b"xxxxy"
    await asyncio.sleep(2.1)  # 0.5 tokens a second: one is back
    assert await _status(await c.post(S + "w", data=b"x", headers={**TEXT, **ALICE})) == 204


async def test_create_rate_limit(make_client: MakeClient) -> None:
    c = await make_client(create_rate=0.5, create_burst=3, trusted_proxies=())
    for i in range(3):
        assert await _status(await c.put(S + f"c{i}", headers=TEXT)) == 201
    r = await c.put(S + "c3", headers=TEXT)
    assert r.status == 429 and "too many creates" in await r.text()
    assert int(r.headers["Retry-After"]) >= 1
    assert await _status(await c.request("PUT", "/v1/buckets/abcd")) == 429, "bucket creation counts too"
    # appends are writes, not creates
    assert await _status(await c.post(S + "c0", data=b"x", headers=TEXT)) == 204
    assert await _status(await c.head(S + "c3")) == 404


async def test_forwarded_for_counts_only_from_trusted_proxies(make_client: MakeClient) -> None:
    untrusted = await make_client(write_burst=2, write_rate=0.01, trusted_proxies=())
    trusted = await make_client(write_burst=2, write_rate=0.01, trusted_proxies=("127.0.0.0/8",))
    for c in (untrusted, trusted):
        assert await _status(await c.put(S + "f", headers={**TEXT, "X-Forwarded-For": "203.0.113.1"})) == 201
        assert await _status(await c.post(S + "f", data=b"x", headers={**TEXT, "X-Forwarded-For": "203.0.113.1"})) == 204
    # a client claiming another address: believed only behind a trusted proxy
    other = {**TEXT, "X-Forwarded-For": "203.0.113.2"}
    assert await _status(await untrusted.post(S + "f", data=b"x", headers=other)) == 429
    assert await _status(await trusted.post(S + "f", data=b"x", headers=other)) == 204
    # the right-most untrusted hop is the client: a spoofed left part changes nothing
    spoofed = {**TEXT, "X-Forwarded-For": "198.51.100.9, 203.0.113.1"}
    assert await _status(await trusted.post(S + "f", data=b"x", headers=spoofed)) == 429
    # a trusted proxy's own requests (no X-Forwarded-For: a reader's upstream subscriptions,
    # a local client) are not limited; elsewhere the peer's address is the client
    for _ in range(5):
        assert await _status(await trusted.post(S + "f", data=b"x", headers=TEXT)) == 204
    assert await _status(await untrusted.post(S + "f", data=b"x", headers=TEXT)) == 429


async def test_live_connections_per_client(make_client: MakeClient) -> None:
    c = await make_client(AuthConfig(tokens=TOKENS), max_live_per_client=2)
    assert await _status(await c.put(S + "l", headers={**TEXT, **ALICE})) == 201
    tail = (await c.head(S + "l")).headers["Stream-Next-Offset"]
    params = {"offset": tail, "live": "long-poll"}
    polls = [asyncio.create_task(c.get(S + "l", params=params, headers=ALICE)) for _ in range(2)]
    await asyncio.sleep(0.3)
    r = await c.get(S + "l", params=params, headers=ALICE)
    assert r.status == 429, await r.text()
    assert "too many live connections" in await r.text() and int(r.headers["Retry-After"]) >= 1
    sse = await c.get(S + "l", params={"offset": tail, "live": "sse"}, headers=ALICE)
    assert sse.status == 429
    # others are not affected, and plain reads never count
    assert await _status(await c.get(S + "l", params={"offset": "-1"}, headers=ALICE)) == 200
    other = asyncio.create_task(c.get(S + "l", params=params, headers=BOB))
    await asyncio.sleep(0.2)
    assert await _status(await c.post(S + "l", data=b"wake", headers={**TEXT, **BOB})) == 204
    for t in [*polls, other]:
        assert await _status(await t) == 200
    # the slots are free again
    again = await c.get(S + "l", params={"offset": tail, "live": "long-poll"}, headers=ALICE)
    assert again.status == 200


# ---------------------------------------------------------------- real processes


def _limited_cluster(tmp_path: Path, *, reader_args: list[str], ingester_args: list[str]) -> Cluster:
    c = Cluster(tmp_path, StoreView.local(tmp_path / "objects"), ingester_args=ingester_args,
                reader_args=reader_args)
    for p in (c.ingester, c.reader):
        p.env["DS3_INTERNAL_TOKEN"] = INTERNAL
    return c


async def test_reader_limits_its_clients_and_the_ingester_exempts_it(tmp_path: Path) -> None:
    """The reader enforces the limits per client; the ingester, which sees every client through
    the reader, does not limit requests that carry the internal token."""
    with _limited_cluster(
        tmp_path,
        reader_args=["--write-rate", "0.01", "--write-burst", "6", "--max-live-per-client", "2",
                     "--trusted-proxies", "none"],
        ingester_args=["--write-rate", "0.01", "--write-burst", "2", "--max-live-per-client", "1",
                       "--trusted-proxies", "none"],
    ) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = c.reader.url + S + "r"
            async with s.put(url, headers=TEXT) as r:
                assert r.status == 201
            for _ in range(5):  # more than the ingester's own burst of 2
                async with s.post(url, data=b"x", headers=TEXT) as r:
                    assert r.status == 204, await r.text()
            async with s.post(url, data=b"x", headers=TEXT) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            # straight to the ingester, the same client is limited by the ingester
            for expect in (201, 204, 429):
                async with s.request("PUT" if expect == 201 else "POST", c.ingester.url + S + "i",
                                     data=b"x", headers=TEXT) as r:
                    assert r.status == expect, await r.text()
            # live connections: 2 through the reader (the ingester's cap of 1 does not apply to it)
            async with s.head(url) as r:
                tail = r.headers["Stream-Next-Offset"]
            first = await s.get(url, params={"offset": tail, "live": "sse"})
            second = asyncio.create_task(s.get(url, params={"offset": tail, "live": "long-poll"}))
            try:
                assert first.status == 200
                await asyncio.sleep(0.3)
                async with s.get(url, params={"offset": tail, "live": "long-poll"}) as third:
                    assert third.status == 429, third.status
                    assert "too many live connections" in await third.text()
            finally:
                first.close()
                second.cancel()


def _raw_connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    return sock


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything until EOF / reset (True), or what came before `timeout` (False)."""
    sock.settimeout(0.2)
    got = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            piece = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return bytes(got), True
        if not piece:
            return bytes(got), True
        got += piece
    return bytes(got), False


async def _latencies(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for _ in range(n):
            t = time.monotonic()
            async with s.post(url, data=b"ok", headers=TEXT) as r:
                assert r.status == 204
            out.append(time.monotonic() - t)
            await asyncio.sleep(0.05)
    return out


def _ingester(tmp_path: Path, *args: str) -> Proc:
    return ingester(tmp_path / "data", "--log-level", "info", "--long-poll-timeout", "3", *args)


async def test_slowloris_body_is_cut_off_without_delaying_others(tmp_path: Path) -> None:
    p = _ingester(tmp_path, "--body-timeout", "1.5").start()
    try:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            for name in ("slow", "fast"):
                async with s.put(f"{p.url}{S}{name}", headers=TEXT) as r:
                    assert r.status == 201
        sock = _raw_connect(p.port)
        sock.sendall(b"POST /v1/stream/slow HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        started = time.monotonic()

        async def trickle() -> None:
            for _ in range(40):  # a byte every 0.1 s: 4 s if nobody stops it
                try:
                    sock.send(b"z")
                except OSError:
                    return
                await asyncio.sleep(0.1)

        trickling = asyncio.create_task(trickle())
        latencies = await _latencies(f"{p.url}{S}fast", 15)
        assert max(latencies) < 0.5, f"other clients were delayed: {latencies}"
        data, closed = await asyncio.to_thread(_read_until_closed, sock, 5)
        elapsed = time.monotonic() - started
        trickling.cancel()
        sock.close()
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert closed and elapsed < 4.5, (closed, elapsed)
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(f"{p.url}{S}slow",
                                                                      params={"offset": "-1"}) as r:
            assert await r.read() == b"", "nothing of the cut-off body was appended"
    finally:
        p.stop()


async def test_slow_request_head_is_cut_off(tmp_path: Path) -> None:
    p = _ingester(tmp_path, "--keepalive-timeout", "2").start()
    try:
        sock = _raw_connect(p.port)
        started = time.monotonic()
        sock.sendall(b"GET /v1/stream/x HTTP/1.1\r\n")

        def trickle_head() -> bool:
            for _ in range(100):  # a header byte every 0.1 s, never finishing the head
                try:
                    sock.send(b"X")
                except OSError:
                    return True
                sock.settimeout(0.1)
                try:
                    if sock.recv(1024) == b"":
                        return True
                except TimeoutError:
                    pass
                except ConnectionResetError:
                    return True
            return False

        closed = await asyncio.to_thread(trickle_head)
        elapsed = time.monotonic() - started
        sock.close()
        assert closed and elapsed < 4, (closed, elapsed)
    finally:
        p.stop()


async def _sse_collect(url: str, want: int) -> float:
    """Read an SSE stream until `want` bytes of data lines arrived; the seconds it took."""
    started = time.monotonic()
    got = 0
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(
        url, params={"offset": "-1", "live": "sse"}
    ) as r:
        assert r.status == 200
        async for piece in r.content.iter_any():
            got += piece.count(b"z")  # the data's byte; no control event has one
            if got >= want:
                return time.monotonic() - started
    raise AssertionError(f"the SSE stream ended after {got} of {want} bytes")


@pytest.mark.parametrize("via", ["ingester", "reader"])
async def test_sse_reader_that_stops_reading_is_dropped(tmp_path: Path, via: str) -> None:
    """A client that opens SSE and never reads fills its buffers; it does not slow down a
    client reading the same stream or anyone writing, and it is disconnected once it has
    taken nothing for --send-timeout."""
    size, pieces = 1 << 20, 12
    limits = ["--send-timeout", "1", "--log-level", "info"]
    with _limited_cluster(tmp_path, reader_args=limits, ingester_args=limits) as c:
        proc = c.reader if via == "reader" else c.ingester
        url = f"{proc.url}{S}firehose"
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.put(url, headers=TEXT) as r:
                assert r.status == 201
            stuck = _raw_connect(proc.port, rcvbuf=4096)
            stuck.sendall(b"GET /v1/stream/firehose?offset=-1&live=sse HTTP/1.1\r\nHost: x\r\n\r\n")
            reading = asyncio.create_task(_sse_collect(url, size * pieces))
            await asyncio.sleep(0.2)
            for _ in range(pieces):
                t = time.monotonic()
                async with s.post(url, data=b"z" * size, headers=TEXT) as r:
                    assert r.status == 204
                assert time.monotonic() - t < 2, "a writer was delayed"
            took = await asyncio.wait_for(reading, 20)
            assert took < 15
            wait_for(lambda: "dropping a client that took nothing" in proc.log_path.read_text(), 10,
                     "the stuck client to be dropped")
            data, closed = await asyncio.to_thread(_read_until_closed, stuck, 10)
            stuck.close()
            assert closed, "the stuck connection is still open"
            assert len(data) < size * pieces, "the stuck client got everything: it was not stuck"


# ---------------------------------------------------------------- the rules, unit by unit


def test_token_buckets() -> None:
    b = TokenBuckets(rate=2.0, burst=3)
    assert [b.take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("a", 0.0) == pytest.approx(0.5)
    assert b.take("b", 0.0) == 0.0, "clients have their own buckets"
    assert b.take("a", 0.5) == 0.0  # one token back after 0.5 s at 2/s
    assert b.take("a", 0.5) == pytest.approx(0.5)
    assert b.take("a", 100.0) == 0.0 and b.take("a", 100.0) == 0.0 and b.take("a", 100.0) == 0.0
    assert b.take("a", 100.0) > 0, "never more than the burst saved up"
    assert TokenBuckets(rate=0, burst=1).take("a", 0.0) == 0.0, "rate 0: no limit"


def test_token_buckets_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import shared.limits

    monkeypatch.setattr(shared.limits, "MAX_CLIENTS", 100)
    b = TokenBuckets(rate=1.0, burst=2)
    for i in range(1000):
        b.take(f"c{i}", float(i))
    assert len(b) <= 100


def test_live_counts() -> None:
    live = LiveCounts(2)
    assert live.acquire("a") and live.acquire("a") and not live.acquire("a")
    assert live.acquire("b")
    live.release("a")
    assert live.acquire("a") and live.count("a") == 2
    live.release("a")
    live.release("a")
    assert live.count("a") == 0
    assert all(LiveCounts(0).acquire("a") for _ in range(1000)), "cap 0: no cap"


def test_client_address() -> None:
    trusted = parse_networks(["10.0.0.0/8", "127.0.0.1"])
    assert client_address("203.0.113.5", "1.2.3.4", trusted) == "203.0.113.5", "untrusted peer: XFF ignored"
    assert client_address("10.1.1.1", "1.2.3.4", trusted) == "1.2.3.4"
    assert client_address("10.1.1.1", "6.6.6.6, 1.2.3.4, 10.2.2.2", trusted) == "1.2.3.4"
    assert client_address("10.1.1.1", "10.3.3.3, 10.2.2.2", trusted) == "10.3.3.3"
    assert client_address("10.1.1.1", "garbage", trusted) == "10.1.1.1"
    assert client_address("10.1.1.1", None, trusted) is None, "a trusted proxy's own request"
    assert client_address("203.0.113.5", None, trusted) == "203.0.113.5"
    assert client_address(None, None, trusted) == "unknown"
    assert client_identity("sub:alice", "1.2.3.4") == "sub:alice"
    assert client_identity("sub:alice", None) == "sub:alice"
    assert client_identity(None, "1.2.3.4") == "ip:1.2.3.4"
    assert client_identity(None, None) is None
