"""The benchmarks' S3 (tests/moto_keepalive.py: moto behind waitress) keeps one connection for
many requests, including requests with no body and no Content-Length (a bucket's PUT, a
DELETE), which hung a kept-alive connection of werkzeug's server; and it is still moto's S3
(conditional writes refused, objects read back, ds3's S3 store works against it)."""

from __future__ import annotations

import asyncio
import http.client
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from shared.errors import ObjectNotFound, PreconditionFailed
from shared.objectstore import open_store
from tests.moto_keepalive import MotoProcess
from tests.s3server import aws_test_env


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoProcess]:
    with aws_test_env(), MotoProcess() as s3:
        yield s3


def test_one_connection_serves_every_kind_of_request(moto: MotoProcess) -> None:
    u = urlsplit(moto.endpoint)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=10)
    try:
        conn.connect()
        sock = conn.sock
        # (unsigned requests: the object is made public-read to be read back)
        requests: list[tuple[str, str, bytes | None, int]] = [
            ("PUT", "/keepalive-bucket", None, 200),          # no body, no Content-Length
            ("PUT", "/keepalive-bucket/a", b"hello", 200),
            ("GET", "/keepalive-bucket/a", None, 200),
            ("HEAD", "/keepalive-bucket/a", None, 200),
            ("GET", "/keepalive-bucket/missing", None, 404),
            ("DELETE", "/keepalive-bucket/a", None, 204),     # no body again
            ("GET", "/keepalive-bucket/a", None, 404),
        ]
        for method, path, body, status in requests:
            headers = {"x-amz-acl": "public-read"} if method == "PUT" and body else {}
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            assert r.status == status, (method, path, r.status, data[:200])
            assert (r.getheader("Connection") or "").lower() != "close", (method, path)
            if method == "GET" and status == 200:
                assert data == b"hello"
        assert conn.sock is sock, "the server closed the connection"
    finally:
        conn.close()


def test_the_s3_store_works_against_it(moto: MotoProcess) -> None:
    bucket = moto.new_bucket()

    async def run() -> None:
        store = open_store(f"s3://{bucket}/p", s3_endpoint=moto.endpoint)
        try:
            await store.put("k", b"v1", content_type="application/octet-stream", if_absent=True)
            with pytest.raises(PreconditionFailed):
                await store.put("k", b"v2", content_type="application/octet-stream", if_absent=True)
            assert await store.get("k") == b"v1"
            big = bytes(range(256)) * (12 << 12)  # 12 MiB: over waitress's default in-memory bounds
            await store.put("big", big, content_type="application/octet-stream")
            assert await store.get("big") == big
            await store.delete("k")
            with pytest.raises(ObjectNotFound):
                await store.get("k")
        finally:
            await store.close()

    asyncio.run(run())
