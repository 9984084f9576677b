"""Reads refuse offsets the stream never issued (400), through a reader in front of a sealing
ingester and at the ingester itself, with real processes (a new user's QA pass found these
served from their position alone):

- an offset of another stream, of the stream's previous incarnation (deleted and created
  again: a client resuming with a saved offset would silently skip data), or made up;
- a chunk boundary spelled with the later chunk's id (the server spells it with the chunk
  holding the byte before), in sealed history and in the WAL;
- every offset the stream did issue still reads, in every live mode, and position 0 reads from
  the start whatever chunk it names (nothing can be skipped from there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from shared import offsets
from tests.cluster import Cluster, StoreView, append, create, get_page, read_pages, reader_metrics, wait_for

OCTET = "application/octet-stream"
JSON = "application/json"
SEALED_RESPONSES = "ds3_reader_sealed_responses_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("issued")
    with Cluster(work, StoreView.local(work / "objects"), seal_bytes=2048) as c:
        yield c


async def _fill(session: aiohttp.ClientSession, url: str, n: int, ct: str = OCTET) -> list[str]:
    """Create `url` with n appends; the offsets issued after each."""
    await create(session, url, ct)
    out = []
    for i in range(n):
        body = b'{"i":%d,"pad":"%s"}' % (i, b"p" * 200) if ct == JSON else bytes([65 + i % 26]) * 300
        out.append(await append(session, url, body, ct))
    return out


async def _status(session: aiohttp.ClientSession, url: str, offset: str, **params: str) -> tuple[int, bytes]:
    async with session.get(url, params={"offset": offset, **params}) as r:
        return r.status, await r.read()


def _bases(c: Cluster) -> list[str]:
    return [c.reader.url, c.ingester.url]


def test_another_streams_and_made_up_offsets_are_refused(cluster: Cluster) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for base in _bases(cluster):
                a, b = f"{base}/v1/stream/iss-a-{base[-5:]}", f"{base}/v1/stream/iss-b-{base[-5:]}"
                issued_a = await _fill(s, a, 20)  # 6,000 bytes: sealed chunks and a WAL tail
                await _fill(s, b, 20)
                for off in issued_a[:-1]:  # every offset of a is refused by b (same positions)
                    for live in ({}, {"live": "long-poll"}, {"live": "sse"}):
                        status, body = await _status(s, b, off, **live)
                        assert status == 400, (base, off, live, status, body[:200])
                        assert b"not one this stream issued" in body
                made_up = [offsets.encode(1, 300), offsets.encode(9_999_999_999_999_999, 3000),
                           offsets.encode(offsets.parse(issued_a[3]).chunk + 7, 1200)]
                for off in made_up:
                    assert (await _status(s, a, off))[0] == 400, (base, off)
    asyncio.run(go())


def test_a_deleted_incarnations_offsets_are_refused(cluster: Cluster) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for base in _bases(cluster):
                url = f"{base}/v1/stream/iss-again-{base[-5:]}"
                old = await _fill(s, url, 15)
                async with s.delete(url) as r:
                    assert r.status == 204
                new = await _fill(s, url, 15)
                assert [offsets.parse(o).position for o in old] == [offsets.parse(o).position for o in new]
                for off in old:
                    status, body = await _status(s, url, off)
                    assert status == 400, (base, off, status, body[:200])
                for off in new[:-1]:
                    assert (await _status(s, url, off))[0] == 200
    asyncio.run(go())


def test_every_issued_offset_reads_and_a_boundary_spelled_by_the_later_chunk_is_refused(
        cluster: Cluster) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for ct in (OCTET, JSON):
                base = cluster.reader.url
                name = f"iss-bounds-{ct[-4:]}"
                url = f"{base}/v1/stream/{name}"
                await _fill(s, url, 30, ct)
                uid = cluster.store.uid(name)
                wait_for(lambda u=uid: len(cluster.store.chunk_keys(u)) >= 3, 20, "three chunks in the store")
                sealed_before = reader_metrics(base).get(SEALED_RESPONSES, 0)
                pages = await read_pages(s, url)
                issued = ["-1"] + [p.next_offset for p in pages]
                # every page boundary, read through the reader and at the ingester, as the
                # server spelled it: 200; at a chunk boundary spelled with the next chunk: 400
                refused = 0
                for off in issued[1:-1]:
                    o = offsets.parse(off)
                    for b in _bases(cluster):
                        u = url.replace(base, b)
                        page = await get_page(s, u, off)
                        assert page.status == 200, (b, off, page.status, page.body[:200])
                        later_spelling = offsets.encode(o.chunk + 1, o.position)
                        status, _ = await _status(s, u, later_spelling)
                        if page.next_offset.startswith(f"{o.chunk + 1:016d}_"):  # o is a chunk's end
                            assert status == 400, (b, later_spelling)
                            refused += 1
                assert refused >= 4, "no chunk boundary was tried"
                assert reader_metrics(base).get(SEALED_RESPONSES, 0) > sealed_before + 2  # the reader's own path
                # position 0, whatever it names, reads from the start (nothing skipped)
                first = await get_page(s, url, "-1")
                for zero in (offsets.encode(0, 0), offsets.encode(123, 0)):
                    assert (await get_page(s, url, zero)).body == first.body
    asyncio.run(go())


def test_a_long_poll_from_an_issued_tail_offset_still_waits_and_is_woken(cluster: Cluster) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for base in _bases(cluster):
                url = f"{base}/v1/stream/iss-live-{base[-5:]}"
                issued = await _fill(s, url, 12)
                tail = issued[-1]

                async def wake(target: str) -> None:
                    await asyncio.sleep(0.3)
                    await append(s, target, b"Z" * 10, OCTET)

                waker = asyncio.create_task(wake(url))
                async with s.get(url, params={"offset": tail, "live": "long-poll"}) as r:
                    assert r.status == 200 and await r.read() == b"Z" * 10
                await waker
                # the old tail offset is an inner position now: still this stream's
                assert (await _status(s, url, tail))[0] == 200
    asyncio.run(go())


def test_a_fork_offset_the_source_never_issued_is_refused(cluster: Cluster) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for base in _bases(cluster):
                src, other = f"{base}/v1/stream/iss-src-{base[-5:]}", f"{base}/v1/stream/iss-oth-{base[-5:]}"
                issued = await _fill(s, src, 10)
                foreign = await _fill(s, other, 10)
                for i, off in enumerate(foreign[:-1]):
                    headers = {"Content-Type": OCTET, "Stream-Forked-From": src.split(base)[1],
                               "Stream-Fork-Offset": off}
                    async with s.put(f"{base}/v1/stream/iss-fork-bad-{base[-5:]}-{i}", headers=headers) as r:
                        assert r.status == 400, (base, off, r.status)
                        assert "not one the source stream issued" in await r.text()
                headers = {"Content-Type": OCTET, "Stream-Forked-From": src.split(base)[1],
                           "Stream-Fork-Offset": issued[4]}
                fork = f"{base}/v1/stream/iss-fork-ok-{base[-5:]}"
                async with s.put(fork, headers=headers) as r:
                    assert r.status == 201, (base, r.status, await r.text())
                pages = await read_pages(s, fork)
                assert len(b"".join(p.body for p in pages)) == offsets.parse(issued[4]).position
    asyncio.run(go())
