"""The reader's relay of sealed chunks (a local store's file is sent as a view of its mapping,
an S3 body is read ahead while the client drains): clients that leave mid-body cost nothing
lasting, whole responses stay byte-exact, and HEAD (answered by the ingester) agrees with a
sealed GET."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from tests.cluster import TIMEOUT, Cluster, StoreView, append, create, read_pages, sealed_end, wait_for

OCTET = "application/octet-stream"
JSON = "application/json"


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreView:
    if request.param == "s3":
        return StoreView.s3_store(request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"))
    return StoreView.local(tmp_path / "objects")


async def _seal(c: Cluster, s: aiohttp.ClientSession, name: str, ctype: str, bodies: list[bytes]) -> str:
    url = f"{c.ingester.url}/v1/stream/{name}"
    await create(s, url, ctype)
    tail = ""
    for b in bodies:
        tail = await append(s, url, b, ctype)
    async with s.post(url, headers={"Stream-Closed": "true", "Content-Type": ctype}) as r:
        assert r.status in (200, 204)
    end = int(tail.split("_")[1])
    await asyncio.to_thread(wait_for, lambda: sealed_end(c.store, c.store.uid(name)) == end, 30, "sealed")
    return tail


async def test_clients_leaving_mid_body_leave_the_reader_whole(tmp_path: Path, store: StoreView) -> None:
    data = [os.urandom(256 * 1024) for _ in range(12)]  # 3 MiB: several 1 MiB relay pieces per chunk
    with Cluster(tmp_path, store, seal_bytes=4 * 1024 * 1024) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            await _seal(c, s, "big", OCTET, data)
        url = "/v1/stream/big?offset=-1"
        for _ in range(25):  # more than any pool: a leaked store connection or map would show
            reader, writer = await asyncio.open_connection("127.0.0.1", c.reader.port)
            writer.write(f"GET {url} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            await writer.drain()
            got = await reader.read(64 * 1024)
            assert got.startswith(b"HTTP/1.1 200")
            writer.transport.abort()  # gone mid-body
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            pages = await read_pages(s, f"{c.reader.url}/v1/stream/big")
        assert b"".join(p.body for p in pages) == b"".join(data)
        log = c.reader.log_path.read_text()
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


async def test_sealed_json_and_binary_reads_are_byte_exact_from_any_boundary(tmp_path: Path, store: StoreView) -> None:
    msgs = [b'{"n":%d,"pad":"%s"}' % (i, b"x" * (i * 37 % 900)) for i in range(400)]
    with Cluster(tmp_path, store, seal_bytes=64 * 1024) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            await _seal(c, s, "j", JSON, [b"[" + b",".join(msgs[i:i + 40]) + b"]" for i in range(0, 400, 40)])
            pages = await read_pages(s, f"{c.reader.url}/v1/stream/j")
            got = [m for p in pages for m in p.body[1:-1].split(b',{"n"')]
            assert b",".join(p.body[1:-1] for p in pages if len(p.body) > 2) == b",".join(msgs)
            assert len(got) >= 1
            # start at every page boundary the reader gave: the rest is exact too
            for p in pages[:-1]:
                rest = await read_pages(s, f"{c.reader.url}/v1/stream/j", p.offset)
                joined = b",".join(r.body[1:-1] for r in rest if len(r.body) > 2)
                assert b",".join(msgs).endswith(joined) and joined


async def test_head_through_the_reader_agrees_with_a_sealed_get(tmp_path: Path, store: StoreView) -> None:
    with Cluster(tmp_path, store, seal_bytes=4096) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            tail = await _seal(c, s, "h", OCTET, [os.urandom(3000) for _ in range(5)])
            async with s.head(f"{c.reader.url}/v1/stream/h") as r:
                assert r.status == 200 and await r.read() == b""
                assert r.headers["Stream-Next-Offset"] == tail
                assert r.headers["Content-Type"] == OCTET
                assert r.headers.get("Stream-Closed") == "true"
            async with s.head(f"{c.ingester.url}/v1/stream/h") as direct:
                assert {k: direct.headers.get(k) for k in ("Stream-Next-Offset", "Content-Type", "Stream-Closed")} \
                    == {k: r.headers.get(k) for k in ("Stream-Next-Offset", "Content-Type", "Stream-Closed")}
            pages = await read_pages(s, f"{c.reader.url}/v1/stream/h")
            assert pages[-1].next_offset == tail
