"""The last sealed page of a stream, through the reader (protocol §5.6, §8.1), real processes.

A stream idle longer than --seal-age has its whole history in the store, and its last page
ends at the tail: that page must say `Stream-Up-To-Date` (it said nothing, so a client asked
once more to learn it), and is then not cached as immutable, since the stream goes on. Once
the stream is closed there, the page says `Stream-Closed`, and its ETag changes with the
closure: a client revalidating its copy must not be told 304 and miss the end (it was).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.cluster import (
    TIMEOUT,
    Cluster,
    Page,
    StoreView,
    append,
    create,
    get_page,
    position,
    sealed_end,
    wait_for,
)

TEXT = "text/plain"


async def read_to_end(s: aiohttp.ClientSession, url: str) -> list[Page]:
    pages: list[Page] = []
    offset = "-1"
    while True:
        p = await get_page(s, url, offset)
        assert p.status == 200, (offset, p.status, p.body)
        pages.append(p)
        if not p.body:
            return pages
        offset = p.next_offset


async def test_the_last_sealed_page_says_up_to_date_and_closed(tmp_path: Path) -> None:
    store = StoreView.local(tmp_path / "objects")
    with Cluster(tmp_path, store, seal_bytes=1 << 20, seal_age=0.3) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            path = "idle"
            url = f"{c.reader.url}/v1/stream/{path}"
            await create(s, url, TEXT)
            await append(s, url, b"a" * 100, TEXT)
            uid = wait_for(lambda: store.descriptor(path), 10, "the descriptor")["uid"]
            wait_for(lambda: sealed_end(store, uid) == 100, 10, "the append sealed")

            # Sealed, and at the tail: up to date, briefly cacheable, not immutable.
            for offset in ("-1", "0000000000000000_0000000000000000"):
                p = await get_page(s, url, offset)
                assert (p.status, p.body) == (200, b"a" * 100), (offset, p.status)
                assert p.headers.get("Stream-Up-To-Date") == "true", (offset, dict(p.headers))
                assert "immutable" not in p.headers["Cache-Control"]
                assert "Stream-Closed" not in p.headers
            direct = await get_page(s, f"{c.ingester.url}/v1/stream/{path}", "-1")  # as the ingester says
            assert direct.headers.get("Stream-Up-To-Date") == "true"

            # Appended to: the page ends before the tail now, whether or not the append is sealed.
            await append(s, url, b"b" * 50, TEXT)
            p = await get_page(s, url, "0000000000000000_0000000000000000")
            assert p.body == b"a" * 100 and "Stream-Up-To-Date" not in p.headers, dict(p.headers)
            wait_for(lambda: sealed_end(store, uid) == 150, 10, "the second append sealed")

            pages = await read_to_end(s, url)
            assert b"".join(p.body for p in pages) == b"a" * 100 + b"b" * 50
            assert pages[0].headers["Cache-Control"] == "public, max-age=60, stale-while-revalidate=300"
            last = next(p for p in reversed(pages) if p.body)
            assert position(last.next_offset) == 150 and last.headers.get("Stream-Up-To-Date") == "true"
            assert pages[-1].headers.get("Stream-Up-To-Date") == "true"  # (the empty page at the tail)

            # Closed where the last sealed page ends: the page says so, and a client that kept
            # the page before the close is not told 304.
            async with s.post(url, headers={"Stream-Closed": "true"}) as r:
                assert r.status == 204
            again = await get_page(s, url, last.offset, headers={"If-None-Match": last.headers["ETag"]})
            assert again.status == 200, again.status
            assert again.body == last.body
            assert again.headers.get("Stream-Closed") == "true" and again.headers.get("Stream-Up-To-Date") == "true"
            assert again.headers["ETag"] != last.headers["ETag"]
            revalidated = await get_page(s, url, last.offset, headers={"If-None-Match": again.headers["ETag"]})
            assert revalidated.status == 304
