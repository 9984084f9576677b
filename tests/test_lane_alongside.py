"""Pipelined appends served alongside each other (shared/http/lane_connection.py, `Lane.alongside`).

A reader pipelines many clients' appends down one connection to the ingester; the lane must
take each as it arrives (so they share a group commit) and still answer in request order. A
lane whose answers the test holds and releases in any order shows what the connection does:
which messages are taken while others wait, the order answers leave in, what waits behind
them (a HEAD must see the appends before it), and a body that comes too late behind them.
The real ingester's side (a commit shared, reads after them) is in tests/test_pipelined_appends.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from shared.config import AuthConfig, LimitsConfig
from shared.http import access, auth, limits
from shared.http.handlers import BODY_TIMEOUT
from shared.http.lane import Lane, Message
from shared.http.lane_connection import LaneHandler
from shared.http.lane_runner import LaneRunner
from tests.rawhttp import post


class HeldLane(Lane):
    """Takes POSTs (alongside each other, at most 4) and HEADs; answers only when told."""

    methods = frozenset({b"POST", b"HEAD"})
    alongside = frozenset({b"POST"})
    max_alongside = 4

    def __init__(self, app: web.Application) -> None:
        super().__init__(app)
        self.held: list[tuple[LaneHandler, Message, bytes, str, float]] = []
        self.changed = asyncio.Event()

    def serve(self, handler: LaneHandler, msg: Message, body: bytes, rid: str, started: float) -> None:
        self.held.append((handler, msg, body, rid, started))
        self.changed.set()

    def release(self, i: int) -> None:
        handler, msg, body, rid, started = self.held[i]
        label = body if msg.method == b"POST" else b"head"
        handler.answer(msg, 200, {"X-Served": label.decode()}, b"", rid, started)

    async def holding(self, n: int) -> None:
        while len(self.held) < n:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 5)


class HeldRunner(LaneRunner):
    lane_class = HeldLane


@dataclass
class Server:
    port: int
    lane: HeldLane


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    app = web.Application()
    access.install(app)
    auth.install(app, AuthConfig(), accepts_internal=False)
    limits.install(app, LimitsConfig(write_rate=0))
    app[BODY_TIMEOUT] = 0.3
    runner = HeldRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    lane = runner.lane
    assert isinstance(lane, HeldLane)
    try:
        yield Server(port, lane)
    finally:
        await runner.cleanup()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _answers(reader: asyncio.StreamReader, n: int) -> list[tuple[int, str]]:
    """n answers: (status, X-Served)."""
    out = []
    for _ in range(n):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        length = int(headers.get("Content-Length", "0"))
        if length:
            await reader.readexactly(length)
        out.append((int(lines[0].split()[1]), headers.get("X-Served", "")))
    return out


def _post(i: int) -> bytes:
    return post("/v1/stream/s", str(i).encode(), "Content-Type: text/plain")


HEAD = b"HEAD /v1/stream/s HTTP/1.1\r\nHost: t\r\n\r\n"


async def test_pipelined_appends_are_taken_together_and_answered_in_order(server: Server) -> None:
    reader, writer = await _connect(server.port)
    writer.write(_post(0) + _post(1) + _post(2))
    await server.lane.holding(3)  # all three taken before any is answered (they share a commit)
    for i in (2, 0, 1):  # answered out of order...
        server.lane.release(i)
    assert await _answers(reader, 3) == [(200, "0"), (200, "1"), (200, "2")]  # ...sent in request order
    writer.close()


async def test_a_later_answer_waits_for_the_earlier_one(server: Server) -> None:
    reader, writer = await _connect(server.port)
    writer.write(_post(0) + _post(1))
    await server.lane.holding(2)
    server.lane.release(1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.2)  # nothing may go out before the answer to 0
    server.lane.release(0)
    assert await _answers(reader, 2) == [(200, "0"), (200, "1")]
    writer.close()


async def test_a_head_after_pending_appends_waits_for_their_answers(server: Server) -> None:
    """A HEAD must see the appends sent before it: it is taken once they are answered."""
    reader, writer = await _connect(server.port)
    writer.write(_post(0) + _post(1) + HEAD + _post(3))
    await server.lane.holding(2)
    await asyncio.sleep(0.1)
    assert len(server.lane.held) == 2  # the HEAD (and the append after it) wait
    server.lane.release(0)
    server.lane.release(1)
    await server.lane.holding(3)
    assert server.lane.held[2][1].method == b"HEAD"
    await asyncio.sleep(0.05)
    assert len(server.lane.held) == 3  # the append after the HEAD waits for the HEAD's answer
    server.lane.release(2)
    await server.lane.holding(4)
    server.lane.release(3)
    assert await _answers(reader, 4) == [(200, "0"), (200, "1"), (200, "head"), (200, "3")]
    writer.close()


async def test_at_most_max_alongside_are_pending(server: Server) -> None:
    reader, writer = await _connect(server.port)
    writer.write(b"".join(_post(i) for i in range(7)))
    await server.lane.holding(4)
    await asyncio.sleep(0.1)
    assert len(server.lane.held) == 4
    server.lane.release(0)
    await server.lane.holding(5)  # one answered, one more taken
    for i in range(1, 5):
        server.lane.release(i)
    await server.lane.holding(7)
    for i in range(5, 7):
        server.lane.release(i)
    assert await _answers(reader, 7) == [(200, str(i)) for i in range(7)]
    writer.close()


async def test_a_body_too_late_behind_pending_appends_gets_its_408_after_their_answers(server: Server) -> None:
    reader, writer = await _connect(server.port)
    late = post("/v1/stream/s", b"0123456789", "Content-Type: text/plain")
    writer.write(_post(0) + late[:-6])  # the second body stops short
    await server.lane.holding(1)
    await asyncio.sleep(0.6)  # past the body timeout (0.3 s) with the first answer still pending
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.1)  # the 408 may not overtake the answer to 0
    server.lane.release(0)
    assert await _answers(reader, 2) == [(200, "0"), (408, "")]
    assert await asyncio.wait_for(reader.read(), 5) == b""  # then the connection is closed
    assert len(server.lane.held) == 1  # the late append was never served
    writer.close()


async def test_a_client_that_leaves_with_answers_pending(server: Server) -> None:
    _, writer = await _connect(server.port)
    writer.write(_post(0) + _post(1))
    await server.lane.holding(2)
    writer.close()
    await asyncio.sleep(0.1)
    server.lane.release(1)  # answers for a client that left go nowhere, and nothing breaks
    server.lane.release(0)
    reader2, writer2 = await _connect(server.port)  # the server carries on
    writer2.write(_post(9))
    await server.lane.holding(3)
    server.lane.release(2)
    assert await _answers(reader2, 1) == [(200, "9")]
    writer2.close()
