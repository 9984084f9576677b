"""A stream's bytes are untrusted content (spec 10.3): a writer picks their Content-Type, so a
text/html stream opened in a browser tab ran as a page of the reader's origin, the console's,
whose bearer token sits in sessionStorage (found by QA). Every answer but the console's pages
carries a sandboxing Content-Security-Policy, once, whichever path answers it (the ingester's and
the reader's lanes, aiohttp's, the live channel, a snapshot); the console keeps its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.cluster import TIMEOUT, Cluster, StoreView, append, create

HTML = "text/html"
SANDBOX = ["default-src 'none'; sandbox"]


async def test_stream_bytes_are_sandboxed_on_every_path(tmp_path: Path) -> None:
    with Cluster(tmp_path, StoreView.local(tmp_path / "objects")) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            ing, url = f"{c.ingester.url}/v1/stream/page", f"{c.reader.url}/v1/stream/page"
            await create(s, ing, HTML)
            tail = await append(s, ing, b"<script>alert(document.domain)</script>", HTML)

            async def csp(target: str, **kw: str) -> list[str]:
                async with s.get(target, headers=kw) as r:
                    assert r.status in (200, 204, 307), (target, r.status)
                    return r.headers.getall("Content-Security-Policy", [])

            assert await csp(f"{ing}?offset=-1") == SANDBOX  # the ingester
            assert await csp(f"{url}?offset=-1") == SANDBOX  # the reader
            first = "0000000000000000_0000000000000000"
            assert await csp(f"{url}?offset={first}") == SANDBOX  # the reader's lane: a read at the unsealed tail
            assert await csp(f"{url}?offset={first}", **{"If-None-Match": '"other"'}) == SANDBOX  # aiohttp's path
            poll = asyncio.ensure_future(csp(f"{url}?offset={tail}&live=long-poll"))  # the live channel
            await asyncio.sleep(0.3)
            await append(s, ing, b"<p>more</p>", HTML)
            assert await poll == SANDBOX
            async with s.put(f"{url}/snapshot/{tail}", data=b"<script>1</script>", headers={"Content-Type": HTML}) as r:
                assert r.status == 204, await r.text()
            assert await csp(f"{url}/snapshot/{tail}") == SANDBOX
            async with s.get(f"{c.reader.url}/console/") as r:
                assert r.status == 200
                assert r.headers.getall("Content-Security-Policy") != SANDBOX
                assert "script-src 'self'" in r.headers["Content-Security-Policy"]
