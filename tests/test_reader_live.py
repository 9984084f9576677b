"""The reader's live paths with real processes: long-poll and SSE from every kind of start
offset answer what the ingester alone answers; long-poll waiters share the reader's one
upstream subscription per stream; a client that leaves does not take a shared upstream
request down with it; a fork request names one source."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.cluster import (
    TIMEOUT,
    Cluster,
    StoreView,
    append,
    create,
    get_page,
    read_sse_until,
    reader_metrics,
)
from tests.procs import reader
from tests.tcpgate import TcpGate

OCTET = "application/octet-stream"
TEXT = "text/plain"
JSON = "application/json"
UPSTREAM = "ds3_reader_ingester_requests_total"


@pytest.fixture
def local_store(tmp_path: Path) -> StoreView:
    return StoreView.local(tmp_path / "objects")


async def raw_get(port: int, target: str) -> tuple[int, bytes]:
    """One GET on a connection of its own, answered or not: (status, body); (0, b"") when the
    server closed the connection without an answer."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(f"GET {target} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode())
        raw = await r.read()
    finally:
        w.close()
    if not raw:
        return 0, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# ---------------------------------------------------------------- one client leaving (issue 12 item 4)
async def test_a_client_leaving_does_not_drop_the_requests_collapsed_with_its_own(
    tmp_path: Path, local_store: StoreView
) -> None:
    """Three clients ask for the same tail page through a slow link to the ingester; the one
    whose request went upstream disconnects while it waits. The other two get their page."""
    with Cluster(tmp_path, local_store) as c:
        gate = TcpGate(("127.0.0.1", c.ingester.port)).start()
        slow = reader(tmp_path / "slow-reader", gate.url, local_store.url, "--log-level", "warning")
        try:
            slow.start()
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                ing = f"{c.ingester.url}/v1/stream/collapse"
                await create(s, ing, OCTET)
                tail = await append(s, ing, b"first", OCTET)
                await append(s, ing, b"second", OCTET)
                url = f"{slow.url}/v1/stream/collapse"
                gate.delay = 1.0  # every request to the ingester now takes a second to arrive

                async def leaver() -> None:
                    async with aiohttp.ClientSession() as own:  # its own connection, closed on leaving
                        with pytest.raises(TimeoutError):
                            async with asyncio.timeout(0.4):
                                await get_page(own, url, tail)

                leaving = asyncio.create_task(leaver())
                await asyncio.sleep(0.15)  # the leaver's request is the one upstream

                async def follower() -> tuple[int, bytes]:
                    # a bare HTTP/1.1 exchange: aiohttp's client would retry a dropped request
                    return await raw_get(slow.port, f"/v1/stream/collapse?offset={tail}")

                followers = [asyncio.create_task(follower()) for _ in range(2)]
                await leaving
                pages = await asyncio.wait_for(asyncio.gather(*followers), 15)
                assert pages == [(200, b"second")] * 2
                assert reader_metrics(slow.url)["ds3_reader_collapsed_total"] == 2
        finally:
            slow.stop()
            gate.stop()


# ---------------------------------------------------------------- Stream-Forked-From (issue 12 item 2d)
async def test_a_fork_request_with_two_sources_is_refused(tmp_path: Path, local_store: StoreView) -> None:
    with Cluster(tmp_path, local_store) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            for name in ("a", "b"):
                await create(s, f"{c.reader.url}/v1/stream/{name}", TEXT)
                await append(s, f"{c.reader.url}/v1/stream/{name}", name.encode(), TEXT)
            async with s.put(f"{c.reader.url}/v1/buckets/bkt1") as r:
                assert r.status == 201, await r.text()
            headers = CIMultiDict([("Content-Type", TEXT), ("Stream-Forked-From", "/v1/stream/a"),
                                   ("Stream-Forked-From", "/v1/stream/b")])
            for url in (f"{c.reader.url}/v1/stream/fork", f"{c.reader.url}/v1/buckets/bkt1/fork"):
                async with s.put(url, headers=headers) as r:
                    assert r.status == 400, (url, r.status, await r.text())
                    assert "Stream-Forked-From" in await r.text()
                async with s.head(url) as r:
                    assert r.status == 404, (url, r.status)
