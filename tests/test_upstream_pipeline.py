"""The reader's upstream pool pipelining appends (reader/upstream.py) against a scripted HTTP
server in the test's process: which connection each request takes, answers handed to the right
caller in order however the bytes are split, and failures reaching every request waiting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from reader.upstream import MAX_PIPELINE, Answer, UpstreamPool, _Connection
from shared.errors import Unavailable


class Ingester:
    """Reads requests (a head, a Content-Length body) and answers each with its path as the
    body, at once or when released (`hold`)."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[int, bytes]] = []  # (connection number, path)
        self.hold = False
        self.held: list[tuple[asyncio.StreamWriter, bytes]] = []  # (where, the answer)
        self.close_after: int | None = None  # close the connection after this many answers
        self.server: asyncio.Server | None = None
        self.arrived = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self.writers.append(writer)
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path = lines[0].split()[:2]
                length = next((int(v) for k, _, v in (line.partition(b": ") for line in lines)
                               if k.lower() == b"content-length"), 0)
                await reader.readexactly(length)
                self.requests.append((number, path))
                self.arrived.set()
                if self.hold:
                    self.held.append((writer, _answer(method, path)))
                    continue
                writer.write(_answer(method, path))
                answered += 1
                if self.close_after is not None and answered >= self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass

    def release(self) -> None:
        held, self.held = self.held, []
        for writer, answer in held:
            writer.write(answer)

    async def wait_for(self, n: int) -> None:
        while len(self.requests) < n:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 5)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.sleep(0.01)  # (the handlers see their connections end)


def _answer(method: bytes, path: bytes) -> bytes:
    """The path as the body (a HEAD's answer: its length only)."""
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(path), b"" if method == b"HEAD" else path)


def _request(method: bytes, path: str, body: bytes = b"") -> bytes:
    return (method + b" " + path.encode() + b" HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


@pytest.fixture
async def ingester() -> AsyncIterator[tuple[Ingester, UpstreamPool]]:
    ing = Ingester()
    port = await ing.start()
    pool = UpstreamPool(f"http://127.0.0.1:{port}", read_timeout=5)
    try:
        yield ing, pool
    finally:
        await pool.close()
        await ing.stop()


class Results:
    def __init__(self) -> None:
        self.got: dict[str, Answer | Unavailable] = {}
        self.order: list[str] = []
        self.done = asyncio.Event()
        self.expected = 0

    def deliver(self, name: str) -> Any:
        def got(answer: Answer | Unavailable) -> None:
            self.got[name] = answer
            self.order.append(name)
            if len(self.got) >= self.expected:
                self.done.set()
        return got

    async def all(self, n: int) -> None:
        self.expected = n
        if len(self.got) < n:
            self.done.clear()
            await asyncio.wait_for(self.done.wait(), 5)


def _body(answer: Answer | Unavailable) -> bytes:
    assert isinstance(answer, Answer), answer
    return answer.body


async def test_appends_of_one_loop_iteration_share_one_connection(ingester: tuple[Ingester, UpstreamPool]) -> None:
    ing, pool = ingester
    res = Results()
    for i in range(10):
        pool.request(_request(b"POST", f"/a{i}", b"x"), False, res.deliver(f"a{i}"), pipelined=True)
    await res.all(10)
    assert ing.connections == 1
    assert {name: _body(a) for name, a in res.got.items()} == {f"a{i}": f"/a{i}".encode() for i in range(10)}
    assert res.order == [f"a{i}" for i in range(10)]
    # later appends go down the same connection
    for i in range(10, 15):
        pool.request(_request(b"POST", f"/a{i}"), False, res.deliver(f"a{i}"), pipelined=True)
    await res.all(15)
    assert ing.connections == 1 and pool.connections == 1


async def test_a_full_pipe_opens_another_connection(ingester: tuple[Ingester, UpstreamPool]) -> None:
    ing, pool = ingester
    ing.hold = True
    res = Results()
    n = MAX_PIPELINE + 5
    for i in range(n):
        pool.request(_request(b"POST", f"/p{i}"), False, res.deliver(f"p{i}"), pipelined=True)
        if i == MAX_PIPELINE - 1:
            await ing.wait_for(MAX_PIPELINE)  # (the first pipe exists now)
    await ing.wait_for(n)
    assert ing.connections == 2, ing.requests
    assert sorted(c for c, _ in ing.requests).count(1) == MAX_PIPELINE
    ing.release()
    await res.all(n)
    assert all(_body(res.got[f"p{i}"]) == f"/p{i}".encode() for i in range(n))


async def test_other_requests_never_wait_behind_the_pipe(ingester: tuple[Ingester, UpstreamPool]) -> None:
    """A HEAD or a read gets a connection of its own while appends wait on the pipe; once the
    pipe drained, it may serve a request alone, and appends then take another connection."""
    ing, pool = ingester
    ing.hold = True
    res = Results()
    pool.request(_request(b"POST", "/a"), False, res.deliver("a"), pipelined=True)
    await ing.wait_for(1)
    pool.request(_request(b"HEAD", "/h"), True, res.deliver("h"))
    await ing.wait_for(2)
    assert ing.connections == 2, ing.requests
    ing.release()
    await res.all(2)
    assert _body(res.got["a"]) == b"/a" and _body(res.got["h"]) == b""  # a HEAD's answer has no body
    # both drained and idle: a long read takes the newest idle connection, appends another one
    ing.hold = True
    pool.request(_request(b"GET", "/lp"), False, res.deliver("lp"))
    pool.request(_request(b"POST", "/b"), False, res.deliver("b"), pipelined=True)
    await ing.wait_for(4)
    by_path = {path: c for c, path in ing.requests}
    assert by_path[b"/lp"] != by_path[b"/b"], ing.requests
    ing.release()
    await res.all(4)
    assert ing.connections == 2, ing.requests


async def test_a_lost_connection_fails_every_request_waiting_on_it(ingester: tuple[Ingester, UpstreamPool]) -> None:
    ing, pool = ingester
    ing.close_after = 1
    res = Results()
    for i in range(3):
        pool.request(_request(b"POST", f"/l{i}"), False, res.deliver(f"l{i}"), pipelined=True)
    await res.all(3)
    assert _body(res.got["l0"]) == b"/l0"
    for name in ("l1", "l2"):
        failed = res.got[name]
        assert isinstance(failed, Unavailable) and "unreachable" in failed.message
    ing.close_after = None
    pool.request(_request(b"POST", "/again"), False, res.deliver("again"), pipelined=True)  # a new pipe
    await res.all(4)
    assert _body(res.got["again"]) == b"/again"


@pytest.mark.parametrize(("ingester_is", "error"), [("silent", "ServerTimeoutError"), ("gone", "ClientConnectorError")])
async def test_an_ingester_silent_or_gone_fails_every_waiting_request(ingester_is: str, error: str) -> None:
    """Silent: the pipe's requests time out together; gone: those queued while the pipe was
    connecting fail together."""
    ing = Ingester()
    ing.hold = True
    port = await ing.start()
    if ingester_is == "gone":
        await ing.stop()  # nothing listens there now
    pool = UpstreamPool(f"http://127.0.0.1:{port}", read_timeout=0.3)
    try:
        res = Results()
        for i in range(3):
            pool.request(_request(b"POST", f"/t{i}"), False, res.deliver(f"t{i}"), pipelined=True)
        await res.all(3)
        assert all(isinstance(a, Unavailable) and error in a.message for a in res.got.values())
        assert pool.connections == 0
    finally:
        await pool.close()
        await ing.stop()


class _Transport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


ANSWERS = (
    b"HTTP/1.1 204 No Content\r\nStream-Next-Offset: 1\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nwxyz"
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n"  # a HEAD's answer: its length, no body
)


async def test_pipelined_answers_split_at_every_position() -> None:
    pool = UpstreamPool("http://127.0.0.1:9")
    for cut in range(1, len(ANSWERS)):
        conn = _Connection(pool)
        transport = _Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        got: list[tuple[int, bytes] | str] = []

        def deliver(answer: Answer | Unavailable, got: list[tuple[int, bytes] | str] = got) -> None:
            got.append((answer.status, answer.body) if isinstance(answer, Answer) else answer.message)

        for head_only in (False, False, False, True):
            conn.queue(b"R", head_only, deliver)
        await asyncio.sleep(0)
        assert transport.written == b"RRRR"  # queued in one loop iteration: one write
        conn.data_received(ANSWERS[:cut])
        conn.data_received(ANSWERS[cut:])
        assert got == [(204, b""), (200, b"abcde"), (200, b"wxyz"), (200, b"")], cut
        assert not transport.closed
        if conn._timer is not None:
            conn._timer.cancel()
    await pool.close()
