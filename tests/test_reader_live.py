"""The reader's live paths with real processes: long-poll and SSE from every kind of start
offset answer what the ingester alone answers; long-poll waiters share the reader's one
upstream subscription per stream; a client that leaves does not take a shared upstream
request down with it; a fork request names one source."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.cluster import (
    TIMEOUT,
    Cluster,
    Page,
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


# ---------------------------------------------------------------- the reader answers as the ingester does
# (issue 12 item 1: SSE from offset=now through a reader delivered nothing; issue 13 item 3: long-polls
# answered from the reader's live channel must be the ingester's answers)
KINDS = {
    TEXT: [b"line one\r\nline\rtwo\n", b"\xff not utf-8 \xfe", b" leading space"],
    OCTET: [b"\x00\x01binary\r\n", b"\xff\xfe", b"more"],
    JSON: [b'[{"a": 1},\r\n {"b": "two"}]', b'{"c": [3]}', b"[4, 5]"],
}
NOT_COMPARED = {"date", "server", "x-request-id"}


def answer(p: Page) -> tuple[int, dict[str, str], bytes]:
    """What a client sees of a response, with the values that differ by design normalised:
    the time, the request id, and the cursor's value (a number; random when the client's is
    ahead of the clock)."""
    headers = {k.lower(): v for k, v in p.headers.items() if k.lower() not in NOT_COMPARED}
    if "stream-cursor" in headers:
        assert headers["stream-cursor"].isdigit(), headers
        headers["stream-cursor"] = "<n>"
    return p.status, headers, p.body


def events(got: list[tuple[str, str]]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for kind, data in got:
        if kind == "control":
            control = json.loads(data)
            if "streamCursor" in control:
                assert str(control["streamCursor"]).isdigit(), control
                control["streamCursor"] = "<n>"
            out.append((kind, control))
        else:
            out.append((kind, data))
    return out


@dataclass
class Pair:
    """The same stream seen through the ingester and through the reader."""

    s: aiohttp.ClientSession
    ingester: str
    reader: str
    content_type: str

    async def create(self) -> None:
        await create(self.s, self.ingester, self.content_type)

    async def append(self, body: bytes) -> str:
        return await append(self.s, self.ingester, body, self.content_type)

    async def long_poll(self, offset: str, then: bytes | None = None, **params: str) -> str:
        """The same GET on both; `then` is appended while they wait. Returns the next offset."""
        q = {"live": "long-poll", **params} if offset != "none" else {}
        tasks = [asyncio.create_task(get_page(self.s, url, offset, params=q)) for url in (self.ingester, self.reader)]
        if offset == "none":
            tasks = [asyncio.create_task(self._get(url)) for url in (self.ingester, self.reader)]
        if then is not None:
            await asyncio.sleep(0.3)  # both are waiting
            assert not any(t.done() for t in tasks), [(n, t.result()) for n, t in enumerate(tasks) if t.done()]
            await self.append(then)
        ing, rdr = await asyncio.wait_for(asyncio.gather(*tasks), 15)
        assert answer(rdr) == answer(ing), f"offset={offset} {params}"
        return ing.headers.get("Stream-Next-Offset", "")

    async def _get(self, url: str) -> Page:
        async with self.s.get(url) as r:
            return Page("", r.status, CIMultiDict(r.headers), await r.read())

    async def sse(self, offset: str, then: bytes | None, want: str, **params: str) -> None:
        """SSE from `offset` on both until a data event containing `want` (or the end)."""
        q = {"offset": offset, "live": "sse", **params}
        responses = [await self.s.get(url, params=q) for url in (self.ingester, self.reader)]
        try:
            assert [r.status for r in responses] == [200, 200]
            assert responses[0].headers.get("Stream-SSE-Data-Encoding") == responses[1].headers.get(
                "Stream-SSE-Data-Encoding")
            reading = [asyncio.create_task(read_sse_until(r, want, 10)) for r in responses]
            if then is not None:
                await asyncio.sleep(0.3)  # both are subscribed
                await self.append(then)
            ing, rdr = await asyncio.gather(*reading)
            assert events(rdr) == events(ing), f"SSE offset={offset}"
            if want != END:
                assert any(kind == "data" for kind, _ in ing), ing
        finally:
            for r in responses:
                r.close()


END = "\x00the end"  # never in a data event: read until the server ends the response


@pytest.mark.parametrize("content_type", list(KINDS))
async def test_live_reads_through_the_reader_answer_what_the_ingester_answers(
    tmp_path: Path, local_store: StoreView, content_type: str
) -> None:
    one, two, three = KINDS[content_type]
    timeouts = ["--long-poll-timeout", "1"]
    with Cluster(tmp_path, local_store, seal_bytes=1 << 20, ingester_args=timeouts, reader_args=timeouts) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.put(f"{c.ingester.url}/v1/buckets/live-bkt") as r:
                assert r.status == 201
            for surface in (("/v1/stream/live ", "/v1/buckets/live-bkt/live ")):
                def pair(name: str, surface: str = surface) -> Pair:
                    return Pair(s, f"{c.ingester.url}{surface}{name}", f"{c.reader.url}{surface}{name}", content_type)

                # long-poll from -1 on an empty stream waits; with data it answers at once
                p = pair("start")
                await p.create()
                await p.long_poll("-1", then=one)
                await p.long_poll("-1")
                await p.long_poll("none")
                # from now: only what comes after; a timeout is a 204 with a cursor
                p = pair("now")
                await p.create()
                await p.append(one)
                await p.long_poll("now", then=two)
                tail = await p.long_poll("now", cursor="12")
                # from the tail, with and without a cursor (one ahead of the clock too), twice
                tail = await p.long_poll(tail, then=three)
                tail = await p.long_poll(tail, then=one, cursor="1")
                tail = await p.long_poll(tail, then=two, cursor="99999999999")
                await p.long_poll(tail)  # 204 after the timeout
                await p.long_poll(tail, then=three, cursor="bogus")
                # SSE from now (delivered nothing before), from -1, from the tail, with a cursor
                await p.sse("now", then=one, want="")  # "": up to the first data event
                await p.sse("-1", then=None, want="")
                await p.sse(await p.append(three), then=two, want="", cursor="5")
                # a closed stream: long-poll at its end is a 204 without a cursor; before, a 200
                p = pair("closed")
                await p.create()
                await p.append(one)
                async with s.post(p.ingester, headers={"Stream-Closed": "true"}) as r:
                    assert r.status in (200, 204), await r.text()
                    final = r.headers["Stream-Next-Offset"]
                await p.long_poll(final)
                await p.long_poll(final, cursor="3")
                await p.long_poll("now")  # (from -1 the reader serves the sealed chunk: its own ETag)
                await p.sse("-1", then=None, want=END)
                await p.sse(final, then=None, want=END)
                await p.sse("now", then=None, want=END)


# ---------------------------------------------------------------- one channel per stream (issue 13 item 3)
async def test_long_polls_and_sse_clients_share_the_streams_live_channel(tmp_path: Path, local_store: StoreView) -> None:
    """Long-polls and SSE clients at the tail wait on one upstream long-poll; the client that
    started it leaving changes nothing for the others; a long-poll that comes back late, at the
    offset the last answer started from, gets that answer without asking the ingester."""
    with Cluster(tmp_path, local_store) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            ing = f"{c.ingester.url}/v1/stream/shared"
            await create(s, ing, TEXT)
            tail = await append(s, ing, b"history", TEXT)
            url = f"{c.reader.url}/v1/stream/shared"
            target = f"/v1/stream/shared?offset={tail}&live=long-poll"
            before = reader_metrics(c.reader.url)

            async def leaver() -> None:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.3):
                        await raw_get(c.reader.port, target)

            await leaver()  # the first long-poll starts the channel, then its client goes
            polls = [asyncio.create_task(raw_get(c.reader.port, target)) for _ in range(10)]
            streams = [await s.get(url, params={"offset": tail, "live": "sse"}) for _ in range(5)]
            try:
                reading = [asyncio.create_task(read_sse_until(r, "news", 10)) for r in streams]
                await asyncio.sleep(0.3)  # all parked or attached
                waiting = reader_metrics(c.reader.url)[UPSTREAM] - before[UPSTREAM]
                assert waiting <= 2, f"15 live clients of one stream made {waiting} upstream requests"
                assert not any(t.done() for t in polls)
                nxt = await append(s, ing, b"news", TEXT)
                assert await asyncio.wait_for(asyncio.gather(*polls), 10) == [(200, b"news")] * 10
                for got in await asyncio.gather(*reading):
                    assert got[-1] == ("data", "news"), got
                settled = reader_metrics(c.reader.url)[UPSTREAM]
                late = await get_page(s, url, tail, params={"live": "long-poll"})
                assert (late.status, late.body, late.next_offset) == (200, b"news", nxt)
                assert reader_metrics(c.reader.url)[UPSTREAM] == settled, "the late long-poll went upstream"
            finally:
                for r in streams:
                    r.close()


async def test_an_sse_client_that_stops_reading_is_cut_loose_and_the_others_go_on(
    tmp_path: Path, local_store: StoreView
) -> None:
    """The channel writes to SSE clients' connections itself: a client that takes nothing
    must not make the reader hold an unbounded backlog for it, nor hold up the others."""
    with Cluster(tmp_path, local_store, seal_bytes=64 << 20) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT, read_bufsize=16 << 20) as s:
            ing = f"{c.ingester.url}/v1/stream/stall"
            await create(s, ing, OCTET)
            tail = await append(s, ing, b"start", OCTET)
            target = f"/v1/stream/stall?offset={tail}&live=sse"
            _, w = await asyncio.open_connection("127.0.0.1", c.reader.port)  # asks, then never reads
            w.write(f"GET {target} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
            await w.drain()
            reader_resp = await s.get(f"{c.reader.url}{target}")
            try:
                reading = asyncio.create_task(read_sse_until(reader_resp, "", 30))
                await asyncio.sleep(0.3)
                piece = bytes(range(256)) * 4096  # 1 MiB
                for _ in range(24):
                    await append(s, ing, piece, OCTET)
                total = 0
                async with asyncio.timeout(30):
                    while total < 24 * len(piece):
                        got = await reading
                        total += sum(len(base64.b64decode(d)) for k, d in got if k == "data")
                        reading = asyncio.create_task(read_sse_until(reader_resp, "", 30))
                reading.cancel()
                assert reader_metrics(c.reader.url)["ds3_reader_sse_dropped_total"] == 1
            finally:
                reader_resp.close()
                w.close()


# ---------------------------------------------------------------- a late long-poll catches up at once
LATE = {
    TEXT: [b"alpha ", b"beta ", b"gamma"],
    OCTET: [b"\x00\x01", b"\xff\r\n", b"\x80"],
    JSON: [b'{"i": 1}', b'[{"i": 2}, {"i": 3}]', b'"four"'],
}


@pytest.mark.parametrize("content_type", list(LATE))
async def test_a_long_poll_answers_behind_gets_them_all_as_the_ingester_reads_them(
    tmp_path: Path, local_store: StoreView, content_type: str
) -> None:
    """A long-poll that comes back several answers late (a slow client of a busy stream) gets
    everything since its offset in one answer, the same status, headers and bytes as a read
    from there at the ingester, without an upstream request; with more than --max-read-bytes
    since, it gets whole answers up to that and the rest on its next poll."""
    with Cluster(tmp_path, local_store, seal_bytes=1 << 20, reader_args=["--max-read-bytes", "1024"]) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            ing = f"{c.ingester.url}/v1/stream/late"
            url = f"{c.reader.url}/v1/stream/late"
            await create(s, ing, content_type)
            start = await append(s, ing, LATE[content_type][0], content_type)

            async def follow(offset: str, bodies: list[bytes]) -> str:
                """Append each body while a long-poll at the tail waits, so each is an answer of
                the channel of its own; returns the tail."""
                for body in bodies:
                    poll = asyncio.create_task(get_page(s, url, offset, params={"live": "long-poll"}))
                    await asyncio.sleep(0.2)
                    offset = await append(s, ing, body, content_type)
                    assert (await poll).status == 200
                return offset

            first = await follow(start, [b"x" if content_type != JSON else b"0"])  # the channel runs
            tail = await follow(first, LATE[content_type][1:])
            before = reader_metrics(c.reader.url)[UPSTREAM]
            late = await get_page(s, url, first, params={"live": "long-poll", "cursor": "7"})
            assert reader_metrics(c.reader.url)[UPSTREAM] == before, "the late long-poll went upstream"
            # (a long-poll at the ingester: its 200 is cached as a long-poll's, a catch-up page
            # at the tail only for --tail-max-age)
            read = await get_page(s, ing, first, params={"live": "long-poll", "cursor": "7"})
            assert (late.status, late.next_offset, late.body) == (200, tail, read.body)
            assert late.headers.get("Stream-Up-To-Date") == "true"
            got, want = ({k: v for k, v in answer(r)[1].items() if k != "stream-cursor"} for r in (late, read))
            assert got == want, "the joined answer's headers differ from the ingester's"

            # more than --max-read-bytes behind: whole answers within it, then the rest
            big = [bytes([65 + n]) * 400 if content_type != JSON else b'"' + bytes([65 + n]) * 400 + b'"'
                   for n in range(4)]
            end = await follow(tail, big)
            part = await get_page(s, url, tail, params={"live": "long-poll"})
            assert part.status == 200 and "Stream-Up-To-Date" not in part.headers
            assert 0 < len(part.body) <= 1024 and part.next_offset not in (tail, end)
            rest = await get_page(s, url, part.next_offset, params={"live": "long-poll"})
            if content_type == JSON:
                assert json.loads(part.body) + json.loads(rest.body) == [json.loads(b) for b in big]
            else:
                assert part.body + rest.body == b"".join(big)
            assert rest.next_offset == end and rest.headers.get("Stream-Up-To-Date") == "true"


async def test_long_polls_wait_out_an_ingester_restart(tmp_path: Path, local_store: StoreView) -> None:
    """A planned restart of the ingester (SIGTERM, then the same process again): its drain
    answers the reader's upstream long-poll, and the reader's next one finds it gone. The
    long-polls parked at the reader used to get 503 then, every follower at once (found by QA);
    they wait it out and get what is appended after it."""
    slow = ["--long-poll-timeout", "20"]
    with Cluster(tmp_path, local_store, ingester_args=slow, reader_args=slow) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            ing = f"{c.ingester.url}/v1/stream/restart"
            await create(s, ing, TEXT)
            tail = await append(s, ing, b"before", TEXT)
            target = f"/v1/stream/restart?offset={tail}&live=long-poll"
            polls = [asyncio.create_task(raw_get(c.reader.port, target)) for _ in range(3)]
            sse = await s.get(f"{c.reader.url}/v1/stream/restart", params={"offset": tail, "live": "sse"})
            try:
                reading = asyncio.create_task(read_sse_until(sse, "after", 20))
                await asyncio.sleep(0.5)  # parked at the reader, its upstream long-poll waiting
                c.ingester.stop()
                c.ingester.start()
                async with aiohttp.ClientSession(timeout=TIMEOUT) as fresh:  # (s keeps a connection to the old one)
                    await append(fresh, ing, b"after", TEXT)
                assert await asyncio.wait_for(asyncio.gather(*polls), 20) == [(200, b"after")] * 3
                assert (await reading)[-1] == ("data", "after")  # the SSE client stayed connected
            finally:
                sse.close()
