"""Buckets (extensions §1), every clause, status code and header:

- identifiers: bucket ids ^[a-z0-9_-]{4,64}$; stream ids UTF-8, at most 122 bytes, no '/',
  NUL or '..', `{bucket_id}/{stream_id}` at most 122 bytes, `streams` reserved (§1.1);
- create (201, 409, 400; a stream PUT never creates its bucket) (§1.2), metadata (200 with
  bucket_id and streams, 400, 404) (§1.3), the listing with prefix, after and limit, sorted,
  next_cursor and has_more (§1.4), delete only when empty (204, 409, 404, 400) (§1.5);
- every base-protocol stream operation under /v1/buckets/{bucket_id}/{stream_id}, 404 when
  the bucket does not exist (§1.6): writes, reads, long-poll, SSE, HEAD, DELETE, forks naming
  either surface, sealed reads of a bucketed stream served from the object store.

Most tests run through the reader and through the ingester alone, both in one cluster sealing
into moto's S3 (module-scoped: each test uses its own buckets); a few need an ingester of their
own (TTL expiry without the sweep, restart).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
import yarl
from multidict import CIMultiDict

from shared import buckets as SB
from shared.errors import BadRequest
from tests.cluster import (
    TIMEOUT,
    Cluster,
    StoreView,
    position,
    read_sse_until,
    reader_metrics,
    sealed_end,
    wait_for,
)
from tests.s3server import MotoS3, aws_test_env
from tests.test_http import raw_request

BK = "/v1/buckets/"
ST = "/v1/stream/"
TEXT = {"Content-Type": "text/plain"}
SEALED = "ds3_reader_sealed_responses_total"
UPSTREAM = "ds3_reader_ingester_requests_total"
_ids = itertools.count()


def new_bucket_id(tag: str = "b") -> str:
    return f"{tag}-{next(_ids)}-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cluster(s3_server: MotoS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """An ingester sealing into moto's S3 (small chunks) with a reader in front of it."""
    with aws_test_env():
        bucket = s3_server.new_bucket()
        store = StoreView.s3_store(s3_server, bucket)
        with Cluster(tmp_path_factory.mktemp("buckets"), store, seal_bytes=1024, seal_age=0.5) as c:
            yield c
        s3_server.drop_bucket(bucket)


@pytest.fixture(params=["reader", "ingester"])
def base(request: pytest.FixtureRequest, cluster: Cluster) -> str:
    """The URL the test talks to: the reader (with S3), or the ingester alone."""
    return cluster.reader.url if request.param == "reader" else cluster.ingester.url


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


class Resp:
    def __init__(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        assert self.headers.get("Content-Type", "").startswith("application/json"), self.headers
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<{self.status} {self.body[:200]!r}>"


async def call(
    s: aiohttp.ClientSession, method: str, url: str, body: bytes | None = None,
    headers: dict[str, str] | None = None, params: dict[str, str] | None = None,
) -> Resp:
    """One request with the URL exactly as written (already percent-encoded)."""
    target = yarl.URL(url, encoded=True)
    if params:
        target = target.with_query(params)
    async with s.request(method, target, data=body, headers=headers) as r:
        return Resp(r.status, CIMultiDict(r.headers), await r.read())


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def raw(
    url_base: str, method: str, target: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> Resp:
    """The request line exactly as given ('.', '..' and '%2F' untouched by any client library)."""
    r = await raw_request(port_of(url_base), method, target.encode(), headers, body)
    return Resp(r.status, r.headers, r.body)


def expect_error(r: Resp, status: int, needle: str = "") -> None:
    assert r.status == status, f"expected {status}, got {r!r}"
    assert r.headers.get("Content-Type", "").startswith("text/plain"), r.headers
    assert needle.lower() in r.text.lower(), f"{needle!r} not in {r.text!r}"


async def make_bucket(s: aiohttp.ClientSession, base: str, tag: str = "b") -> str:
    bid = new_bucket_id(tag)
    r = await call(s, "PUT", f"{base}{BK}{bid}")
    assert r.status == 201, r
    return bid


def surl(base: str, bid: str, stream_id: str) -> str:
    return f"{base}{BK}{bid}/{quote(stream_id, safe='')}"


# ---------------------------------------------------------------- §1.1 identifiers (pure)
def test_identifier_rules_pure() -> None:
    for ok in ("abcd", "a" * 64, "a-b_c", "0000", "____", "----", "z9-_"):
        assert SB.validate_bucket_id(ok) == ok
    for bad in ("abc", "a" * 65, "ABCD", "abc.", "ab cd", "abcé", "abc!", "", "ab/cd", "abcd\n"):
        with pytest.raises(BadRequest):
            SB.validate_bucket_id(bad)
    assert SB.validate_stream_id("abcd", "x" * 117) == "x" * 117  # 4 + 1 + 117 = 122
    for bad, why in [
        ("x" * 118, "{bucket_id}/{stream_id}"), ("x" * 122, "{bucket_id}/{stream_id}"),
        ("x" * 123, "longer than 122"), ("", "empty"), ("a/b", "'/'"), ("a\x00b", "NUL"),
        ("..", "'..'"), ("a..b", "'..'"), ("\ud800", "UTF-8"),
    ]:
        with pytest.raises(BadRequest, match=None) as e:
            SB.validate_stream_id("abcd", bad)
        assert why in e.value.message, (bad, e.value.message)
    # internal paths never collide with plain ones, and map back to their URLs
    path = SB.internal_path("abcd", "a b/?")
    assert path.startswith("\x00") and SB.split_internal(path) == ("abcd", "a b/?")
    assert SB.url_path(path) == "/v1/buckets/abcd/a%20b%2F%3F"
    assert SB.url_path("x/y z") == "/v1/stream/x/y%20z" and SB.split_internal("x/y") is None
    assert SB.parse_url("/v1/buckets/abcd") == ("abcd", None)
    assert SB.parse_url("/v1/buckets/abcd/caf%C3%A9") == ("abcd", "café")
    assert SB.fork_source_path("/v1/buckets/abcd/a%20b", 480) == SB.internal_path("abcd", "a b")
    assert SB.fork_source_path("/v1/stream/a/b", 480) == "a/b"
    assert SB.fork_source_path("/v1/stream/pc/sp%20ace", 480) == "pc/sp ace"  # as a listing's `url` spells it
    assert SB.fork_source_path("/v1/stream/caf%C3%A9", 480) == "café"
    for bad_source in ("/v1/buckets/abcd/streams", "/v1/buckets/ABCD/x", "/v1/other/x", "/v1/buckets/abcd",
                       "/v1/stream/bad%FF", "/v1/stream/a/../b"):
        with pytest.raises(BadRequest):
            SB.fork_source_path(bad_source, 480)


# ---------------------------------------------------------------- §1.1 identifiers over HTTP
async def test_bucket_id_rules(session: aiohttp.ClientSession, base: str) -> None:
    tag = uuid.uuid4().hex[:6]
    for ok in (f"ok-{tag}", f"{tag}" + "a" * 58, f"a_b-{tag}", f"0{tag}"):
        assert len(ok) <= 64
        r = await call(session, "PUT", f"{base}{BK}{ok}")
        assert r.status == 201, (ok, r)
    for bad in ("abc", "a" * 65, "ABCD", "abc.", "ab%20cd", "abc%C3%A9", "abc!", "", "abc%FF", "abcd%0A"):
        for method in ("PUT", "GET", "DELETE"):
            expect_error(await call(session, method, f"{base}{BK}{bad}"), 400, "bucket id")
        # ... and stream operations and the listing under an invalid bucket id
        expect_error(await call(session, "PUT", f"{base}{BK}{bad}/s", headers=TEXT), 400, "bucket id")
        expect_error(await call(session, "GET", f"{base}{BK}{bad}/streams"), 400, "bucket id")
    expect_error(await raw(base, "PUT", "/v1/buckets/ab/cd"), 400, "bucket id")


async def test_stream_id_rules(session: aiohttp.ClientSession, base: str) -> None:
    bid = "i" + uuid.uuid4().hex[:3]  # 4 characters: stream ids up to 117 bytes fit in 122
    assert (await call(session, "PUT", f"{base}{BK}{bid}")).status == 201
    accepted = [
        "x" * 117, "é" * 58 + "x", "😀" * 29 + "x", "ü" * 58 + "y", ".", "a.b", "a b", "~tilde",
        "%", "?q", "#h", "line\nbreak", "tab\t", "日本語", "streams2", "Streams",
    ]
    for sid in accepted:
        assert len(bid) + 1 + len(sid.encode()) <= 122
        url = surl(base, bid, sid)
        if sid == ".":  # clients remove dot segments (RFC 3986): only a raw request line reaches it
            target = url[len(base) :]
            r = await raw(base, "PUT", target, TEXT, b"v:.")
            assert r.status == 201, (sid, r)
            r = await raw(base, "GET", target + "?offset=-1")
            assert r.status == 200 and r.body == b"v:.", (sid, r)
            continue
        r = await call(session, "PUT", url, b"v:" + sid.encode(), TEXT)
        assert r.status == 201, (sid, r)
        r = await call(session, "GET", url, params={"offset": "-1"})
        assert r.status == 200 and r.body == b"v:" + sid.encode(), (sid, r)
    listed = (await call(session, "GET", f"{base}{BK}{bid}/streams")).json()
    assert [e["stream_id"] for e in listed["streams"]] == sorted(accepted, key=lambda x: x.encode())

    rejected = {
        "x" * 118: "{bucket_id}/{stream_id}",  # over the combined limit
        "é" * 59: "{bucket_id}/{stream_id}",  # 118 bytes, 59 characters
        "x" * 122: "{bucket_id}/{stream_id}",
        "x" * 123: "longer than 122 bytes",
        "😀" * 31: "longer than 122 bytes",  # 124 bytes
    }
    for sid, why in rejected.items():
        for method in ("PUT", "POST", "GET", "HEAD", "DELETE"):
            r = await call(session, method, surl(base, bid, sid), b"x" if method == "POST" else None, TEXT)
            assert r.status == 400, (sid, method, r)
            if method != "HEAD":
                assert why in r.text, (sid, r.text)
    for target, why in [
        (f"/v1/buckets/{bid}/..", "'..'"), (f"/v1/buckets/{bid}/a..b", "'..'"), (f"/v1/buckets/{bid}/..x", "'..'"),
        (f"/v1/buckets/{bid}/%2E%2E", "'..'"), (f"/v1/buckets/{bid}/%00", "NUL"), (f"/v1/buckets/{bid}/a%00b", "NUL"),
        (f"/v1/buckets/{bid}/a%2Fb", "'/'"), (f"/v1/buckets/{bid}/%2f", "'/'"), (f"/v1/buckets/{bid}/a/b", "'/'"),
        (f"/v1/buckets/{bid}/", "empty"), (f"/v1/buckets/{bid}/%FF", "UTF-8"), (f"/v1/buckets/{bid}/a%C3", "UTF-8"),
    ]:
        for method in ("PUT", "POST", "GET", "DELETE"):
            headers = {"Content-Type": "text/plain"} if method in ("PUT", "POST") else None
            expect_error(await raw(base, method, target, headers), 400, why)
    # `streams` is reserved for the listing: every stream operation on it is refused
    for method in ("PUT", "POST", "DELETE"):
        expect_error(await call(session, method, f"{base}{BK}{bid}/streams", b"x", TEXT), 400, "reserved")
    assert (await call(session, "GET", f"{base}{BK}{bid}/streams")).status == 200  # the listing
    assert (await call(session, "HEAD", f"{base}{BK}{bid}/streams")).status == 200  # (as a GET)
    # Stream-Forked-From naming an invalid or reserved bucketed path is refused too
    for source in (f"/v1/buckets/{bid}/streams", f"/v1/buckets/{bid}/a%2Fb", "/v1/buckets/NOPE/x"):
        r = await call(session, "PUT", surl(base, bid, "fork-bad"), None, {**TEXT, "Stream-Forked-From": source})
        expect_error(r, 400)


async def test_plain_and_bucketed_paths_never_collide(session: aiohttp.ClientSession, base: str) -> None:
    bid = await make_bucket(session, base)
    plain = f"{base}{ST}{bid}/x"
    assert (await call(session, "PUT", plain, b"plain", TEXT)).status == 201
    assert (await call(session, "PUT", surl(base, bid, "x"), b"bucketed", TEXT)).status == 201
    assert (await call(session, "GET", plain, params={"offset": "-1"})).body == b"plain"
    assert (await call(session, "GET", surl(base, bid, "x"), params={"offset": "-1"})).body == b"bucketed"
    # the internal spelling cannot be reached through the plain surface
    expect_error(await raw(base, "GET", f"/v1/stream/%00b/{bid}/x?offset=-1"), 400)
    meta = (await call(session, "GET", f"{base}{BK}{bid}")).json()
    assert meta["streams"] == 1  # the plain stream is not in the bucket
    assert (await call(session, "DELETE", plain)).status == 204


# ---------------------------------------------------------------- §1.2, §1.3, §1.5 lifecycle
async def test_bucket_lifecycle(session: aiohttp.ClientSession, base: str) -> None:
    bid = new_bucket_id()
    url = f"{base}{BK}{bid}"
    expect_error(await call(session, "GET", url), 404, "not found")
    expect_error(await call(session, "DELETE", url), 404, "not found")
    t0 = int(time.time() * 1000)
    r = await call(session, "PUT", url)
    assert r.status == 201, r
    assert r.headers["Location"] == url
    body = r.json()
    assert body["bucket_id"] == bid and body["streams"] == 0
    assert r.headers["Cache-Control"] == "no-store"
    assert r.headers["X-Content-Type-Options"] == "nosniff" and r.headers["Access-Control-Allow-Origin"] == "*"
    expect_error(await call(session, "PUT", url), 409, "already exists")
    meta = (await call(session, "GET", url)).json()
    assert meta["bucket_id"] == bid and meta["streams"] == 0 and isinstance(meta["streams"], int)
    assert t0 - 5 <= meta["created_at_ms"] <= int(time.time() * 1000) + 5
    head = await call(session, "HEAD", url)
    assert head.status == 200 and head.body == b""
    refused = await call(session, "POST", url, b"x", TEXT)
    expect_error(refused, 405, "not allowed on a bucket")
    assert refused.headers["Allow"] == "GET, HEAD, PUT, DELETE, OPTIONS"
    pre = await call(session, "OPTIONS", url, headers={"Origin": "http://x", "Access-Control-Request-Method": "PUT"})
    assert pre.status == 204 and "DELETE" in pre.headers["Access-Control-Allow-Methods"]

    for i in range(3):
        assert (await call(session, "PUT", surl(base, bid, f"s{i}"), None, TEXT)).status == 201
    assert (await call(session, "GET", url)).json()["streams"] == 3
    expect_error(await call(session, "DELETE", url), 409, "not empty")
    assert (await call(session, "GET", url)).status == 200  # still there
    for i in range(3):
        assert (await call(session, "DELETE", surl(base, bid, f"s{i}"))).status == 204
    assert (await call(session, "GET", url)).json()["streams"] == 0
    assert (await call(session, "DELETE", url)).status == 204
    expect_error(await call(session, "GET", url), 404)
    expect_error(await call(session, "GET", f"{url}/streams"), 404)
    # a deleted bucket's id is free again; its old streams are gone
    assert (await call(session, "PUT", url)).status == 201
    expect_error(await call(session, "GET", surl(base, bid, "s0"), params={"offset": "-1"}), 404)
    assert (await call(session, "DELETE", url)).status == 204


async def test_missing_bucket_is_404_for_every_stream_operation(session: aiohttp.ClientSession, base: str) -> None:
    bid = new_bucket_id("missing")
    url = surl(base, bid, "s")
    # a stream PUT never creates its bucket
    r = await call(session, "PUT", url, b"data", TEXT)
    expect_error(r, 404, "bucket")
    expect_error(await call(session, "GET", f"{base}{BK}{bid}"), 404)
    expect_error(await call(session, "POST", url, b"data", TEXT), 404, "bucket")
    expect_error(await call(session, "POST", url, None, {"Stream-Closed": "true"}), 404, "bucket")
    expect_error(await call(session, "GET", url), 404, "bucket")
    expect_error(await call(session, "GET", url, params={"offset": "-1"}), 404, "bucket")
    expect_error(await call(session, "GET", url, params={"offset": "now"}), 404, "bucket")
    expect_error(await call(session, "GET", url, params={"offset": "-1", "live": "long-poll"}), 404, "bucket")
    expect_error(await call(session, "GET", url, params={"offset": "-1", "live": "sse"}), 404, "bucket")
    assert (await call(session, "HEAD", url)).status == 404
    expect_error(await call(session, "DELETE", url), 404, "bucket")
    r = await call(session, "PUT", url, None, {**TEXT, "Stream-Forked-From": f"{ST}whatever"})
    expect_error(r, 404)
    expect_error(await call(session, "GET", f"{base}{BK}{bid}/streams"), 404)
    # in an existing bucket, a missing stream is a 404 about the stream
    other = await make_bucket(session, base)
    expect_error(await call(session, "GET", surl(base, other, "nope"), params={"offset": "-1"}), 404, "stream")
    expect_error(await call(session, "DELETE", surl(base, other, "nope")), 404, "stream")


async def test_a_dot_stream_is_named_reachably_and_the_bucket_urls_explain_themselves(
        session: aiohttp.ClientSession, base: str) -> None:
    """QA, as a new user: a stream id "." is valid (only ".." is not), but as a bare path
    segment every URL parser drops it: the create's Location named the bucket's empty stream
    id (400). It is percent-encoded there. HEAD of the listing answered 400 ("reserved"); a
    missing bucket's DELETE and listing said only "bucket not found"; /v1/buckets was aiohttp's
    bare 404."""
    bid = await make_bucket(session, base)
    r = await raw(base, "PUT", f"{BK}{bid}/.", TEXT)
    assert r.status == 201, r
    location = yarl.URL(r.headers["Location"], encoded=True)
    assert location.raw_path == f"{BK}{bid}/%2E", r.headers["Location"]
    assert (await call(session, "POST", base + location.raw_path, b"dot", TEXT)).status == 204
    got = await call(session, "GET", base + location.raw_path, params={"offset": "-1"})
    assert got.status == 200 and got.body == b"dot"
    listing = (await call(session, "GET", f"{base}{BK}{bid}/streams")).json()
    assert [e["stream_id"] for e in listing["streams"]] == ["."]
    head = await call(session, "HEAD", f"{base}{BK}{bid}/streams")
    assert head.status == 200 and head.body == b"", head
    assert head.headers["Content-Type"].startswith("application/json")
    missing = new_bucket_id("gone")
    expect_error(await call(session, "DELETE", f"{base}{BK}{missing}"), 404, f"bucket '{missing}' not found")
    expect_error(await call(session, "GET", f"{base}{BK}{missing}/streams"), 404, f"bucket '{missing}' not found")
    expect_error(await call(session, "GET", f"{base}/v1/buckets"), 404, "GET /ds3/buckets lists them")


# ---------------------------------------------------------------- §1.6 stream operations
async def test_stream_operations_under_a_bucket(session: aiohttp.ClientSession, base: str) -> None:
    bid = await make_bucket(session, base)
    sid = "chat room ✓"
    url = surl(base, bid, sid)
    r = await call(session, "PUT", url, b"hello", TEXT)
    assert r.status == 201 and r.headers["Location"] == url and r.headers["Content-Type"] == "text/plain"
    first = r.headers["Stream-Next-Offset"]
    assert (await call(session, "PUT", url, None, TEXT)).status == 200  # idempotent create
    expect_error(await call(session, "PUT", url, None, {"Content-Type": "application/json"}), 409)
    r = await call(session, "POST", url, b" world", TEXT)
    assert r.status == 204 and r.headers["Stream-Next-Offset"] > first
    tail = r.headers["Stream-Next-Offset"]
    r = await call(session, "GET", url, params={"offset": "-1"})
    assert r.status == 200 and r.body == b"hello world" and r.headers["Stream-Next-Offset"] == tail
    r = await call(session, "GET", url, params={"offset": first})
    assert r.body == b" world"
    head = await call(session, "HEAD", url)
    assert head.status == 200 and head.headers["Stream-Next-Offset"] == tail and head.headers["Content-Type"] == "text/plain"
    # idempotent producer
    prod = {**TEXT, "Producer-Id": "p1", "Producer-Epoch": "0", "Producer-Seq": "0"}
    assert (await call(session, "POST", url, b"!", prod)).status == 200
    assert (await call(session, "POST", url, b"!", prod)).status == 204  # duplicate
    # long-poll: wakes up on an append
    r = await call(session, "GET", url, params={"offset": "now"})
    tail = r.headers["Stream-Next-Offset"]
    poll = asyncio.create_task(call(session, "GET", url, params={"offset": tail, "live": "long-poll"}))
    await asyncio.sleep(0.3)
    assert (await call(session, "POST", url, b"polled", TEXT)).status == 204
    got = await asyncio.wait_for(poll, 10)
    assert got.status == 200 and got.body == b"polled" and "Stream-Cursor" in got.headers
    # SSE: catches up from the start, then follows
    target = yarl.URL(url, encoded=True).with_query({"offset": "-1", "live": "sse"})
    async with session.get(target) as sse_resp:
        assert sse_resp.status == 200 and sse_resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse_until(sse_resp, "polled", 10)
        assert "".join(d for e, d in events if e == "data") == "hello world!polled"
        assert (await call(session, "POST", url, b"live-event", TEXT)).status == 204
        events = await read_sse_until(sse_resp, "live-event", 10)
        assert ("data", "live-event") in events
    # close, then the stream is listed as Closed
    r = await call(session, "POST", url, None, {"Stream-Closed": "true"})
    assert r.status == 204 and r.headers["Stream-Closed"] == "true"
    expect_error(await call(session, "POST", url, b"late", TEXT), 409)
    listed = (await call(session, "GET", f"{base}{BK}{bid}/streams")).json()
    assert [(e["stream_id"], e["status"]) for e in listed["streams"]] == [(sid, "Closed")]
    assert (await call(session, "DELETE", url)).status == 204
    expect_error(await call(session, "GET", url, params={"offset": "-1"}), 404, "stream")
    assert (await call(session, "DELETE", f"{base}{BK}{bid}")).status == 204


async def test_forks_across_surfaces(session: aiohttp.ClientSession, base: str, cluster: Cluster) -> None:
    b1 = await make_bucket(session, base)
    b2 = await make_bucket(session, base)
    src = surl(base, b1, "source one")
    assert (await call(session, "PUT", src, b"0123456789" * 150, TEXT)).status == 201  # > seal bytes
    mid = (await call(session, "POST", src, b"-more", TEXT)).headers["Stream-Next-Offset"]
    plain = f"{base}{ST}fork-of-bucketed-{b1}"
    # bucket -> plain, the source named by its (percent-encoded) bucketed URL path
    fork_from = f"{BK}{b1}/{quote('source one', safe='')}"
    r = await call(session, "PUT", plain, None, {**TEXT, "Stream-Forked-From": fork_from})
    assert r.status == 201, r
    assert (await call(session, "POST", plain, b"+plain", TEXT)).status == 204
    # bucket -> another bucket, at an offset
    b2fork = surl(base, b2, "fork")
    r = await call(session, "PUT", b2fork, None, {**TEXT, "Stream-Forked-From": fork_from, "Stream-Fork-Offset": mid})
    assert r.status == 201, r
    # plain -> bucket
    back = surl(base, b1, "from plain")
    r = await call(session, "PUT", back, None, {**TEXT, "Stream-Forked-From": f"{ST}fork-of-bucketed-{b1}"})
    assert r.status == 201, r
    history = b"0123456789" * 150 + b"-more"
    for url, want in [(plain, history + b"+plain"), (b2fork, history), (back, history + b"+plain")]:
        got, offset = b"", "-1"
        for _ in range(50):
            r = await call(session, "GET", url, params={"offset": offset})
            assert r.status == 200, (url, r)
            got += r.body
            offset = r.headers["Stream-Next-Offset"]
            if r.headers.get("Stream-Up-To-Date") == "true":
                break
        assert got == want, url
    # a fork source in a bucket that does not exist, or a missing stream in one that does
    missing = f"{BK}{new_bucket_id('gone')}/x"
    expect_error(await call(session, "PUT", surl(base, b2, "f2"), None, {**TEXT, "Stream-Forked-From": missing}), 404)
    expect_error(await call(session, "PUT", surl(base, b2, "f3"), None, {**TEXT, "Stream-Forked-From": f"{BK}{b1}/nope"}), 404)
    # the source deleted while forks read it: soft-deleted (410), still counted, the bucket stays
    assert (await call(session, "DELETE", src)).status == 204
    expect_error(await call(session, "GET", src, params={"offset": "-1"}), 410)
    assert (await call(session, "PUT", src, None, TEXT)).status == 409  # the id is not free yet
    meta = (await call(session, "GET", f"{base}{BK}{b1}")).json()
    assert meta["streams"] == 2 and meta["soft_deleted_streams"] == 1, meta  # source (deleted) + "from plain"
    listed = (await call(session, "GET", f"{base}{BK}{b1}/streams")).json()
    assert [(e["stream_id"], e["status"]) for e in listed["streams"]] == [("from plain", "Open"), ("source one", "Deleted")]
    assert (await call(session, "DELETE", back)).status == 204
    # only a soft-deleted stream left: the bucket is not empty
    meta = (await call(session, "GET", f"{base}{BK}{b1}")).json()
    assert meta["streams"] == 1 and meta["soft_deleted_streams"] == 1, meta
    expect_error(await call(session, "DELETE", f"{base}{BK}{b1}"), 409, "forks")
    # the last forks go: the source goes with them, and the bucket can be deleted
    assert (await call(session, "DELETE", plain)).status == 204
    assert (await call(session, "DELETE", b2fork)).status == 204
    assert (await call(session, "GET", f"{base}{BK}{b1}")).json()["streams"] == 0
    assert (await call(session, "DELETE", f"{base}{BK}{b1}")).status == 204
    assert (await call(session, "DELETE", f"{base}{BK}{b2}")).status == 204


# ---------------------------------------------------------------- §1.4 the listing
async def test_listing_pages_prefix_after_limit(session: aiohttp.ClientSession, base: str) -> None:
    bid = await make_bucket(session, base)
    names = [f"s{i:03d}" for i in range(250)] + ["a", "t-1", "t-2", "user-1", "user-2", "é", "Z", "~"]

    async def put(n: str) -> None:
        r = await call(session, "PUT", surl(base, bid, n), n.encode(), TEXT)
        assert r.status == 201, r

    for i in range(0, len(names), 50):
        await asyncio.gather(*(put(n) for n in names[i : i + 50]))
    everything = sorted(names, key=lambda n: n.encode())
    lurl = f"{base}{BK}{bid}/streams"

    async def listing(**params: str) -> dict[str, Any]:
        r = await call(session, "GET", lurl, params=params or None)
        assert r.status == 200, (params, r)
        assert r.headers["Cache-Control"] == "no-store"
        return dict(r.json())

    whole = await listing()  # default limit 1000
    assert whole["bucket_id"] == bid and whole["prefix"] is None
    assert [e["stream_id"] for e in whole["streams"]] == everything
    assert whole["stream_count"] == len(names) and whole["has_more"] is False and whole["next_cursor"] is None
    assert (await call(session, "GET", f"{base}{BK}{bid}")).json()["streams"] == len(names)

    # page through the s-prefix 100 at a time
    pages, after = [], None
    while True:
        params = {"prefix": "s", "limit": "100", **({"after": after} if after else {})}
        page = await listing(**params)
        pages.append(page)
        assert page["prefix"] == "s" and page["stream_count"] == len(page["streams"])
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        assert page["next_cursor"] == page["streams"][-1]["stream_id"]
        after = page["next_cursor"]
    assert [p["stream_count"] for p in pages] == [100, 100, 50]
    assert [e["stream_id"] for p in pages for e in p["streams"]] == [f"s{i:03d}" for i in range(250)]

    # exactly `limit` left: has_more is false
    p = await listing(prefix="s1", limit="100")
    assert p["stream_count"] == 100 and p["has_more"] is False and p["next_cursor"] is None
    p = await listing(prefix="s1", limit="99")
    assert p["has_more"] is True and p["next_cursor"] == "s198"
    p = await listing(prefix="s1", after="s198")
    assert [e["stream_id"] for e in p["streams"]] == ["s199"] and p["has_more"] is False
    # after is exclusive, need not name a stream, and may lie before or beyond the prefix
    assert (await listing(after="s049", limit="1"))["streams"][0]["stream_id"] == "s050"
    assert (await listing(after="s0495", limit="1"))["streams"][0]["stream_id"] == "s050"
    assert (await listing(prefix="s2", after="a", limit="1"))["streams"][0]["stream_id"] == "s200"
    assert (await listing(prefix="s1", after="s5"))["streams"] == []
    assert (await listing(after="~"))["streams"][0]["stream_id"] == "é"
    p = await listing(prefix="user-")
    assert [e["stream_id"] for e in p["streams"]] == ["user-1", "user-2"] and p["prefix"] == "user-"
    assert (await listing(prefix="nothing"))["streams"] == []
    assert (await listing(prefix="s" * 600))["streams"] == []  # longer than any key
    assert (await listing(after="s" * 600, limit="1"))["streams"][0]["stream_id"] == "t-1"
    assert (await listing(prefix="s", after="s" + "9" * 600))["streams"] == []
    assert (await listing(limit="1000"))["stream_count"] == len(names)
    p = await listing(limit="1")
    assert p["stream_count"] == 1 and p["next_cursor"] == "Z" and p["has_more"] is True

    for bad in ("0", "1001", "abc", "-1", "1.5", "", " 5", "1e3", "١", "99999999999999999999"):
        expect_error(await call(session, "GET", lurl, params={"limit": bad}), 400, "limit")
    expect_error(await call(session, "GET", f"{lurl}?limit=5&limit=6"), 400, "limit")
    expect_error(await call(session, "GET", f"{lurl}?prefix=a&prefix=b"), 400, "prefix")
    expect_error(await call(session, "GET", f"{lurl}?after=%FF"), 400, "UTF-8")
    expect_error(await call(session, "GET", f"{lurl}?prefix=a%C3"), 400, "UTF-8")


async def test_listing_entry_fields(session: aiohttp.ClientSession, base: str) -> None:
    bid = await make_bucket(session, base)
    t0 = int(time.time() * 1000)
    url = surl(base, bid, "user-1")
    assert (await call(session, "PUT", url, None, TEXT)).status == 201
    jurl = surl(base, bid, "user-2")
    assert (await call(session, "PUT", jurl, b'[{"a":1}]', {"Content-Type": "application/json"})).status == 201

    async def entries() -> dict[str, dict[str, Any]]:
        body = (await call(session, "GET", f"{base}{BK}{bid}/streams", params={"prefix": "user-"})).json()
        return {e["stream_id"]: e for e in body["streams"]}

    e = (await entries())["user-1"]
    assert set(e) >= {"stream_id", "status", "content_type", "tail_offset", "created_at_ms", "last_write_at_ms"}
    assert e["status"] == "Open" and e["content_type"] == "text/plain" and e["tail_offset"] == 0
    assert t0 - 5 <= e["created_at_ms"] <= int(time.time() * 1000) + 5
    assert e["last_write_at_ms"] == e["created_at_ms"]  # nothing appended yet: the creation
    created = e["created_at_ms"]
    await asyncio.sleep(0.05)
    tail = (await call(session, "POST", url, b"x" * 42, TEXT)).headers["Stream-Next-Offset"]
    e = (await entries())["user-1"]
    assert e["tail_offset"] == 42 == position(tail) and e["next_offset"] == tail
    assert isinstance(e["tail_offset"], int)
    assert e["last_write_at_ms"] >= created + 40 and e["created_at_ms"] == created
    j = (await entries())["user-2"]
    head = await call(session, "HEAD", jurl)
    assert j["content_type"] == "application/json" and j["next_offset"] == head.headers["Stream-Next-Offset"]
    assert j["tail_offset"] == position(head.headers["Stream-Next-Offset"]) > 0


# ---------------------------------------------------------------- sealed reads from the object store
async def test_sealed_reads_of_a_bucketed_stream_come_from_the_store(
    session: aiohttp.ClientSession, cluster: Cluster
) -> None:
    c = cluster
    bid = await make_bucket(session, c.reader.url, "sealed")
    sid = "history ✓"
    ing, rdr = surl(c.ingester.url, bid, sid), surl(c.reader.url, bid, sid)
    assert (await call(session, "PUT", ing, None, {"Content-Type": "application/octet-stream"})).status == 201
    data = [bytes([65 + i % 26]) * 300 for i in range(20)]  # 6,000 bytes: several 1 KiB chunks
    for d in data:
        assert (await call(session, "POST", ing, d, {"Content-Type": "application/octet-stream"})).status == 204
    internal = SB.internal_path(bid, sid)
    desc = wait_for(lambda: c.store.descriptor(internal), 10, "the bucketed stream's descriptor")
    assert desc["path"] == internal
    wait_for(lambda: sealed_end(c.store, desc["uid"]) == 6000, 15, "every chunk sealed")
    heads = [h.header for h, _ in c.store.decoded_chunks(desc["uid"])]
    assert all(h.path == internal for h in heads)
    before = reader_metrics(c.reader.url)
    got, offset, pages = b"", "-1", 0
    while len(got) < 6000:
        r = await call(session, "GET", rdr, params={"offset": offset})
        assert r.status == 200, r
        if len(got) + len(r.body) == 6000 and r.headers.get("Stream-Up-To-Date") == "true":
            # the last page, at the tail (as the ingester said in time): briefly cached
            assert r.headers["Cache-Control"] == "public, max-age=1"
        elif offset != "-1":
            assert r.headers["Cache-Control"] == "public, max-age=31536000, immutable"
        got += r.body
        offset = r.headers["Stream-Next-Offset"]
        pages += 1
    assert got == b"".join(data)
    after = reader_metrics(c.reader.url)
    assert after[SEALED] - before[SEALED] == pages, "sealed pages of a bucketed stream must come from the store"
    # but to ask whether its last page ends at the tail (once)
    assert after[UPSTREAM] - before[UPSTREAM] == 1, "a sealed read of a bucketed stream reached the ingester"
    # a sliding TTL is renewed through the ingester with the internal path
    r = await call(session, "POST", f"{c.ingester.url}/_ds3/touch?path={quote(internal, safe='')}")
    assert r.status == 204, r
    # deleted: the reader stops serving it, and the objects go
    assert (await call(session, "DELETE", rdr)).status == 204
    r = await call(session, "GET", rdr, params={"offset": "-1"})
    assert r.status == 404, r
    wait_for(lambda: not c.store.chunk_keys(desc["uid"]), 15, "the deleted stream's chunks removed")
    assert (await call(session, "DELETE", f"{c.reader.url}{BK}{bid}")).status == 204


# ---------------------------------------------------------------- an ingester of its own
@pytest.fixture
def solo(make_ingester: Any) -> Any:
    """In-process ingesters on tmp_path/data (no store); keyword arguments override the config."""
    return make_ingester


async def test_expired_streams_leave_the_listing_and_do_not_block_a_delete(solo: Any) -> None:
    c = await solo(sweep_interval=3600)  # no sweep: only reads and the bucket delete see expiry
    assert (await c.put(f"{BK}ttls")).status == 201
    assert (await c.put(f"{BK}ttls/short", headers={**TEXT, "Stream-TTL": "1"})).status == 201
    assert (await c.put(f"{BK}ttls/long", headers={**TEXT, "Stream-TTL": "3600"})).status == 201
    await asyncio.sleep(1.2)
    assert (await c.get(f"{BK}ttls/short?offset=-1")).status == 404
    listed = await (await c.get(f"{BK}ttls/streams")).json()
    assert [e["stream_id"] for e in listed["streams"]] == ["long"]
    r = await c.delete(f"{BK}ttls")
    assert r.status == 409 and "1 stream" in await r.text()  # `short` was expired (and removed) first
    assert (await c.delete(f"{BK}ttls/long")).status == 204
    assert (await c.delete(f"{BK}ttls")).status == 204


async def test_expiry_sweep_updates_the_count(solo: Any) -> None:
    c = await solo(sweep_interval=0.1)
    assert (await c.put(f"{BK}sweep")).status == 201
    for i in range(3):
        assert (await c.put(f"{BK}sweep/s{i}", headers={**TEXT, "Stream-TTL": "1"})).status == 201
    assert (await (await c.get(f"{BK}sweep")).json())["streams"] == 3
    deadline = time.monotonic() + 5
    while (await (await c.get(f"{BK}sweep")).json())["streams"] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert (await (await c.get(f"{BK}sweep")).json())["streams"] == 0
    assert (await c.delete(f"{BK}sweep")).status == 204


async def test_buckets_and_last_writes_survive_a_restart(solo: Any) -> None:
    c = await solo()
    assert (await c.put(f"{BK}keep")).status == 201
    assert (await c.put(f"{BK}keep/s", headers=TEXT)).status == 201
    await asyncio.sleep(0.05)
    assert (await c.post(f"{BK}keep/s", data=b"abc", headers=TEXT)).status == 204  # a plain append
    before = await (await c.get(f"{BK}keep/streams")).json()
    e = before["streams"][0]
    assert e["last_write_at_ms"] > e["created_at_ms"]
    await c.close()
    c2 = await solo()
    assert (await (await c2.get(f"{BK}keep")).json())["streams"] == 1
    after = await (await c2.get(f"{BK}keep/streams")).json()
    assert after == before
    r = await c2.put(f"{BK}keep")
    assert r.status == 409


async def test_concurrent_creates_and_deletes_keep_the_count_exact(solo: Any) -> None:
    c = await solo()
    assert (await c.put(f"{BK}race")).status == 201
    n = 200

    async def put(i: int) -> int:
        return (await c.put(f"{BK}race/s{i}", headers=TEXT)).status

    async def put_again(i: int) -> int:  # idempotent re-creates do not count twice
        return (await c.put(f"{BK}race/s{i}", headers=TEXT)).status

    statuses = await asyncio.gather(*(put(i) for i in range(n)), *(put_again(i) for i in range(n)))
    assert sorted(set(statuses)) == [200, 201] and statuses.count(201) == n
    assert (await (await c.get(f"{BK}race")).json())["streams"] == n
    deletes = await asyncio.gather(*(c.delete(f"{BK}race/s{i}") for i in range(0, n, 2)),
                                   c.delete(f"{BK}race"))
    assert [r.status for r in deletes[:-1]] == [204] * (n // 2) and deletes[-1].status == 409
    assert (await (await c.get(f"{BK}race")).json())["streams"] == n // 2
    listed = await (await c.get(f"{BK}race/streams")).json()
    assert listed["stream_count"] == n // 2
