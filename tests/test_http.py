"""The ingester over real HTTP (aiohttp test server, or a `ds3 ingester` process where a
request could wedge the server): bad input gets a clear 4xx and changes nothing, security
and caching headers, JSON round trips, chunked bodies, paging, long-poll, SSE, restart."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict

from ingester.service import SERVICE
from tests.procs import Proc, ingester

S = "/v1/stream/"
TEXT = {"Content-Type": "text/plain"}
JSON_CT = {"Content-Type": "application/json"}
BIN = {"Content-Type": "application/octet-stream"}

MakeClient = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def make_client(make_ingester: MakeClient) -> MakeClient:
    """Start an in-process ingester on tmp_path/data; keyword arguments override the config."""
    return make_ingester


@pytest.fixture
async def client(make_client: MakeClient) -> TestClient[Any, Any]:
    return await make_client()


# --- helpers ----------------------------------------------------------------------------------------


@dataclass
class Raw:
    status: int
    headers: CIMultiDict[str]
    body: bytes


async def raw_request(port: int, method: str, target: bytes, headers: Mapping[str, str | bytes] | None = None,
                      body: bytes = b"", timeout: float = 10) -> Raw:
    """One HTTP/1.1 request with the exact bytes given (clients would normalise these URLs)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        lines = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close",
                 b"Content-Length: %d" % len(body)]
        for k, v in (headers or {}).items():
            lines.append(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()))
        writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed: CIMultiDict[str] = CIMultiDict()
    for line in header_lines:
        k, _, v = line.partition(":")
        parsed.add(k.strip(), v.strip())
    return Raw(int(status_line.split(" ")[1]), parsed, rest)


def port(client: TestClient[Any, Any]) -> int:
    assert client.port is not None
    return client.port


def stats(client: TestClient[Any, Any]) -> tuple[int, int]:
    app = client.app
    assert app is not None
    s = app[SERVICE].wal.stats()
    return s["streams"], s["records"]


async def state(client: TestClient[Any, Any], *paths: str) -> list[tuple[Any, ...]]:
    """What a user can see of these streams, and what the WAL holds overall."""
    out: list[tuple[Any, ...]] = [stats(client)]
    for p in paths:
        h = await client.head(S + p)
        g = await client.get(S + p)
        out.append((h.status, h.headers.get("Stream-Next-Offset"), h.headers.get("Stream-Closed"),
                    g.status, await g.read()))
    return out


async def assert_error(resp: ClientResponse | Raw, status: int, needle: str = "") -> str:
    body = resp.body if isinstance(resp, Raw) else await resp.read()
    text = body.decode("utf-8", "replace")
    assert resp.status == status, f"expected {status}, got {resp.status}: {text!r}"
    assert resp.headers.get("Content-Type", "").startswith("text/plain")
    assert text.strip(), "an error must say what is wrong"
    assert needle.lower() in text.lower(), f"{needle!r} not in {text!r}"
    return text


async def put(client: TestClient[Any, Any], path: str, body: bytes = b"",
              headers: dict[str, str] | None = None) -> ClientResponse:
    return await client.put(S + path, data=body, headers=headers if headers is not None else TEXT)


async def post(client: TestClient[Any, Any], path: str, body: bytes, headers: dict[str, str] | None = None
               ) -> ClientResponse:
    return await client.post(S + path, data=body, headers=headers if headers is not None else TEXT)


def sse_events(body: bytes) -> list[tuple[str, str]]:
    """Dispatched SSE events per the WHATWG parsing rules: (event, data)."""
    events: list[tuple[str, str]] = []
    event, data = "", list[str]()
    text = body.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    for line in text.split("\n"):
        if line == "":
            if data:
                events.append((event or "message", "\n".join(data)))
            event, data = "", []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
    return events


# --- bad input: a clear 4xx, nothing changed ------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("offset=abc", "malformed offset"),
        ("offset=1", "malformed offset"),
        ("offset=0000000000000000_000000000000000", "malformed offset"),
        ("offset=0000000000000000_00000000000000001", "malformed offset"),
        ("offset=0000000000000000-0000000000000001", "malformed offset"),
        ("offset=+000000000000000_0000000000000001", "malformed offset"),
        ("offset=%200000000000000000_0000000000000001", "malformed offset"),
        ("offset=000000000000000%EF%BC%91_0000000000000000", "offset"),  # fullwidth digit one
        ("offset=", "empty"),
        ("offset=-1&offset=now", "one offset"),
        ("offset=0000000000000000_0000000000000999", "beyond the end"),
        ("offset=-1&live=foo", "live mode"),
        ("offset=-1&live=", "live mode"),
        ("live=long-poll", "requires an offset"),
        ("live=sse", "requires an offset"),
        ("offset=-1&live=sse&live=long-poll", "one live parameter"),  # (the first one won)
        ("offset=-1&live=long-poll&live=sse", "one live parameter"),
    ],
)
async def test_bad_read_parameters(client: TestClient[Any, Any], query: str, needle: str) -> None:
    await put(client, "s", b"abc")
    before = await state(client, "s")
    await assert_error(await client.get(f"{S}s?{query}"), 400, needle)
    assert await state(client, "s") == before


async def test_offset_inside_a_json_message_is_refused(client: TestClient[Any, Any]) -> None:
    await put(client, "j", b'[{"a": 1}, {"b": 2}]', JSON_CT)
    await assert_error(await client.get(f"{S}j?offset=0000000000000000_0000000000000003"), 400, "boundary")


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        (b"a/../b", "'..'"),
        (b"..", "'..'"),
        (b".", "'.'"),
        (b"a/./b", "'.'"),
        (b"a/..", "'..'"),
        (b"%2E%2E", "'..'"),
        (b"a/%2e/b", "'.'"),
        (b"a%00b", "NUL"),
        (b"%00", "NUL"),
        (b"a//b", "empty segment"),
        (b"/a", "empty segment"),
        (b"a/", "empty segment"),
        (b"", "empty"),
        (b"%ff", "UTF-8"),
        (b"a%C3", "UTF-8"),
        (b"a%0Ab", "control"),
        (b"a%0Db", "control"),
        (b"a%09b", "control"),
        (b"a%7Fb", "control"),
    ],
)
@pytest.mark.parametrize("method", ["PUT", "POST", "GET", "HEAD", "DELETE"])
async def test_bad_stream_paths(client: TestClient[Any, Any], method: str, target: bytes,
                                needle: str) -> None:
    await put(client, "b", b"keep")
    await put(client, "a", b"keep")
    before = await state(client, "a", "b")
    body = b"x" if method == "POST" else b""
    resp = await raw_request(port(client), method, S.encode() + target, TEXT, body)
    if method == "HEAD":
        assert resp.status == 400
    else:
        await assert_error(resp, 400, needle)
    assert await state(client, "a", "b") == before


@pytest.mark.parametrize("method", ["PUT", "GET"])
async def test_path_over_max_path_bytes(make_client: MakeClient, method: str) -> None:
    client = await make_client(max_path_bytes=20)
    ok = "é" * 10  # 20 bytes
    assert (await put(client, ok)).status == 201
    before = await state(client, ok)
    for too_long in ("x" * 21, "é" * 10 + "x", "a/" * 10 + "b"):
        resp = await client.request(method, S + too_long, headers=TEXT)
        await assert_error(resp, 400, "longer than 20 bytes")
    assert await state(client, ok) == before


async def gen(pieces: list[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def test_body_over_max_body_bytes(make_client: MakeClient) -> None:
    client = await make_client(max_body_bytes=1024)
    assert (await put(client, "s", b"a" * 1024)).status == 201  # exactly the limit is fine
    assert (await post(client, "s", b"b" * 1024)).status == 204
    before = await state(client, "s")
    await assert_error(await post(client, "s", b"c" * 1025), 413, "larger than 1024 bytes")
    await assert_error(await put(client, "new", b"c" * 1025), 413, "larger than 1024 bytes")
    await assert_error(await post(client, "s", b"c" * 100_000), 413, "larger than 1024 bytes")
    assert (await client.head(S + "new")).status == 404
    assert await state(client, "s") == before


@pytest.mark.parametrize("method", ["POST", "PUT"])
async def test_chunked_body_over_max_body_bytes(make_client: MakeClient, method: str) -> None:
    client = await make_client(max_body_bytes=1024)
    assert (await put(client, "s", b"a")).status == 201
    before = await state(client, "s", "new")
    path = "s" if method == "POST" else "new"
    resp = await client.request(method, S + path, data=gen([b"x" * 300] * 4), headers=TEXT)
    assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
    await assert_error(resp, 413, "larger than 1024 bytes")
    assert await state(client, "s", "new") == before


@pytest.mark.parametrize(
    "body",
    [b"{", b"[1,]", b'{"a": NaN}', b"[1] x", b"\xff", b"", b"   "],
)
async def test_invalid_json_append(client: TestClient[Any, Any], body: bytes) -> None:
    await put(client, "j", b'{"a": 1}', JSON_CT)
    before = await state(client, "j")
    resp = await post(client, "j", body, JSON_CT)
    await assert_error(resp, 400, "empty body" if not body else "JSON")
    assert await state(client, "j") == before


@pytest.mark.parametrize("body", [b"[]", b" [ ] ", b"[\n]"])
async def test_empty_array_post_is_refused_but_put_is_fine(client: TestClient[Any, Any], body: bytes) -> None:
    assert (await put(client, "j", body, JSON_CT)).status == 201
    before = await state(client, "j")
    await assert_error(await post(client, "j", body, JSON_CT), 400, "empty JSON array")
    assert await state(client, "j") == before
    assert json.loads(await (await client.get(S + "j")).read()) == []


async def test_invalid_json_create_creates_nothing(client: TestClient[Any, Any]) -> None:
    before = stats(client)
    await assert_error(await put(client, "j", b"[1, 2", JSON_CT), 400, "JSON")
    assert (await client.head(S + "j")).status == 404
    assert stats(client) == before


async def test_post_without_content_type(client: TestClient[Any, Any]) -> None:
    await put(client, "s", b"abc")
    before = await state(client, "s")
    resp = await client.post(S + "s", data=b"x", skip_auto_headers=["Content-Type"])
    await assert_error(resp, 400, "Content-Type is required")
    raw = await raw_request(port(client), "POST", b"/v1/stream/s", {}, b"x")
    await assert_error(raw, 400, "Content-Type is required")
    assert await state(client, "s") == before
    # closing needs no Content-Type
    resp = await client.post(S + "s", headers={"Stream-Closed": "true"}, skip_auto_headers=["Content-Type"])
    assert resp.status == 204 and resp.headers["Stream-Closed"] == "true"


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({"Content-Type": "json"}, "Content-Type"),
        ({"Content-Type": "text/plain", "Stream-Seq": ""}, "Stream-Seq"),
        ({"Content-Type": "text/plain", "Producer-Id": "p"}, "together"),
        ({"Content-Type": "text/plain", "Producer-Id": "", "Producer-Epoch": "0", "Producer-Seq": "0"},
         "Producer-Id"),
        ({"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "1e3"},
         "Producer-Seq"),
        ({"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "-1", "Producer-Seq": "0"},
         "Producer-Epoch"),
        ({"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "0",
          "Producer-Seq": str(2**53)}, "Producer-Seq"),
        ({"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "0",
          "Producer-Seq": "9" * 5000}, "Producer-Seq"),
        ({"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "9" * 5000,
          "Producer-Seq": "0"}, "Producer-Epoch"),
    ],
)
async def test_bad_append_headers(client: TestClient[Any, Any], headers: dict[str, str], needle: str) -> None:
    await put(client, "s", b"abc")
    before = await state(client, "s")
    await assert_error(await post(client, "s", b"x", headers), 400, needle)
    assert await state(client, "s") == before


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({"Content-Type": "json"}, "Content-Type"),
        ({"Content-Type": "text/plain x"}, "Content-Type"),
        ({"Stream-TTL": "03600"}, "Stream-TTL"),
        ({"Stream-TTL": "3.6e3"}, "Stream-TTL"),
        ({"Stream-TTL": "9" * 5000}, "Stream-TTL"),
        ({"Stream-Expires-At": "tomorrow"}, "Stream-Expires-At"),
        ({"Stream-Expires-At": "2025-13-01T00:00:00Z"}, "Stream-Expires-At"),
        ({"Stream-TTL": "60", "Stream-Expires-At": "2030-01-01T00:00:00Z"}, "not both"),
        ({"Stream-Expires-At": "1999-01-01T00:00:00Z"}, "in the past"),
        ({"Stream-Fork-Offset": "0000000000000000_0000000000000000"}, "Stream-Forked-From"),
        ({"Stream-Forked-From": "src"}, "Stream-Forked-From"),
        ({"Stream-Forked-From": "/v1/stream/a/../src"}, "'..'"),
        ({"Stream-Forked-From": "/v1/stream/sr%FF"}, "not valid UTF-8"),
        ({"Stream-Forked-From": "/v1/stream/src", "Stream-Fork-Offset": "bogus"}, "Stream-Fork-Offset"),
        ({"Stream-Forked-From": "/v1/stream/src", "Stream-Fork-Offset": "0000000000000000_0000000000000000",
          "Stream-Fork-Sub-Offset": "-1"}, "Stream-Fork-Sub-Offset"),
        ({"Stream-Forked-From": "/v1/stream/src", "Stream-Fork-Offset": "0000000000000000_0000000000000000",
          "Stream-Fork-Sub-Offset": "9" * 5000}, "Stream-Fork-Sub-Offset"),
    ],
)
async def test_bad_create_headers(client: TestClient[Any, Any], headers: dict[str, str], needle: str) -> None:
    await put(client, "src", b"abc")
    before = await state(client, "src")
    await assert_error(await put(client, "new", b"", headers), 400, needle)
    assert (await client.head(S + "new")).status == 404
    assert await state(client, "src") == before


async def test_a_fork_names_its_source_as_its_url_spells_it(client: TestClient[Any, Any]) -> None:
    """Stream-Forked-From is the source's URL path, percent-decoded like a request's: the
    `url` a listing gives works as it is (a plain path was taken literally: 404; found by QA)."""
    assert (await client.put(S + "pc/sp%20ace", data=b"abc", headers=TEXT)).status == 201
    made = await client.put(S + "fk", headers={**TEXT, "Stream-Forked-From": "/v1/stream/pc/sp%20ace"})
    assert made.status == 201, await made.text()
    assert await (await client.get(S + "fk?offset=-1")).read() == b"abc"
    listed = await (await client.get("/ds3/streams?prefix=pc/")).json()
    assert [s["url"] for s in listed["streams"]] == ["/v1/stream/pc/sp%20ace"]


async def test_fork_from_a_path_that_is_not_utf8(client: TestClient[Any, Any]) -> None:
    await put(client, "src", b"abc")
    before = await state(client, "src")
    resp = await raw_request(port(client), "PUT", b"/v1/stream/new",
                             {"Stream-Forked-From": b"/v1/stream/a\xffb"})
    await assert_error(resp, 400, "UTF-8")
    assert await state(client, "src") == before


@pytest.mark.parametrize("method", ["PATCH", "TRACE", "PROPFIND"])
async def test_unknown_method_is_405_with_allow(client: TestClient[Any, Any], method: str) -> None:
    await put(client, "s", b"abc")
    before = await state(client, "s")
    resp = await raw_request(port(client), method, b"/v1/stream/s", TEXT, b"x")
    await assert_error(resp, 405, method)
    allow = {m.strip() for m in resp.headers["Allow"].split(",")}
    assert {"GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"} <= allow
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert await state(client, "s") == before


# --- headers on every response ---------------------------------------------------------------------------


async def test_security_headers_on_every_response(make_client: MakeClient) -> None:
    client = await make_client(max_body_bytes=1024)
    await put(client, "s", b"abc")
    await put(client, "c", b"x", {"Content-Type": "text/plain", "Stream-Closed": "true"})
    etag = (await client.get(S + "s")).headers["ETag"]
    requests: list[tuple[str, str, dict[str, str], bytes, int]] = [
        ("GET", S + "s", {"If-None-Match": etag}, b"", 304),
        ("PUT", S + "n", TEXT, b"", 201),
        ("PUT", S + "n", TEXT, b"", 200),
        ("PUT", S + "n", JSON_CT, b"", 409),
        ("POST", S + "s", TEXT, b"d", 204),
        ("POST", S + "s", {"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "0",
                           "Producer-Seq": "0"}, b"e", 200),
        ("POST", S + "s", {"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "0",
                           "Producer-Seq": "5"}, b"e", 409),
        ("POST", S + "c", TEXT, b"x", 409),
        ("POST", S + "s", TEXT, b"x" * 2000, 413),
        ("POST", S + "missing", TEXT, b"x", 404),
        ("POST", S + "s", {}, b"x", 400),
        ("GET", S + "s", {}, b"", 200),
        ("GET", S + "s?offset=now", {}, b"", 200),
        ("GET", S + "s?offset=now&live=long-poll", {}, b"", 204),
        ("GET", S + "c?offset=-1&live=sse", {}, b"", 200),
        ("GET", S + "s?offset=bogus", {}, b"", 400),
        ("GET", S + "missing", {}, b"", 404),
        ("GET", S + "a/../b", {}, b"", 400),
        ("GET", "/not-a-stream", {}, b"", 404),
        ("HEAD", S + "s", {}, b"", 200),
        ("HEAD", S + "missing", {}, b"", 404),
        ("OPTIONS", S + "s", {}, b"", 204),
        ("PATCH", S + "s", {}, b"", 405),
        ("POST", "/healthz", {}, b"", 405),
        ("DELETE", S + "n", {}, b"", 204),
        ("DELETE", S + "n", {}, b"", 404),
    ]
    for method, target, headers, body, status in requests:
        resp = await raw_request(port(client), method, target.encode(), headers, body)
        where = f"{method} {target} -> {resp.status}"
        assert resp.status == status, where
        assert resp.headers.get("X-Content-Type-Options") == "nosniff", where
        assert resp.headers.getall("Content-Security-Policy", []) == ["default-src 'none'; sandbox"], where
        if resp.status in (400, 404, 409, 410):  # a refusal is the state of a moment: never stored by a cache
            assert resp.headers.get("Cache-Control") == "no-store", where
        assert resp.headers.get("Cross-Origin-Resource-Policy"), where
        assert resp.headers.get("Access-Control-Allow-Origin") == "*", where


async def test_preflight_allows_the_protocol_headers(client: TestClient[Any, Any]) -> None:
    resp = await client.options(S + "any/path", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "producer-id, producer-epoch, producer-seq, if-none-match",
    })
    assert resp.status == 204
    allowed = {h.strip().lower() for h in resp.headers["Access-Control-Allow-Headers"].split(",")}
    for name in ("Content-Type", "If-None-Match", "Producer-Id", "Producer-Epoch", "Producer-Seq",
                 "Stream-Seq", "Stream-TTL", "Stream-Expires-At", "Stream-Closed", "Stream-Forked-From",
                 "Stream-Fork-Offset", "X-Request-Id"):  # (the README invites callers to send their id)
        assert name.lower() in allowed, name
    methods = {m.strip() for m in resp.headers["Access-Control-Allow-Methods"].split(",")}
    assert {"GET", "POST", "PUT", "DELETE", "HEAD"} <= methods
    exposed = {h.strip().lower() for h in resp.headers["Access-Control-Expose-Headers"].split(",")}
    for name in ("Stream-Next-Offset", "Stream-Cursor", "Stream-Up-To-Date", "Stream-Closed", "ETag",
                 "Producer-Epoch", "Producer-Seq", "Producer-Expected-Seq", "Producer-Received-Seq", "X-Request-Id"):
        assert name.lower() in exposed, name


# --- caching -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["*", 'W/"{etag}"', '"other", W/"{etag}"'])
async def test_if_none_match_compares_weakly_and_star_matches(client: TestClient[Any, Any], given: str) -> None:
    """RFC 9110 13.1.2: If-None-Match uses the weak comparison and `*` matches any current
    representation (both answered 200, only an exact strong tag was compared)."""
    await put(client, "w", b"abc")
    etag = (await client.get(S + "w")).headers["ETag"]
    again = await client.get(S + "w", headers={"If-None-Match": given.format(etag=etag.strip('"'))})
    assert again.status == 304 and again.headers["ETag"] == etag


async def test_etag_and_if_none_match(client: TestClient[Any, Any]) -> None:
    await put(client, "s", b"abc")
    first = await client.get(S + "s")
    etag = first.headers["ETag"]
    assert first.status == 200 and etag
    again = await client.get(S + "s", headers={"If-None-Match": etag})
    assert again.status == 304 and again.headers["ETag"] == etag
    assert await again.read() == b""
    listed = await client.get(S + "s", headers={"If-None-Match": f'"other", {etag}'})
    assert listed.status == 304
    assert (await client.get(S + "s", headers={"If-None-Match": '"other"'})).status == 200

    await post(client, "s", b"d")
    grown = await client.get(S + "s", headers={"If-None-Match": etag})
    assert grown.status == 200 and await grown.read() == b"abcd"
    etag2 = grown.headers["ETag"]
    assert etag2 != etag

    await client.post(S + "s", headers={"Stream-Closed": "true"})
    closed = await client.get(S + "s", headers={"If-None-Match": etag2})
    assert closed.status == 200, "the ETag must change when the stream closes"
    assert closed.headers["Stream-Closed"] == "true"
    assert closed.headers["ETag"] != etag2
    assert (await client.get(S + "s", headers={"If-None-Match": closed.headers["ETag"]})).status == 304


async def test_etag_differs_after_delete_and_recreate(client: TestClient[Any, Any]) -> None:
    await put(client, "s", b"abc")
    etag = (await client.get(S + "s")).headers["ETag"]
    await client.delete(S + "s")
    await put(client, "s", b"xyz")
    resp = await client.get(S + "s", headers={"If-None-Match": etag})
    assert resp.status == 200 and await resp.read() == b"xyz"


async def test_cache_control_no_store_on_head_and_now(client: TestClient[Any, Any]) -> None:
    await put(client, "s", b"abc")
    assert (await client.head(S + "s")).headers["Cache-Control"] == "no-store"
    now = await client.get(S + "s?offset=now")
    assert now.status == 200 and await now.read() == b""
    assert now.headers["Cache-Control"] == "no-store"
    assert now.headers["Stream-Up-To-Date"] == "true"
    assert now.headers["Stream-Next-Offset"] == (await client.head(S + "s")).headers["Stream-Next-Offset"]
    await put(client, "j", b"[1]", JSON_CT)
    jnow = await client.get(S + "j?offset=now")
    assert await jnow.read() == b"[]" and jnow.headers["Cache-Control"] == "no-store"
    # a page with data may be cached; an empty page at the tail only for --tail-max-age (1 s)
    assert "no-store" not in (await client.get(S + "s")).headers["Cache-Control"]
    tail = now.headers["Stream-Next-Offset"]
    assert (await client.get(f"{S}s?offset={tail}")).headers["Cache-Control"] == "public, max-age=1"


@pytest.mark.parametrize(("tail_max_age", "expected"), [(0, "no-store"), (1, "public, max-age=1"),
                                                        (5, "public, max-age=5")])
async def test_tail_max_age_sets_what_a_cache_may_keep_of_nothing_new(
        make_client: MakeClient, tail_max_age: int, expected: str) -> None:
    """What changes when data arrives carries --tail-max-age: the empty tail page, a long-poll's
    204 (nothing within the timeout), and a catch-up page with data that ends at the tail (it
    grows: a client that reads once would take an old copy for the stream's state). A page that
    ends before the tail and a long-poll's 200 keep the long lifetime; offset=now and HEAD are
    never stored."""
    client = await make_client(tail_max_age=tail_max_age, long_poll_timeout=0.2, max_read_bytes=1024)
    await put(client, "t", b"a" * 1000)
    await post(client, "t", b"b" * 500)
    tail = (await client.head(S + "t")).headers["Stream-Next-Offset"]
    assert (await client.get(f"{S}t?offset={tail}")).headers["Cache-Control"] == expected
    lp = await client.get(f"{S}t?offset={tail}&live=long-poll&cursor=1")
    assert lp.status == 204 and lp.headers["Cache-Control"] == expected
    assert lp.headers["Stream-Cursor"] != "1"  # a cached 204 is one round: the next asks another key
    assert (await client.get(f"{S}t?offset=now")).headers["Cache-Control"] == "no-store"
    assert (await client.head(S + "t")).headers["Cache-Control"] == "no-store"

    first = await client.get(S + "t")  # the first message alone (a page holds at most 1,024 bytes)
    assert await first.read() == b"a" * 1000 and "Stream-Up-To-Date" not in first.headers
    assert first.headers["Cache-Control"] == "public, max-age=60, stale-while-revalidate=300"
    last = await client.get(f"{S}t?offset={first.headers['Stream-Next-Offset']}")
    assert await last.read() == b"b" * 500 and last.headers["Stream-Up-To-Date"] == "true"
    assert last.headers["Cache-Control"] == expected
    lp200 = await client.get(f"{S}t?offset={first.headers['Stream-Next-Offset']}&live=long-poll&cursor=1")
    assert lp200.status == 200 and lp200.headers["Cache-Control"] == "public, max-age=60, stale-while-revalidate=300"


async def test_a_long_poll_from_now_is_never_stored(make_client: MakeClient) -> None:
    """It answers what came after the tail this request found: the same URL later means a later
    tail. Cached (it was, for 60 s), a CDN answered later subscribers with old messages at once."""
    client = await make_client(long_poll_timeout=0.3)
    await put(client, "n", b"old")
    waiting = asyncio.ensure_future(client.get(S + "n?offset=now&live=long-poll&cursor=1"))
    await asyncio.sleep(0.1)
    await post(client, "n", b"new")
    got = await waiting
    assert got.status == 200 and await got.read() == b"new"
    assert got.headers["Cache-Control"] == "no-store"
    timed_out = await client.get(S + "n?offset=now&live=long-poll")
    assert timed_out.status == 204 and timed_out.headers["Cache-Control"] == "no-store"
    await client.post(S + "n", headers={"Stream-Closed": "true"})
    closed = await client.get(S + "n?offset=now&live=long-poll")
    assert closed.status == 204 and closed.headers["Stream-Closed"] == "true"
    assert closed.headers["Cache-Control"] == "no-store"


# --- JSON mode round trip --------------------------------------------------------------------------------


async def test_json_stream_returns_exactly_what_was_posted(client: TestClient[Any, Any]) -> None:
    bodies = [
        b'{"n": 1}',
        b'[{"n": 2}, {"n": 3}]',
        b'  [ [4, 5] , "six,6]" ]\n',
        b'{\n  "n": 7,\n  "text": "line1\\nline2"\n}',
        b'"a string with , and ] and ["',
        '{"unicode": "é漢🎉"}'.encode(),
        b"[[[1]]]",
    ]
    expected: list[Any] = [{"n": 1}, {"n": 2}, {"n": 3}, [4, 5], "six,6]", {"n": 7, "text": "line1\nline2"},
                           "a string with , and ] and [", {"unicode": "é漢🎉"}, [[1]]]
    await put(client, "j", b"", JSON_CT)
    for body in bodies:
        resp = await post(client, "j", body, {"Content-Type": "application/json; charset=utf-8"})
        assert resp.status == 204
    resp = await client.get(S + "j")
    assert resp.headers["Content-Type"].startswith("application/json")
    raw = await resp.read()
    assert json.loads(raw) == expected
    assert b'{\n  "n": 7,\n  "text": "line1\\nline2"\n}' in raw  # whitespace inside a message is kept
    # every message-aligned offset reads the rest of the list
    seen: list[Any] = []
    offset = "-1"
    while True:
        page = await client.get(f"{S}j?offset={offset}")
        seen.append(json.loads(await page.read()))
        if page.headers.get("Stream-Up-To-Date") == "true":
            break
        offset = page.headers["Stream-Next-Offset"]
    assert [m for p in seen for m in p] == expected


# --- chunked uploads and paging -------------------------------------------------------------------------


async def test_chunked_post_is_appended_whole(client: TestClient[Any, Any]) -> None:
    await put(client, "s")
    pieces = [b"first piece|", b"", b"second|", b"x" * 5000, b"|end"]
    resp = await client.post(S + "s", data=gen(pieces), headers=TEXT)
    assert resp.status == 204
    assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
    assert await (await client.get(S + "s")).read() == b"".join(pieces)

    await put(client, "j", b"", JSON_CT)
    resp = await client.post(S + "j", data=gen([b'[{"a"', b': 1}, ', b'{"b": 2}', b"]"]), headers=JSON_CT)
    assert resp.status == 204
    assert json.loads(await (await client.get(S + "j")).read()) == [{"a": 1}, {"b": 2}]

    resp = await client.put(S + "c", data=gen([b"created ", b"chunked"]), headers=TEXT)
    assert resp.status == 201
    assert await (await client.get(S + "c")).read() == b"created chunked"


@pytest.mark.parametrize("content_type", ["application/octet-stream", "application/json"])
async def test_paging_returns_everything_exactly_once(make_client: MakeClient, content_type: str) -> None:
    client = await make_client(max_read_bytes=1024)
    headers = {"Content-Type": content_type}
    await put(client, "s", b"", headers)
    messages: list[bytes] = []
    for i in range(60):
        size = (i * 37) % 150 + 1
        if content_type == "application/json":
            msg = json.dumps({"i": i, "pad": "p" * size}).encode()
        else:
            msg = bytes([i]) * size
        messages.append(msg)
        assert (await post(client, "s", msg, headers)).status == 204
    big = b"B" * 3000 if content_type != "application/json" else json.dumps("B" * 3000).encode()
    messages.append(big)  # one message larger than a page still arrives whole
    await post(client, "s", big, headers)

    offset, last = "-1", ""
    got: list[Any] = []
    pages = 0
    while True:
        resp = await client.get(f"{S}s?offset={offset}")
        assert resp.status == 200
        body = await resp.read()
        pages += 1
        if content_type == "application/json":
            page = json.loads(body)
            assert len(json.dumps(page)) <= 1024 + 3100
            got.extend(page)
        else:
            got.append(body)
            assert len(body) <= 1024 or body == big
        nxt = resp.headers["Stream-Next-Offset"]
        assert nxt > last, "offsets must increase page by page"
        last = offset = nxt
        if resp.headers.get("Stream-Up-To-Date") == "true":
            break
        assert pages < 100
    assert pages > 5
    if content_type == "application/json":
        assert got == [json.loads(m) for m in messages]
    else:
        assert b"".join(got) == b"".join(messages)
    assert last == (await client.head(S + "s")).headers["Stream-Next-Offset"]


# --- live reads -----------------------------------------------------------------------------------------


async def test_long_poll_wakes_on_append(make_client: MakeClient) -> None:
    client = await make_client(long_poll_timeout=10)
    await put(client, "s", b"old")
    tail = (await client.head(S + "s")).headers["Stream-Next-Offset"]

    async def poll(offset: str) -> tuple[float, ClientResponse, bytes]:
        t0 = time.monotonic()
        resp = await client.get(f"{S}s?offset={offset}&live=long-poll")
        return time.monotonic() - t0, resp, await resp.read()

    waiting = [asyncio.create_task(poll(tail)), asyncio.create_task(poll("now"))]
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in waiting), "long-poll answered before any data arrived"
    await post(client, "s", b"new")
    for task in waiting:
        elapsed, resp, body = await asyncio.wait_for(task, 5)
        assert resp.status == 200 and body == b"new"
        assert elapsed < 3, f"long-poll took {elapsed:.1f}s to see an append (timeout 10s)"
        assert resp.headers["Stream-Cursor"]
        assert resp.headers["Stream-Next-Offset"] > tail


async def test_long_poll_timeout_and_closed(client: TestClient[Any, Any]) -> None:
    await put(client, "s", b"abc")
    tail = (await client.head(S + "s")).headers["Stream-Next-Offset"]
    t0 = time.monotonic()
    resp = await client.get(f"{S}s?offset={tail}&live=long-poll&cursor=5")
    assert 0.8 < time.monotonic() - t0 < 5
    assert resp.status == 204
    assert resp.headers["Stream-Up-To-Date"] == "true"
    assert resp.headers["Stream-Next-Offset"] == tail
    assert int(resp.headers["Stream-Cursor"]) > 5

    await client.post(S + "s", headers={"Stream-Closed": "true"})
    t0 = time.monotonic()
    resp = await client.get(f"{S}s?offset={tail}&live=long-poll")
    assert time.monotonic() - t0 < 0.5, "a closed stream at its tail must not wait"
    assert resp.status == 204 and resp.headers["Stream-Closed"] == "true"


async def test_long_poll_sees_close_while_waiting(make_client: MakeClient) -> None:
    client = await make_client(long_poll_timeout=10)
    await put(client, "s", b"abc")
    tail = (await client.head(S + "s")).headers["Stream-Next-Offset"]
    task = asyncio.create_task(client.get(f"{S}s?offset={tail}&live=long-poll"))
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    await client.post(S + "s", headers={"Stream-Closed": "true"})
    resp = await asyncio.wait_for(task, 5)
    assert time.monotonic() - t0 < 3
    assert resp.status == 204 and resp.headers["Stream-Closed"] == "true"


async def test_sse_binary_stream_is_base64(client: TestClient[Any, Any]) -> None:
    data = [bytes(range(256)), b"\r\n\r\nevent: control\n\n", b"\x00" * 10]
    await put(client, "b", data[0], BIN)
    for chunk in data[1:]:
        await post(client, "b", chunk, BIN)
    await client.post(S + "b", headers={"Stream-Closed": "true"})
    resp = await client.get(S + "b?offset=-1&live=sse")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["Stream-SSE-Data-Encoding"] == "base64"
    events = sse_events(await asyncio.wait_for(resp.read(), 5))
    payload = b"".join(base64.b64decode(d.replace("\n", ""), validate=True) for e, d in events if e == "data")
    assert payload == b"".join(data)
    controls = [json.loads(d) for e, d in events if e == "control"]
    assert controls[-1]["streamClosed"] is True
    assert controls[-1]["streamNextOffset"] == (await client.head(S + "b")).headers["Stream-Next-Offset"]
    assert {e for e, _ in events} == {"data", "control"}


async def test_sse_json_stream_sends_arrays(client: TestClient[Any, Any]) -> None:
    await put(client, "j", b"", JSON_CT)
    posted: list[Any] = []
    for body in (b'{"a": 1}', b'[{"b": "x\\ny"}, [1, 2]]', b'{\n "c": "with\\r\\nbreaks"\n}'):
        await post(client, "j", body, JSON_CT)
        value = json.loads(body)
        posted.extend(value if isinstance(value, list) else [value])
    await client.post(S + "j", headers={"Stream-Closed": "true"})
    resp = await client.get(S + "j?offset=-1&live=sse")
    assert "Stream-SSE-Data-Encoding" not in resp.headers
    events = sse_events(await asyncio.wait_for(resp.read(), 5))
    got: list[Any] = []
    for event, data in events:
        if event == "data":
            value = json.loads(data)
            assert isinstance(value, list)
            got.extend(value)
    assert got == posted


async def test_sse_text_stream_keeps_leading_spaces(client: TestClient[Any, Any]) -> None:
    text = b"  indented\n\tand\n more"
    await put(client, "t", text, TEXT)
    await client.post(S + "t", headers={"Stream-Closed": "true"})
    resp = await client.get(S + "t?offset=-1&live=sse")
    events = sse_events(await asyncio.wait_for(resp.read(), 5))
    got = "".join(d for e, d in events if e == "data")
    assert got == text.decode(), "a text stream must read the same over SSE as over a catch-up GET"


async def test_sse_wakes_on_append(make_client: MakeClient) -> None:
    client = await make_client(sse_max_seconds=5)
    await put(client, "s", b"", TEXT)
    resp = await client.get(S + "s?offset=now&live=sse")
    await asyncio.sleep(0.2)
    await post(client, "s", b"live!")
    await client.post(S + "s", headers={"Stream-Closed": "true"})
    t0 = time.monotonic()
    events = sse_events(await asyncio.wait_for(resp.read(), 5))
    assert time.monotonic() - t0 < 3
    assert [d for e, d in events if e == "data"] == ["live!"]
    assert json.loads(events[-1][1])["streamClosed"] is True


# --- restart ---------------------------------------------------------------------------------------------


async def test_data_survives_an_app_restart(make_client: MakeClient) -> None:
    first = await make_client()
    await put(first, "bin", bytes(range(256)), BIN)
    await put(first, "j", b'[{"a": 1}, {"b": [2]}]', JSON_CT)
    await put(first, "ttl", b"t", {"Content-Type": "text/plain", "Stream-TTL": "3600"})
    await put(first, "closed", b"final", {"Content-Type": "text/plain", "Stream-Closed": "true"})
    producer = {"Content-Type": "text/plain", "Producer-Id": "p", "Producer-Epoch": "2", "Producer-Seq": "0"}
    await put(first, "prod")
    assert (await post(first, "prod", b"once", producer)).status == 200
    await post(first, "bin", b"more", BIN)
    await post(first, "j", b'{"c": 3}', {"Content-Type": "application/json", "Stream-Seq": "0005"})
    paths = ["bin", "j", "ttl", "closed", "prod"]
    before = await state(first, *paths)
    heads = [dict((await first.head(S + p)).headers) for p in paths]
    await first.close()

    second = await make_client()
    assert await state(second, *paths) == before
    for p, h in zip(paths, heads, strict=True):
        again = (await second.head(S + p)).headers
        for name in ("Content-Type", "Stream-Next-Offset", "Stream-TTL", "Stream-Closed"):
            assert again.get(name) == h.get(name), (p, name)
    dup = await post(second, "prod", b"once", producer)
    assert dup.status == 204 and dup.headers["Producer-Seq"] == "0"
    stale = await post(second, "prod", b"zombie", {**producer, "Producer-Epoch": "1"})
    await assert_error(stale, 403, "epoch")
    assert stale.headers["Producer-Epoch"] == "2"
    regress = await post(second, "j", b"1", {"Content-Type": "application/json", "Stream-Seq": "0004"})
    await assert_error(regress, 409, "Stream-Seq")
    await assert_error(await post(second, "closed", b"x"), 409, "closed")
    assert await (await second.get(S + "prod")).read() == b"once"


# --- requests that must not wedge the server (a real process: it can be killed if they do) ---------------


@pytest.fixture
def proc(tmp_path: Path) -> Any:
    p = ingester(tmp_path / "proc-data", "--long-poll-timeout", "1").start()
    yield p
    p.kill()


async def assert_still_writes(p: Proc) -> None:
    port = p.port
    for i in range(2):
        try:
            resp = await raw_request(port, "POST", b"/v1/stream/s", TEXT, b"after%d" % i, timeout=5)
        except TimeoutError:
            pytest.fail("the ingester stopped answering writes after one bad request")
        assert resp.status == 204, resp


@pytest.mark.parametrize(
    ("method", "headers", "needle"),
    [
        ("POST", {"Content-Type": "text/plain", "Stream-Seq": b"a\xffb"}, "Stream-Seq"),
        ("POST", {"Content-Type": "text/plain", "Producer-Id": b"p\xff", "Producer-Epoch": "0",
                  "Producer-Seq": "0"}, "Producer-Id"),
        ("PUT", {"Content-Type": b"text/plain; charset=\xff"}, "Content-Type"),
        ("PUT", {"Content-Type": "text/plain", "Stream-Expires-At": b"2030-01-01T00:00:00\xffZ"},
         "Expires-At"),
    ],
)
async def test_header_bytes_that_are_not_utf8(proc: Proc, method: str, headers: Mapping[str, str | bytes],
                                               needle: str) -> None:
    port = proc.port
    assert (await raw_request(port, "PUT", b"/v1/stream/s", TEXT, b"abc")).status == 201
    target = b"/v1/stream/s" if method == "POST" else b"/v1/stream/new"
    try:
        resp = await raw_request(port, method, target, headers, b"x", timeout=5)
    except TimeoutError:
        pytest.fail("a request with a non-UTF-8 header byte never got an answer")
    await assert_error(resp, 400, needle)
    await assert_still_writes(proc)
    got = await raw_request(port, "GET", b"/v1/stream/s")
    assert got.body == b"abcafter0after1"
    assert (await raw_request(port, "HEAD", b"/v1/stream/new")).status == 404
