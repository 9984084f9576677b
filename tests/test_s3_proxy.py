"""The S3 store's own requests (presigned GETs and small PUTs: a reader's sealed pages, the log's
segments) honour the environment's proxy settings as botocore's do, and never ~/.netrc: a
netrc login would add an Authorization header, which S3 refuses beside a presigned URL's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from shared.objectstore import open_store
from shared.objectstore.s3 import S3Store
from tests.s3server import MotoS3

_HOP: frozenset[str] = frozenset({"host", "connection", "proxy-authorization", "proxy-connection",
                                  "content-length", "transfer-encoding", "keep-alive"})

Seen = list[tuple[str, str, bool, str | None]]  # (method, path, carried Authorization, Proxy-Authorization)


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[str, Seen]]:
    """A forward HTTP proxy on 127.0.0.1 that records what passes through it."""
    seen: Seen = []

    async def forward(request: web.Request) -> web.Response:
        target = URL(request.raw_path, encoded=True)
        seen.append((request.method, target.path, "Authorization" in request.headers,
                     request.headers.get("Proxy-Authorization")))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with client.request(request.method, target, headers=headers, data=await request.read()) as r:
            body = await r.read()
            return web.Response(status=r.status, body=body,
                                headers={k: v for k, v in r.headers.items() if k.lower() not in _HOP})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def _round_trip(endpoint: str, bucket: str, key: str) -> None:
    store = open_store(f"s3://{bucket}/p", s3_endpoint=endpoint)
    assert isinstance(store, S3Store)
    async with store:
        await store.put(key, b"x" * 100, if_absent=True, content_type="application/octet-stream")
        assert await store.get(key) == b"x" * 100
        assert await store.get(key, 10, 20) == b"x" * 10


async def test_presigned_requests_take_the_environments_proxy_and_no_netrc_login(
    s3_server: MotoS3, s3_bucket: str, proxy: tuple[str, Seen], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    proxy_url, seen = proxy
    for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with_login = proxy_url.replace("http://", "http://someone:pw@")
    monkeypatch.setenv("HTTP_PROXY", with_login)
    monkeypatch.setenv("http_proxy", with_login)
    netrc = tmp_path / "netrc"
    netrc.write_text("default login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))

    await _round_trip(s3_server.endpoint, s3_bucket, "seg-1")
    ours = [s for s in seen if s[1] == f"/{s3_bucket}/p/seg-1"]
    assert [m for m, *_ in ours] == ["PUT", "GET", "GET"]  # every one through the proxy
    assert not any(auth for _, _, auth, _ in ours)  # signed by the URL alone: no netrc login
    assert {login for *_, login in ours} == {aiohttp.encode_basic_auth("someone", "pw")}  # the proxy's own

    # NO_PROXY names the store's host: straight to it.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    before = len(seen)
    await _round_trip(s3_server.endpoint, s3_bucket, "seg-2")
    assert len(seen) == before
