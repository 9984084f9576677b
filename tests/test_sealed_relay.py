"""The reader's relay of sealed chunks (a local store's file is sent as a view of its mapping,
an S3 body is asked for ahead and spliced to the client): clients that leave mid-body cost nothing
lasting, whole responses stay byte-exact, and HEAD (answered by the ingester) agrees with a
sealed GET."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from reader.relay import NEXT_PAGE_TTL, Body, NextPages, PageKey
from shared.errors import ObjectStoreUnavailable
from tests import procs
from tests.cluster import (
    TIMEOUT,
    Cluster,
    StoreView,
    append,
    create,
    get_page,
    position,
    read_pages,
    reader_metrics,
    sealed_end,
    wait_for,
)
from tests.s3server import MotoS3
from tests.tcpgate import TcpGate

OCTET = "application/octet-stream"
JSON = "application/json"



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
        fds = _fds(c.reader)
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
        # nothing held for the clients that left (store sockets, pipes, maps); pages asked for
        # ahead are dropped after NEXT_PAGE_TTL
        await asyncio.to_thread(wait_for, lambda: _fds(c.reader) <= fds + 2, NEXT_PAGE_TTL + 10,
                                "the reader's descriptors back to what they were")
        log = c.reader.log_path.read_text()
        assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def _fds(proc: procs.Proc) -> int:
    assert proc.popen is not None
    return len(os.listdir(f"/proc/{proc.popen.pid}/fd"))


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


async def test_a_store_failing_mid_body_cuts_the_response_and_the_reader_goes_on(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    """The reader reads the store through a gate; the gate is cut while a page's body is on its
    way (the client reads slowly): the client gets a cut body and the connection closed, not a
    hang; the reader logs no traceback, leaks no descriptor, and serves again once the store is
    back."""
    store, gate = gated_s3
    data = [os.urandom(512 * 1024) for _ in range(24)]  # 12 MiB: one page, more than the buffers hold
    with Cluster(tmp_path, store, seal_bytes=16 * 1024 * 1024) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            await _seal(c, s, "cut", OCTET, data)
        gated = procs.reader(tmp_path / "gated", c.ingester.url, store.url, *store.server_args(gate.url)[2:],
                             "--log-level", "warning").start()
        try:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:  # warm: descriptor and head cached
                pages = await read_pages(s, f"{gated.url}/v1/stream/cut")
            assert b"".join(p.body for p in pages) == b"".join(data)
            fds = len(os.listdir(f"/proc/{gated.popen.pid}/fd")) if gated.popen else 0
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # a slow reader
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, ("127.0.0.1", gated.port))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(b"GET /v1/stream/cut?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
            got = len(await reader.read(64 * 1024))
            await asyncio.to_thread(gate.down)  # the store's connections are reset mid-body
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 20):  # ends, not hangs
                got += len(chunk)
            assert 0 < got < length
            writer.close()
            await asyncio.to_thread(gate.up)
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                pages = await read_pages(s, f"{gated.url}/v1/stream/cut")
            assert b"".join(p.body for p in pages) == b"".join(data)
            if gated.popen:  # nothing held for the cut response (a store socket, a pipe)
                await asyncio.to_thread(wait_for, lambda: len(os.listdir(f"/proc/{gated.popen.pid}/fd")) <= fds + 2,
                                        10, "the cut response's descriptors closed")
            log = gated.log_path.read_text()
            assert "the response is cut" in log
            assert "Traceback" not in log and "ERROR" not in log and "never retrieved" not in log, log[-3000:]
        finally:
            gated.stop()


async def test_a_catch_up_on_s3_takes_each_next_page_asked_for_ahead(tmp_path: Path, s3_server: MotoS3,
                                                                     s3_bucket: str) -> None:
    store = StoreView.s3_store(s3_server, s3_bucket)
    with Cluster(tmp_path, store, seal_bytes=64 * 1024) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            data = [os.urandom(20_000) for _ in range(20)]
            await _seal(c, s, "ahead", OCTET, data)
            url, offset, pages = f"{c.reader.url}/v1/stream/ahead", "-1", []
            for _ in range(100):  # a client that takes its time between pages
                pages.append(p := await get_page(s, url, offset))
                assert p.status == 200
                if p.up_to_date:
                    break
                offset = p.next_offset
                await asyncio.sleep(0.05)
            slow = reader_metrics(c.reader.url)
            again = await read_pages(s, url)  # the descriptor cached: its first page is asked early too
        assert b"".join(p.body for p in pages) == b"".join(data) == b"".join(p.body for p in again)
        sealed = slow["ds3_reader_sealed_responses_total"]
        assert sealed >= 5
        # every sealed page but the first was asked of the store before its client asked for it
        assert slow["ds3_reader_next_pages_started_total"] == slow["ds3_reader_next_pages_taken_total"] == sealed - 1
        m = reader_metrics(c.reader.url)  # a client asking at once may come first: best effort
        assert m["ds3_reader_next_pages_taken_total"] <= m["ds3_reader_next_pages_started_total"] \
            <= m["ds3_reader_sealed_responses_total"] - 1


# ---------------------------------------------------------------- NextPages, in process
class _Body:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.closed = False

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        if not self.pieces:
            raise StopAsyncIteration
        return self.pieces.pop(0)

    async def aclose(self) -> None:
        self.closed = True


async def test_next_pages_are_taken_once_and_dropped_when_not() -> None:
    opened: dict[PageKey, _Body] = {}

    async def open_(key: PageKey) -> Body:
        opened[key] = _Body([b"x" * key[1]])
        return opened[key]

    def find(key: PageKey) -> Callable[[], Awaitable[PageKey | None]]:
        async def f() -> PageKey | None:
            return key
        return f

    pages = NextPages(ttl=0.2, limit=2)
    for i in (1, 2, 3):
        pages.start(find(("k", i, 10)), open_)
    await asyncio.sleep(0.05)
    assert len(pages) == 2 and pages.started == 3
    assert pages.take(("k", 1, 10)) is None  # pushed out by newer ones, its body closed
    await asyncio.sleep(0)
    assert opened[("k", 1, 10)].closed
    relay = pages.take(("k", 2, 10))
    assert relay is not None and pages.take(("k", 2, 10)) is None  # once
    body = await relay.body()
    assert body is opened[("k", 2, 10)]
    await relay.aclose()
    assert opened[("k", 2, 10)].closed
    await asyncio.sleep(0.3)  # past the ttl: dropped
    assert pages.take(("k", 3, 10)) is None and opened[("k", 3, 10)].closed
    assert pages.taken == 1 and pages.dropped == 2

    async def failing(key: PageKey) -> Body:
        raise ObjectStoreUnavailable("down")

    pages.start(find(("k", 4, 10)), failing)
    await asyncio.sleep(0.05)
    assert pages.take(("k", 4, 10)) is None  # a failed one is not handed out: the client asks again

    async def nothing() -> PageKey | None:
        return None

    pages.start(nothing, open_)  # nothing to read next: nothing held
    pages.start(find(("k", 5, 10)), open_)
    await asyncio.sleep(0.05)
    await pages.close()
    assert len(pages) == 0 and opened[("k", 5, 10)].closed
    pages.start(find(("k", 6, 10)), open_)  # closed: ignored
    await asyncio.sleep(0.05)
    assert ("k", 6, 10) not in opened


async def test_a_tail_read_asks_the_store_once_a_second_and_finds_the_chunk_once_sealed(
        tmp_path: Path, store: StoreView) -> None:
    """Reads at the unsealed tail: the first finds no chunk in the store and goes to the
    ingester; the reader remembers the miss (for a second) and passes the next ones on without
    asking the store; once the chunk is sealed, the same read gets the same bytes, from the
    store once the second is over."""
    with Cluster(tmp_path, store, seal_bytes=4096) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = f"{c.reader.url}/v1/stream/t"
            await create(s, f"{c.ingester.url}/v1/stream/t", OCTET)
            first, second, third = os.urandom(1000), os.urandom(1000), os.urandom(3000)
            middle = await append(s, f"{c.ingester.url}/v1/stream/t", first, OCTET)
            await append(s, f"{c.ingester.url}/v1/stream/t", second, OCTET)
            before = reader_metrics(c.reader.url)
            for _ in range(5):
                page = await get_page(s, url, middle)
                assert page.status == 200 and page.body == second
            after = reader_metrics(c.reader.url)
            assert after["ds3_reader_chunk_misses_remembered_total"] - \
                before.get("ds3_reader_chunk_misses_remembered_total", 0) == 8  # two lookups, 4 reads
            assert after["ds3_reader_sealed_responses_total"] == before["ds3_reader_sealed_responses_total"]

            end = await append(s, f"{c.ingester.url}/v1/stream/t", third, OCTET)
            uid = c.store.uid("t")
            await asyncio.to_thread(wait_for, lambda: sealed_end(c.store, uid) >= position(end), 30, "sealed")
            page = await get_page(s, url, middle)  # from the ingester or the store: the same bytes
            assert page.status == 200 and page.body == second + third
            sealed = reader_metrics(c.reader.url)["ds3_reader_sealed_responses_total"]
            await asyncio.sleep(1.1)
            page = await get_page(s, url, middle)
            assert page.status == 200 and page.body == second + third
            assert reader_metrics(c.reader.url)["ds3_reader_sealed_responses_total"] == sealed + 1
            # (it ends at the tail: up to date, so cached briefly rather than as immutable)
            assert page.headers.get("Stream-Up-To-Date") == "true"
            assert page.headers["Cache-Control"] == "public, max-age=1"


async def test_sealed_history_stays_readable_when_the_ingester_dies_while_a_miss_is_remembered(
        tmp_path: Path) -> None:
    """The reader remembers (--descriptor-ttl, 30 s here) that a chunk was not sealed and passes
    reads there to the ingester; the chunk is sealed, then the ingester is killed: the reads
    still get their bytes, from the store (a long-poll at once; a plain read on its retry after
    the fast lane's 503)."""
    store = StoreView.local(tmp_path / "objects")
    with Cluster(tmp_path, store, seal_bytes=4096, reader_args=["--descriptor-ttl", "30"]) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = f"{c.reader.url}/v1/stream/d"
            await create(s, f"{c.ingester.url}/v1/stream/d", OCTET)
            second, third = os.urandom(1000), os.urandom(3000)
            middle = await append(s, f"{c.ingester.url}/v1/stream/d", os.urandom(1000), OCTET)
            await append(s, f"{c.ingester.url}/v1/stream/d", second, OCTET)
            assert (await get_page(s, url, middle)).body == second  # the misses are remembered
            end = await append(s, f"{c.ingester.url}/v1/stream/d", third, OCTET)
            uid = c.store.uid("d")
            await asyncio.to_thread(wait_for, lambda: sealed_end(c.store, uid) >= position(end), 30, "sealed")
            sealed = reader_metrics(c.reader.url)["ds3_reader_sealed_responses_total"]
            assert (await get_page(s, url, middle)).body == second + third  # still from the ingester
            assert reader_metrics(c.reader.url)["ds3_reader_sealed_responses_total"] == sealed

            assert c.ingester.popen is not None
            c.ingester.popen.kill()
            c.ingester.popen.wait(10)
            page = await get_page(s, url, middle, {"live": "long-poll"})
            assert page.status == 200 and page.body == second + third
            page = await get_page(s, url, middle)
            if page.status == 503:  # the lane's: its retry asks the store
                assert "Retry-After" in page.headers
                page = await get_page(s, url, middle)
            assert page.status == 200 and page.body == second + third
            assert reader_metrics(c.reader.url)["ds3_reader_sealed_responses_total"] >= sealed + 2
