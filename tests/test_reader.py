"""The stateless reader in front of a sealing ingester (issue 3, design §6), with real processes:

- sealed history is served from the object store without a single request to the ingester,
  with immutable caching headers, strong ETags (304 on If-None-Match) and chunk-aligned ends;
- with the ingester SIGKILLed, every sealed byte stays readable; the tail and writes answer
  503 with Retry-After; after a restart everything works again;
- clients of one reader waiting on the same stream and offset share one upstream request
  (long-poll), and SSE subscribers of one stream share one upstream subscription.

Each test runs against moto's S3 and against a local-directory store where that is cheap.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import zlib
from pathlib import Path

import aiohttp
import pytest

from shared import offsets
from tests.cluster import (
    TIMEOUT,
    Cluster,
    StoreView,
    append,
    chunk_ends,
    create,
    get_page,
    position,
    read_pages,
    read_sse_until,
    reader_metrics,
    sealed_end,
    wait_for,
)

IMMUTABLE = "public, max-age=31536000, immutable"


def cache_ok(offset: str, cache_control: str) -> bool:
    """Sealed bytes under an offset URL are immutable; the start URL (-1) is not, since a path
    deleted and created again keeps it: it may be cached, but not as immutable."""
    return cache_control == IMMUTABLE if offset != "-1" else "immutable" not in cache_control
OCTET = "application/octet-stream"
JSON = "application/json"
SEALED = "ds3_reader_sealed_responses_total"
UPSTREAM = "ds3_reader_ingester_requests_total"
COLLAPSED = "ds3_reader_collapsed_total"



@pytest.fixture
def local_store(tmp_path: Path) -> StoreView:
    return StoreView.local(tmp_path / "objects")


def bodies(n: int, seed: int, lo: int = 40, hi: int = 400) -> list[bytes]:
    """n appends of varied sizes whose bytes say where they are (a shifted byte is visible)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = rng.randint(lo, hi)
        head = b"<%04d:" % i
        out.append((head + bytes(rng.randrange(97, 123) for _ in range(size - len(head) - 1)) + b">")[:size])
    return out


async def write_sealed(
    session: aiohttp.ClientSession, c: Cluster, path: str, data: list[bytes], seal_bytes: int
) -> tuple[str, list[int]]:
    """Create a byte stream, append `data` straight to the ingester, wait until every chunk
    that size rolled is in the store. Returns (uid, chunk end positions)."""
    url = f"{c.ingester.url}/v1/stream/{path}"
    await create(session, url, OCTET)
    for b in data:
        await append(session, url, b, OCTET)
    ends = chunk_ends([len(b) for b in data], seal_bytes)
    assert len(ends) >= 3, "the test needs several sealed chunks"
    uid = wait_for(lambda: c.store.descriptor(path), 10, f"the descriptor of {path}")["uid"]
    wait_for(lambda: sealed_end(c.store, uid) == ends[-1], 15, f"{path}'s chunks up to {ends[-1]} sealed")
    return uid, ends


# ---------------------------------------------------------------- 1. sealed reads never touch the ingester
async def test_sealed_reads_never_touch_the_ingester(tmp_path: Path, store: StoreView) -> None:
    seal = 1024
    data = bodies(40, seed=1)
    stream = b"".join(data)
    with Cluster(tmp_path, store, seal_bytes=seal) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            uid, ends = await write_sealed(s, c, "hist", data, seal)
            heads = [h.header for h, _ in store.decoded_chunks(uid)]
            first = heads[0].chunk  # chunk ids rise by one from a first id (random per stream)
            assert [(h.chunk, h.start, h.end) for h in heads] == [
                (first + i, ([0, *ends][i]), e) for i, e in enumerate(ends)
            ], "chunk objects do not match the seal-bytes rule"
            url = f"{c.reader.url}/v1/stream/hist"
            before = reader_metrics(c.reader.url)

            # Page through the sealed history from -1. Only reads of the last sealed page ask the
            # ingester anything: where the tail is (at it, the page would say Stream-Up-To-Date).
            last_reads = 0
            pages, offset = [], "-1"
            while not pages or position(pages[-1].next_offset) < ends[-1]:
                p = await get_page(s, url, offset)
                assert p.status == 200, (offset, p.status, p.body[:200])
                pages.append(p)
                offset = p.next_offset
            starts = [0, *ends]
            for i, p in enumerate(pages):
                assert cache_ok(p.offset, p.headers["Cache-Control"]), p.headers
                etag = p.headers.get("ETag", "")
                assert etag.startswith('"') and etag.endswith('"') and len(etag) > 2, f"not a strong ETag: {etag!r}"
                assert p.next_offset == offsets.encode(first + i, ends[i]), "a sealed page must end at its chunk's end"
                assert p.body == stream[starts[i] : ends[i]]
                assert "Stream-Up-To-Date" not in p.headers  # (the open tail holds more)
            last_reads += 1
            assert len({p.headers["ETag"] for p in pages}) == len(pages)

            # Conditional requests: 304 with the same ETag (also weak, or in a list: If-None-Match
            # compares weakly), 200 for another ETag.
            for p in pages:
                tag = p.headers["ETag"]
                for inm in (tag, f"W/{tag}", f'"other", {tag}'):
                    async with s.get(url, params={"offset": p.offset}, headers={"If-None-Match": inm}) as r:
                        assert r.status == 304, (p.offset, inm, r.status)
                        assert r.headers["ETag"] == tag
                        assert r.headers["Cache-Control"] == p.headers["Cache-Control"]
                        assert await r.read() == b""
                again = await get_page(s, url, p.offset, headers={"If-None-Match": '"something-else"'})
                assert again.status == 200 and again.body == p.body and again.headers["ETag"] == p.headers["ETag"]
            last_reads += 4

            # Readers starting anywhere inside chunk k converge on chunk k's end offset.
            for k in range(len(ends)):
                lo, hi = starts[k], ends[k]
                spellings = {pages[k].offset}
                for pos in {lo + 1, (lo + hi) // 2, hi - 1}:
                    spellings.add(offsets.encode(first + k, pos))
                for off in sorted(spellings):
                    p = await get_page(s, url, off)
                    assert p.status == 200, (off, p.status, p.body[:200])
                    assert p.next_offset == offsets.encode(first + k, hi), (off, p.next_offset)
                    assert cache_ok(off, p.headers["Cache-Control"])
                    begin = 0 if off == "-1" else position(off)
                    assert p.body == stream[begin:hi]
                    last_reads += k == len(ends) - 1

            after = reader_metrics(c.reader.url)
            assert after[UPSTREAM] - before[UPSTREAM] == last_reads, "a sealed read reached the ingester"
            assert after[SEALED] - before[SEALED] >= 2 * len(pages)

            # The open tail, by contrast, is the ingester's.
            tail = await get_page(s, url, pages[-1].next_offset)
            assert tail.status == 200 and tail.body == stream[ends[-1] :]
            assert tail.headers["Cache-Control"] != IMMUTABLE
            assert reader_metrics(c.reader.url)[UPSTREAM] == before[UPSTREAM] + last_reads + 1


# ---------------------------------------------------------------- 3. the ingester killed
@pytest.mark.slow
async def test_reader_serves_history_with_the_ingester_killed(tmp_path: Path, store: StoreView) -> None:
    seal = 1024
    data = bodies(30, seed=3)
    tail_bytes = b"unsealed tail, only in the WAL"
    messages = [{"n": i, "pad": "j" * (i * 7 % 90)} for i in range(60)]
    with Cluster(tmp_path, store, seal_bytes=seal) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            _uid, ends = await write_sealed(s, c, "open", data, seal)
            ing = f"{c.ingester.url}/v1/stream/"
            await append(s, ing + "open", tail_bytes, OCTET)
            # A JSON stream that is closed: closing seals its last chunk.
            await create(s, ing + "done", JSON)
            for i in range(0, len(messages), 6):
                await append(s, ing + "done", json.dumps(messages[i : i + 6]).encode(), JSON)
            async with s.post(ing + "done", headers={"Stream-Closed": "true"}) as r:
                assert r.status == 204
                final = r.headers["Stream-Next-Offset"]
            done_uid = wait_for(lambda: store.descriptor("done"), 10, "done's descriptor")["uid"]
            wait_for(lambda: sealed_end(store, done_uid) == position(final), 15, "done sealed to its end")
            wait_for(lambda: (store.descriptor("done") or {}).get("closed"), 10, "done's descriptor closed")

            c.ingester.kill()
            url = f"{c.reader.url}/v1/stream/"
            stream = b"".join(data)
            got, offset = b"", "-1"
            for _ in range(100):
                p = await get_page(s, url + "open", offset)
                assert p.status == 200, f"sealed page at {offset}: HTTP {p.status} {p.body[:200]!r}"
                assert cache_ok(offset, p.headers["Cache-Control"])
                got += p.body
                offset = p.next_offset
                if position(offset) == ends[-1]:
                    break
            assert got == stream[: ends[-1]]

            pages = await read_pages(s, url + "done")
            assert pages[-1].headers.get("Stream-Closed") == "true"
            assert pages[-1].next_offset == final
            assert [m for p in pages for m in json.loads(p.body)] == messages
            eof = await get_page(s, url + "done", final)
            assert eof.status == 200 and json.loads(eof.body) == [] and eof.headers.get("Stream-Closed") == "true"

            # The tail, live reads and writes need the ingester: 503 + Retry-After.
            requests: list[tuple[str, str, dict[str, str], bytes | None]] = [
                ("GET", url + "open?offset=" + offset, {}, None),
                ("GET", url + "open?offset=now", {}, None),
                ("GET", url + "open?live=long-poll&offset=" + offset, {}, None),
                ("HEAD", url + "open", {}, None),
                ("POST", url + "open", {"Content-Type": OCTET}, b"more"),
                ("PUT", url + "new", {"Content-Type": OCTET}, None),
                ("DELETE", url + "open", {}, None),
            ]
            for method, u, headers, body in requests:
                async with s.request(method, u, headers=headers, data=body) as r:
                    await r.read()
                    assert r.status == 503, f"{method} {u}: HTTP {r.status}"
                    assert int(r.headers["Retry-After"]) >= 1, f"{method} {u}: {r.headers}"

            c.ingester.start()
            p = await get_page(s, url + "open", offset)
            assert p.status == 200 and p.body == stream[ends[-1] :] + tail_bytes
            await append(s, url + "open", b"after restart", OCTET)
            whole = b"".join(p.body for p in await read_pages(s, url + "open"))
            assert whole == stream + tail_bytes + b"after restart"
            async with s.put(url + "new", headers={"Content-Type": OCTET}) as r:
                assert r.status == 201


# ---------------------------------------------------------------- 6. collapsing
async def test_long_polls_on_one_offset_share_one_upstream_request(tmp_path: Path, local_store: StoreView) -> None:
    n = 20
    with Cluster(tmp_path, local_store) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            ing = f"{c.ingester.url}/v1/stream/lp"
            await create(s, ing, OCTET)
            tail = await append(s, ing, b"history", OCTET)
            before = reader_metrics(c.reader.url)
            url = f"{c.reader.url}/v1/stream/lp"
            waiting = [
                asyncio.create_task(get_page(s, url, tail, params={"live": "long-poll", "cursor": "c1"}))
                for _ in range(n)
            ]

            async def parked() -> bool:
                m = await asyncio.to_thread(reader_metrics, c.reader.url)
                return m[COLLAPSED] - before[COLLAPSED] >= n - 1

            for _ in range(100):
                if await parked():
                    break
                await asyncio.sleep(0.05)
            assert not any(t.done() for t in waiting), "a long-poll returned before data arrived"
            waited = reader_metrics(c.reader.url)
            assert waited[UPSTREAM] - before[UPSTREAM] == 1, "long-polls on one offset made several upstream requests"
            await append(s, ing, b"news", OCTET)
            pages = await asyncio.wait_for(asyncio.gather(*waiting), 10)
            assert all(p.status == 200 and p.body == b"news" for p in pages), [(p.status, p.body) for p in pages]
            assert len({p.next_offset for p in pages}) == 1
            after = reader_metrics(c.reader.url)
            # the stream's live channel goes on polling from the new offset for the next wave
            assert after[UPSTREAM] - before[UPSTREAM] <= 2
            assert after[COLLAPSED] - before[COLLAPSED] == n - 1


async def test_sse_subscribers_share_one_upstream_subscription(tmp_path: Path, local_store: StoreView) -> None:
    n = 10
    with Cluster(tmp_path, local_store) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            ing = f"{c.ingester.url}/v1/stream/sse"
            await create(s, ing, "text/plain")
            tail = await append(s, ing, b"history", "text/plain")
            before = reader_metrics(c.reader.url)
            url = f"{c.reader.url}/v1/stream/sse?offset={tail}&live=sse"
            responses = [await s.get(url) for _ in range(n)]
            try:
                assert all(r.status == 200 for r in responses)
                await asyncio.sleep(0.3)  # every subscription is established
                await append(s, ing, b"fan-out", "text/plain")
                got = await asyncio.gather(*(read_sse_until(r, "fan-out", 10) for r in responses))
                for events in got:
                    assert ("data", "fan-out") in events, events
            finally:
                for r in responses:
                    r.close()
            # the first subscriber's catch-up read, then the stream's one live channel: a long-poll
            # answered by the append, and the next one it keeps waiting
            upstream = reader_metrics(c.reader.url)[UPSTREAM] - before[UPSTREAM]
            assert upstream <= 3, f"{n} SSE subscribers of one stream made {upstream} upstream requests"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_append_is_stored_decoded_through_the_reader(tmp_path: Path, local_store: StoreView,
                                                                        encoding: str) -> None:
    """A body sent with Content-Encoding gzip or deflate is decoded by the server that reads it
    (aiohttp's): the reader forwards the decoded body, without the header that says it is still
    encoded (it used to forward both, and the ingester answered 400). Either port stores the same."""
    compress = gzip.compress if encoding == "gzip" else zlib.compress
    with Cluster(tmp_path, local_store) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT, auto_decompress=False) as s:
            for base in (c.reader.url, c.ingester.url):
                url = f"{base}/v1/stream/zipped-{encoding}-{base[-5:]}"
                await create(s, url, "text/plain")
                for text in (b"hello ", b"compressed " * 50):
                    headers = {"Content-Type": "text/plain", "Content-Encoding": encoding}
                    async with s.post(url, data=compress(text), headers=headers) as r:
                        assert r.status == 204, (base, r.status, await r.text())
                pages = await read_pages(s, url)
                assert b"".join(p.body for p in pages) == b"hello " + b"compressed " * 50


async def test_a_body_that_does_not_decode_is_a_clean_400(tmp_path: Path, local_store: StoreView) -> None:
    """Content-Encoding gzip on a body that is not gzip: 400 naming the problem, from either
    port, and nothing in the logs (aiohttp read on into the broken body after the answer and
    logged "Unhandled exception" with its traceback)."""
    with Cluster(tmp_path, local_store) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT, auto_decompress=False) as s:
            for base in (c.reader.url, c.ingester.url):
                url = f"{base}/v1/stream/not-zipped-{base[-5:]}"
                await create(s, url, "text/plain")
                headers = {"Content-Type": "text/plain", "Content-Encoding": "gzip"}
                async with s.post(url, data=b"not gzip at all" * 100, headers=headers) as r:
                    assert r.status == 400 and "could not be read" in await r.text(), (base, r.status)
                async with s.get(url + "?offset=-1") as r:  # nothing appended; still served (a new connection)
                    assert r.status == 200 and await r.read() == b""
        await asyncio.sleep(0.3)
        for log in (c.reader.log_path, c.ingester.log_path):
            text = log.read_text()
            assert "Unhandled exception" not in text and "Traceback" not in text, text
