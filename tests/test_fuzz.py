"""Fuzzing with hypothesis: the HTTP surface of the ingester and the reader, and the pure parsers.

HTTP: random methods, paths (percent-encoded odd unicode, dot segments, broken escapes, the
extension endpoints, ds3's own routes), query strings, headers (Content-Type, Stream-*,
Producer-*, Authorization, ...) and bodies (invalid JSON and UTF-8 included) go as raw HTTP/1.1
to an in-process ingester + reader pair (aiohttp servers built with create_app, auth on, sealing
into a local directory) and to real `ds3 ingester` / `ds3 reader` processes (auth off). Every
well-formed request must get a response (never a dropped connection) that is not a 5xx, and
control streams written before the fuzzing must read back byte for byte afterwards: bad input
never loses or corrupts stored data. Bad input aimed at the control streams themselves must be
refused with a 4xx.

Parsers: offsets, protocol headers and paths, JSON mode, the extension endpoints and the
bootstrap framing, bucket URLs, SSE framing, and the chunk format (corrupted objects raise
ChunkFormatError and nothing else).

Runs are reproducible (derandomize=True, no example database) and bounded (about 30 s here).
DS3_FUZZ_SCALE=N multiplies every example count and draws fresh random examples, for long
local runs:  DS3_FUZZ_SCALE=20 .venv/bin/pytest tests/test_fuzz.py"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import re
import secrets
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ingester.app import create_app as create_ingester
from reader.app import create_app as create_reader
from shared import buckets, chunks, extensions, jsonmode, offsets, sse
from shared import protocol as P
from shared.config import AuthConfig, IngesterConfig, LimitsConfig, ReaderConfig
from shared.errors import BadRequest
from tests.cluster import Cluster, StoreView
from tests.procs import free_port

SCALE = max(1, int(os.environ.get("DS3_FUZZ_SCALE", "1")))


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples * SCALE, derandomize=SCALE == 1, database=None, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


TOKEN = "fuzz-token-0123456789abcdef"
INTERNAL = "fuzz-internal-token-0123456789"
AUTH = AuthConfig(
    tokens=json.dumps([{"token": TOKEN, "sub": "fuzz", "read": ["*"], "write": ["*"]}]),
    private=("stream:private/",), internal_token=INTERNAL,
)
LIMITS = LimitsConfig(write_rate=0, create_rate=0, max_live_per_client=0)
TIMEOUT = 15.0


# ---------------------------------------------------------------- raw HTTP
@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def send(port: int, method: str, target: bytes, headers: list[tuple[bytes, bytes]] | None = None,
         body: bytes = b"") -> Reply:
    """One request, exactly these bytes (Content-Length added); the whole answer, or its head
    only for an event stream. Raises when the connection drops without a response."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        head = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
        head += [k + b": " + v for k, v in headers or []]
        head.append(b"Content-Length: %d" % len(body))
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        resp = http.client.HTTPResponse(s, method=method)
        resp.begin()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        if hdrs.get("content-type", "").startswith("text/event-stream"):
            return Reply(resp.status, hdrs, b"")  # an SSE stream: its status and headers are the answer
        return Reply(resp.status, hdrs, resp.read())


def enc(path: str) -> bytes:
    return quote(path, safe="/").encode()


def catch_up(port: int, url: str, token: str | None = TOKEN) -> tuple[bytes, str]:
    """Every byte of a stream (JSON streams: the messages' text joined) and its tail offset."""
    auth = [(b"Authorization", f"Bearer {token}".encode())] if token else []
    out, offset = [], "-1"
    for _ in range(1000):
        r = send(port, "GET", enc(url) + b"?offset=" + offset.encode(), auth)
        assert r.status == 200, f"GET {url}?offset={offset}: {r.status} {r.body[:200]!r}"
        out.append(r.body)
        offset = r.headers["stream-next-offset"]
        if r.headers.get("stream-up-to-date") == "true":
            return b"".join(out), offset
    raise AssertionError(f"{url}: no end in sight")


# ---------------------------------------------------------------- servers
class Loop:
    """An asyncio loop in a thread, for aiohttp servers the synchronous tests talk to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list[web.AppRunner] = []

    def serve(self, app: web.Application) -> int:
        port = free_port()

        async def start() -> None:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        return port

    def close(self) -> None:
        for runner in reversed(self.runners):
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Control:
    """Streams written before the fuzzing, with what they must still hold afterwards."""

    urls: dict[str, bytes] = field(default_factory=dict)  # url -> expected catch-up body
    tails: dict[str, str] = field(default_factory=dict)  # url -> Stream-Next-Offset
    json_url: str = ""
    text_url: str = ""

    @classmethod
    def create(cls, port: int, token: str | None) -> Control:
        tag = secrets.token_hex(8)
        auth = [(b"Authorization", f"Bearer {token}".encode())] if token else []
        c = cls()
        bucket = f"ctl{tag}"
        c.text_url, c.json_url = f"/v1/stream/ctl-{tag}/text", f"/v1/stream/ctl-{tag}/json"
        plan: list[tuple[str, str, list[bytes]]] = [
            (c.text_url, "text/plain", [b"hello ", "wörld ☃ ".encode(), b"x" * 3000, b"\r\n end"]),
            (c.json_url, "application/json", [b'{"a":1}', b'[{"b":[1,2]},"s",null]', b"  3.5  "]),
            (f"/v1/stream/ctl-{tag}/bin", "application/octet-stream", [bytes(range(256)) * 9, b"\x00\xff"]),
            (f"/v1/stream/private/ctl-{tag}", "text/plain", [b"private data"]),
            (f"/v1/buckets/{bucket}/s1", "text/plain", [b"in a bucket"]),
        ]
        r = send(port, "PUT", f"/v1/buckets/{bucket}".encode(), auth)
        assert r.status == 201, r
        for url, ct, appends in plan:
            r = send(port, "PUT", enc(url), [*auth, (b"Content-Type", ct.encode())])
            assert r.status == 201, (url, r)
            for body in appends:
                r = send(port, "POST", enc(url), [*auth, (b"Content-Type", ct.encode())], body)
                assert r.status == 204, (url, r)
            if ct == "application/json":
                msgs = [m for b in appends for m in jsonmode.split_messages(b, allow_empty_array=False)]
                c.urls[url] = jsonmode.render_stored(b"".join(jsonmode.frame(m) for m in msgs))
            else:
                c.urls[url] = b"".join(appends)
            c.tails[url] = r.headers["stream-next-offset"]
        return c

    def check(self, *ports: int, token: str | None = TOKEN) -> None:
        for port in ports:
            for url, want in self.urls.items():
                got, tail = catch_up(port, url, token)
                if url == self.json_url:  # pages of a JSON stream are arrays each: compare messages
                    assert _json_messages(got) == json.loads(want), url
                else:
                    assert got == want, f"{url} on port {port}: {got[:100]!r}... != {want[:100]!r}..."
                assert tail == self.tails[url], url


def _json_messages(body: bytes) -> list[Any]:
    out: list[Any] = []
    for m in re.finditer(rb"\[.*?\](?=\[|$)", body, re.S):
        out += json.loads(m.group(0))
    return out


@dataclass
class Pair:
    ingester: int
    reader: int
    control: Control
    token: str | None


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """An in-process ingester (sealing 1 KiB chunks into a local directory) and reader, auth on."""
    work = tmp_path_factory.mktemp("fuzz")
    store = f"file://{work / 'objects'}"
    (work / "objects").mkdir()
    loop = Loop()
    try:
        ing = loop.serve(create_ingester(IngesterConfig(
            data_dir=work / "data", store=store, seal_bytes=1024, seal_age=0.2, long_poll_timeout=0.3,
            sse_max_seconds=1, max_body_bytes=1 << 20, auth=AUTH, limits=LIMITS,
        )))
        rdr = loop.serve(create_reader(ReaderConfig(
            ingester=f"http://127.0.0.1:{ing}", store=store, long_poll_timeout=0.3, sse_max_seconds=1,
            descriptor_ttl=0.05, max_body_bytes=1 << 20, auth=AUTH, limits=LIMITS,
        )))
        yield Pair(ing, rdr, Control.create(rdr, TOKEN), TOKEN)
    finally:
        loop.close()


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Real `ds3 ingester` + `ds3 reader` processes, auth off."""
    work = tmp_path_factory.mktemp("fuzz-procs")
    extra = ["--long-poll-timeout", "0.3", "--sse-max-seconds", "1"]
    with Cluster(work, StoreView.local(work / "objects"), seal_bytes=1024, seal_age=0.2,
                 ingester_args=extra, reader_args=extra[2:]) as c:
        yield Pair(c.ingester.port, c.reader.port, Control.create(c.reader.port, None), None)


# ---------------------------------------------------------------- request strategies
NAMES = ["a", "b", "fz", "fz/x", "private/p", "snap", "dir/sub/leaf"]  # shared, so requests meet
BUCKET_IDS = ["fzbk", "fz_b-2", "FZBK", "abc", "x" * 65]
ODD = [".", "..", "%", "%2", "%zz", "%ff", "%C3%28", "%00", "%2F", "%2e%2e", "%0a", "%e2%98%83", "%ed%a0%80",
       "%F0%9F%92%A9", "%7F", "%20", "~", "'\"<>", "%25"]

# text of any code point (surrogates included: quote() encodes them with surrogatepass below)
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)


def _pct(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


segment = st.one_of(
    st.sampled_from(["a", "b", "fz", "x", "snapshot", "bootstrap", "streams", "0" * 16 + "_" + "0" * 16]),
    st.sampled_from(ODD),
    any_text.map(_pct),
    st.text(alphabet="abc._-~%", min_size=1, max_size=6),
)
offset_text = st.one_of(
    st.sampled_from(["-1", "now", "", "0", "-2", "NOW", offsets.encode(0, 0), offsets.encode(10**16 - 1, 10**16 - 1)]),
    st.builds(offsets.encode, st.integers(0, 10**16 - 1), st.integers(0, 5000)),
    st.builds(lambda c, p: f"{c}_{p}", st.integers(-5, 10**17), st.integers(-5, 10**17)),
    any_text,
)


@st.composite
def paths(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["stream", "stream", "stream", "bucket", "endpoint", "ds3", "internal", "other"]))
    segs = draw(st.lists(segment, min_size=0, max_size=4))
    if kind == "stream":
        name = draw(st.sampled_from(NAMES))
        return "/v1/stream/" + (quote(name) if draw(st.booleans()) else "/".join(segs))
    if kind == "bucket":
        b = draw(st.one_of(st.sampled_from(BUCKET_IDS), segment))
        rest = draw(st.sampled_from(["", "/", "/streams", "/s1", "/" + "/".join(segs)]))
        return f"/v1/buckets/{b}{rest}"
    if kind == "endpoint":
        base = "/v1/stream/" + quote(draw(st.sampled_from(NAMES))) if draw(st.booleans()) else \
            f"/v1/buckets/{draw(st.sampled_from(BUCKET_IDS))}/s1"
        end = draw(st.sampled_from(["/snapshot", "/bootstrap", "/snapshot/"]))
        if end == "/snapshot/":
            end += quote(draw(offset_text), safe="")
        return base + end
    if kind == "internal":
        return draw(st.sampled_from(["/_ds3/touch", "/_ds3/parts"]))
    if kind == "ds3":
        return draw(st.sampled_from(["/ds3/streams", "/ds3/buckets", "/metrics", "/healthz", "/readyz",
                                     "/console", "/console/", "/console/console.js", "/console/..%2Fapp.py"]))
    return "/" + "/".join(segs)


QUERY_KEYS = ["offset", "live", "cursor", "prefix", "after", "limit", "path", "from", "until", "boundary"]


@st.composite
def queries(draw: st.DrawFn) -> str:
    pairs = []
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.one_of(st.sampled_from(QUERY_KEYS), segment))
        if key == "offset":
            value = _pct(draw(offset_text))
        elif key == "live":
            value = draw(st.sampled_from(["sse", "long-poll", "", "SSE", "poll"]))
        elif key == "limit":
            value = draw(st.one_of(st.integers(-2, 2000).map(str), segment))
        elif key == "path":
            value = draw(st.one_of(st.sampled_from(NAMES), st.text(max_size=600).map(_pct)))
        elif key == "boundary":
            value = draw(st.sampled_from(["ds3-" + "0" * 32, "x", ""]))
        else:
            value = draw(st.one_of(segment, offset_text.map(_pct)))
        pairs.append(f"{key}={value}" if draw(st.integers(0, 9)) else key)
    return "?" + "&".join(pairs) if pairs else ""


# Header values: visible ASCII and obs-text (bytes 0x80-0xff), as HTTP allows.
header_value = st.one_of(
    st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7f).strip()),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=40).map(str.encode),
)
CONTENT_TYPES = [b"text/plain", b"application/json", b"application/octet-stream", b"application/json; charset=utf-8",
                 b"APPLICATION/JSON", b"text/plain;charset=\xff", b"multipart/mixed; boundary=x", b"", b"/", b"a/b/c"]
numbers = st.one_of(st.integers(-3, 2**64).map(lambda n: str(n).encode()), st.sampled_from([b"", b"1e3", b"0x10", b"01", b" 1", b"\xd9\xa3"]))
STREAM_HEADERS: dict[bytes, st.SearchStrategy[bytes]] = {
    b"Content-Type": st.one_of(st.sampled_from(CONTENT_TYPES), header_value),
    b"Stream-TTL": numbers,
    b"Stream-Expires-At": st.one_of(st.sampled_from([b"2099-01-01T00:00:00Z", b"0001-01-01T00:00:00+23:59",
                                                      b"9999-12-31T23:59:59-23:59", b"2020-02-30T00:00:00Z"]), header_value),
    b"Stream-Closed": st.sampled_from([b"true", b"TRUE", b"false", b"1", b""]),
    b"Stream-Seq": st.one_of(numbers, header_value),
    b"Stream-Forked-From": st.one_of(st.sampled_from([b"/v1/stream/a", b"/v1/stream/fz", b"/v1/buckets/fzbk/s1",
                                                       b"/v1/buckets/fzbk/%2F", b"/v1/stream/..", b"a"]), header_value),
    b"Stream-Fork-Offset": st.one_of(offset_text.map(lambda t: t.encode("utf-8", "surrogatepass")[:60]), header_value),
    b"Stream-Fork-Sub-Offset": numbers,
    b"Producer-Id": st.one_of(st.sampled_from([b"p1", b"p2", b"\xff\xfe", b"x" * 300]), header_value),
    b"Producer-Epoch": numbers,
    b"Producer-Seq": numbers,
    b"If-None-Match": st.one_of(st.just(b"*"), header_value),
    b"Authorization": st.one_of(st.just(b"Bearer " + TOKEN.encode()), st.just(b"Bearer " + TOKEN.encode()),
                                st.sampled_from([b"Bearer", b"Bearer x", b"Basic Zm9vOmJhcg==", b"bearer  " + TOKEN.encode()]),
                                header_value),
    b"DS3-Internal-Token": st.sampled_from([b"wrong", b""]),
    b"X-Forwarded-For": st.sampled_from([b"203.0.113.7", b"1.2.3.4, 10.0.0.1", b"garbage", b"::1"]),
    b"Last-Event-ID": header_value,
    b"Content-Encoding": st.sampled_from([b"gzip", b"identity", b"br"]),
    b"Cache-Control": st.sampled_from([b"no-cache", b"max-age=0"]),
}


@st.composite
def header_lists(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    names = draw(st.lists(st.sampled_from(sorted(STREAM_HEADERS)), max_size=6, unique=True))
    out = [(n, draw(STREAM_HEADERS[n])) for n in names]
    if draw(st.integers(0, 9)) < 7 and b"Authorization" not in names:  # mostly authorized: reach the handlers
        out.append((b"Authorization", b"Bearer " + TOKEN.encode()))
    return out


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.just(b""),
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"[]", b"[", b"{", b"[1,]", b"NaN", b"[Infinity]", b"\xff\xfe", b'"\xed\xa0\x80"', b"[" * 3000,
                     b"1" * 5000, b"[1] x", b"\x00", b'{"a":1}{"b":2}', b"  ", b"[" * 100 + b"]" * 100]),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
METHODS = ["GET", "GET", "HEAD", "POST", "POST", "PUT", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "FOO"]


@st.composite
def internal_queries(draw: st.DrawFn) -> str:
    """The parameters of the readers' own endpoints (/_ds3/touch, /_ds3/parts)."""
    given = {
        "path": st.one_of(st.sampled_from(["", "a", "fz", "\x00b/fzbk/s1", "x" * 600]), st.text(max_size=40)),
        "from": offset_text, "until": offset_text,
        "boundary": st.sampled_from(["ds3-" + "0" * 32, "ds3-" + "g" * 32, ""]),
    }
    names = draw(st.lists(st.sampled_from(sorted(given)), unique=True))
    return "?" + "&".join(f"{n}={_pct(draw(given[n]))}" for n in names)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, list[tuple[bytes, bytes]], bytes]:
    method = draw(st.sampled_from(METHODS))
    path = draw(paths())
    headers = draw(header_lists())
    if path.startswith("/_ds3/"):
        query = draw(internal_queries())
        if draw(st.integers(0, 3)):
            headers.append((b"DS3-Internal-Token", INTERNAL.encode()))
    else:
        query = draw(queries())
    body = draw(bodies) if method in ("POST", "PUT", "PATCH", "DELETE") or draw(st.integers(0, 9)) == 0 else b""
    return method, (path + query).encode(), headers, body


def check_reply(port: int, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Reply:
    try:
        reply = send(port, method, target, headers, body)
    except (OSError, http.client.HTTPException) as e:
        raise AssertionError(f"{method} {target!r} {headers!r}: no response ({type(e).__name__}: {e})") from e
    assert reply.status < 500, f"{method} {target!r} {headers!r} {body[:80]!r}: {reply.status} {reply.body[:300]!r}"
    return reply


# ---------------------------------------------------------------- HTTP fuzzing
AUTHORIZED = (b"Authorization", b"Bearer " + TOKEN.encode())


@fuzz(400)
@given(req=requests(), to_reader=st.booleans())
# found by this test: a body that does not decode with its Content-Encoding was a 500
@example(req=("PUT", b"/v1/buckets/fzbk/s1/snapshot/-1", [(b"Content-Encoding", b"gzip"), AUTHORIZED], b"\x00\x00"),
         to_reader=False)
@example(req=("POST", b"/v1/stream/a", [(b"Content-Encoding", b"deflate"), AUTHORIZED], b"x"), to_reader=True)
def test_fuzz_http_never_5xx_never_dropped(pair: Pair, req: tuple[str, bytes, list[tuple[bytes, bytes]], bytes],
                                          to_reader: bool) -> None:
    method, target, headers, body = req
    check_reply(pair.reader if to_reader else pair.ingester, method, target, headers, body)


@fuzz(100)
@given(route=st.sampled_from([("POST", "/_ds3/touch"), ("GET", "/_ds3/parts")]), to_real=st.booleans(),
       path=st.one_of(st.sampled_from(["", "a", "fz", "\x00b/fzbk/s1", "\x00", "x" * 600]), st.text(max_size=40)),
       start=offset_text, until=offset_text, boundary=st.sampled_from(["ds3-" + "0" * 32, "ds3-" + "g" * 32, ""]))
# found by this test: an empty path was a 500 (LMDB refuses empty keys)
@example(route=("POST", "/_ds3/touch"), to_real=False, path="", start="-1", until="-1", boundary="")
def test_fuzz_internal_endpoints(pair: Pair, procs: Pair, route: tuple[str, str], to_real: bool, path: str, start: str,
                                 until: str, boundary: str) -> None:
    """The ingester's endpoints for readers (the internal token; open to all with auth off)."""
    method, where = route
    query = f"?path={_pct(path)}&from={_pct(start)}&until={_pct(until)}&boundary={boundary}"
    check_reply(procs.ingester if to_real else pair.ingester, method, (where + query).encode(),
                [(b"DS3-Internal-Token", INTERNAL.encode())] if not to_real else [], b"")


@fuzz(60)
@given(segments=st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=8), min_size=1, max_size=3),
       to_reader=st.booleans(), method=st.sampled_from(["GET", "HEAD", "PUT", "POST", "DELETE"]))
def test_fuzz_raw_utf8_targets(pair: Pair, segments: list[str], to_reader: bool, method: str) -> None:
    """Unencoded UTF-8 in the request line (clients should percent-encode it; servers see it)."""
    raw = "/v1/stream/" + "/".join(segments)
    target = bytes(b for b in raw.encode() if b > 0x20 and b not in (0x7f, 0x23, 0x3f))  # no space, ctl, #, ?
    auth = [(b"Authorization", b"Bearer " + TOKEN.encode()), (b"Content-Type", b"text/plain")]
    check_reply(pair.reader if to_reader else pair.ingester, method, target, auth, b"x" if method == "POST" else b"")


def _invalid_json(b: bytes) -> bool:
    try:  # (ds3 takes integers of any length: Python's int() would refuse 4300+ digits)
        json.loads(b.decode("utf-8"), parse_int=len)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return True
    return False


@st.composite
def bad_inputs(draw: st.DrawFn) -> tuple[str, str, list[tuple[bytes, bytes]], bytes, bytes]:
    """(which control stream, method, headers, query, body) that the server must refuse."""
    kind = draw(st.sampled_from(["json-body", "content-type", "producer", "offset", "recreate", "live"]))
    auth = [(b"Authorization", b"Bearer " + TOKEN.encode())]
    if kind == "json-body":
        body = draw(st.one_of(bodies, st.binary(max_size=50)).filter(_invalid_json))
        return "json", "POST", [*auth, (b"Content-Type", b"application/json")], b"", body
    if kind == "content-type":
        ct = draw(st.sampled_from([b"text/plain", b"application/octet-stream", b"text/html"]))
        return "json", "POST", [*auth, (b"Content-Type", ct)], b"", b'{"x":1}'
    if kind == "producer":
        triple = [(b"Producer-Id", draw(st.sampled_from([b"", b"\xff", b"p" * 300, b"p"]))),
                  (b"Producer-Epoch", draw(st.sampled_from([b"-1", b"x", b"1.5", b"99999999999999999", b""]))),
                  (b"Producer-Seq", draw(numbers))]
        triple = draw(st.lists(st.sampled_from(triple), unique=True, min_size=1, max_size=3))
        if len(triple) == 3 and triple[0][1] == b"p":
            triple = triple[1:]  # a well-formed triple could be admitted: keep it broken
        return "text", "POST", [*auth, (b"Content-Type", b"text/plain"), *triple], b"", b"never stored"
    if kind == "offset":
        off = draw(offset_text.filter(lambda t: t not in ("-1", "now") and not re.fullmatch(r"\d{16}_\d{16}", t)))
        return "text", "GET", auth, b"?offset=" + _pct(off).encode(), b""
    if kind == "live":
        return "text", "GET", auth, b"?live=" + draw(st.sampled_from([b"sse", b"long-poll", b"x"])), b""
    ct = draw(st.sampled_from([b"application/json", b"application/octet-stream"]))
    return "text", "PUT", [*auth, (b"Content-Type", ct)], b"", b""


@fuzz(150)
@given(bad=bad_inputs(), to_reader=st.booleans())
def test_fuzz_bad_input_on_control_streams_is_refused(pair: Pair, bad: tuple[str, str, list[tuple[bytes, bytes]], bytes, bytes],
                                                      to_reader: bool) -> None:
    which, method, headers, query, body = bad
    url = pair.control.json_url if which == "json" else pair.control.text_url
    reply = check_reply(pair.reader if to_reader else pair.ingester, method, enc(url) + query, headers, body)
    assert 400 <= reply.status < 500, f"{method} {url}{query!r} {headers} {body[:80]!r}: {reply.status}"


def test_fuzz_control_streams_intact_after_fuzzing(pair: Pair) -> None:
    """Runs after the fuzz tests of this module (pytest keeps the file's order)."""
    pair.control.check(pair.reader, pair.ingester)
    assert send(pair.ingester, "GET", b"/healthz").status == 200


@fuzz(80)
@given(req=requests(), to_reader=st.booleans())
def test_fuzz_real_processes(procs: Pair, req: tuple[str, bytes, list[tuple[bytes, bytes]], bytes], to_reader: bool) -> None:
    method, target, headers, body = req
    check_reply(procs.reader if to_reader else procs.ingester, method, target, headers, body)


def test_fuzz_real_processes_control_intact(procs: Pair) -> None:
    procs.control.check(procs.reader, procs.ingester, token=None)


# ---------------------------------------------------------------- parsers
@fuzz(300)
@given(text=st.one_of(st.text(max_size=40), offset_text))
def test_offsets_parse_only_raises_syntax_errors(text: str) -> None:
    try:
        got = offsets.parse_query(text)
    except offsets.OffsetSyntaxError:
        return
    assert got in (offsets.START, offsets.NOW) or str(got) == text


@fuzz(200)
@given(chunk=st.integers(0, offsets.MAX_FIELD), position=st.integers(0, offsets.MAX_FIELD))
def test_offsets_round_trip_and_order(chunk: int, position: int) -> None:
    o = offsets.Offset(chunk, position)
    assert offsets.parse(str(o)) == o and len(str(o)) == 33
    other = offsets.Offset(chunk, min(position + 1, offsets.MAX_FIELD))
    assert (str(o) <= str(other)) == (o <= other)


@fuzz(300)
@given(path=st.text(st.characters(codec=None, exclude_categories=()), max_size=60))
def test_stream_path_validation(path: str) -> None:
    try:
        got = P.validate_stream_path(path, 480)
    except BadRequest:
        return
    assert got == path and path.encode("utf-8")  # valid UTF-8
    assert "\x00" not in path and all(s not in ("", ".", "..") for s in path.split("/"))


@fuzz(300)
@given(value=st.one_of(st.text(max_size=40), st.builds(
    lambda y, mo, d, h, mi, s, tz: f"{y:04d}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{s:02d}{tz}",
    st.integers(0, 9999), st.integers(0, 13), st.integers(0, 32), st.integers(0, 25), st.integers(0, 61),
    st.integers(0, 61), st.sampled_from(["Z", "z", "+23:59", "-23:59", "+00:00", "+99:99"]))))
def test_header_parsers_raise_only_bad_request(value: str) -> None:
    for parse in (P.parse_ttl, P.parse_expires_at, lambda v: P.parse_safe_int("Producer-Seq", v)):
        try:
            parse(value)
        except BadRequest:
            pass
    for pid, epoch, seq in ((value, "0", "0"), ("p", value, "0"), ("p", "0", value), (value, None, None)):
        try:
            P.parse_producer(pid, epoch, seq)
        except BadRequest:
            pass
    P.is_valid_content_type(value)
    P.flag_true(value)
    cursor = P.response_cursor(value, now=1.8e9)
    assert cursor.isdigit()
    if value.isascii() and value.isdigit() and len(value) <= 1000:
        assert int(cursor) > int(value) or int(cursor) == int(P.response_cursor(None, now=1.8e9))


@fuzz(300)
@given(value=json_values, extra=st.sampled_from(["", " ", "\n\t"]))
def test_json_split_round_trip(value: Any, extra: str) -> None:
    body = (extra + json.dumps(value) + extra).encode()
    if value == []:
        assert jsonmode.split_messages(body, allow_empty_array=True) == []
        return
    msgs = jsonmode.split_messages(body, allow_empty_array=False)
    expected = value if isinstance(value, list) else [value]
    stored = b"".join(jsonmode.frame(m) for m in msgs)
    assert json.loads(jsonmode.render_stored(stored)) == expected


@fuzz(300)
@given(body=st.one_of(bodies, st.binary(max_size=200)))
def test_json_split_raises_only_bad_request(body: bytes) -> None:
    try:
        msgs = jsonmode.split_messages(body, allow_empty_array=True)
    except BadRequest:
        return
    for m in msgs:  # every message it accepts is JSON on its own (integers of any length allowed)
        json.loads(m, parse_int=len, parse_constant=lambda c: pytest.fail(f"{c} accepted"))


@fuzz(300)
@given(raw=st.one_of(paths(), st.text(max_size=60)))
def test_extension_and_bucket_url_parsers(raw: str) -> None:
    try:
        stream, ep = extensions.split(raw)
    except BadRequest:
        return
    assert raw.startswith(stream)
    if ep is not None:
        assert ep.kind in (extensions.SNAPSHOT, extensions.BOOTSTRAP)
        try:
            extensions.snapshot_offset(ep.offset)
        except BadRequest:
            pass
    if raw.startswith(buckets.BUCKETS_PREFIX):
        try:
            bucket_id, stream_id = buckets.parse_url(raw)
        except BadRequest:
            return
        if stream_id is not None and stream_id != buckets.RESERVED_STREAM_ID:
            internal = buckets.internal_path(bucket_id, stream_id)
            assert buckets.split_internal(internal) == (bucket_id, stream_id)
            assert buckets.stream_path_from_url(buckets.url_path(internal)) == internal


@fuzz(150)
@given(parts=st.lists(st.binary(max_size=50), max_size=5))
def test_multipart_framing_parses_back(parts: list[bytes]) -> None:
    import email.parser
    import email.policy

    b = extensions.new_boundary()
    body = extensions.first_part_head(b, "application/octet-stream") + (parts[0] if parts else b"")
    for p in parts[1:]:
        body += extensions.part_head(b, "text/plain") + p
    body += extensions.closing(b)
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + extensions.content_type(b).encode() + b"\r\n\r\n" + body)
    got = [part.get_payload(decode=True) for part in msg.iter_parts()]
    assert len(got) == max(1, len(parts))
    if parts and all(b"\r" not in p and b"\n" not in p for p in parts):  # the email parser rewrites line ends
        assert got == parts


def _parse_sse(raw: str) -> list[tuple[str, str]]:
    """The WHATWG event-stream parsing rules, for the fields ds3 sends."""
    events: list[tuple[str, str]] = []
    kind, data = "", list[str]()
    for line in re.split(r"\r\n|\r|\n", raw):
        if line == "":
            if data:
                events.append((kind or "message", "\n".join(data)))
            kind, data = "", []
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            kind = value
        elif name == "data":
            data.append(value)
    return events


@fuzz(300)
@given(payload=st.text(max_size=80), offset=st.builds(offsets.encode, st.integers(0, 99), st.integers(0, 99)),
       closed=st.booleans(), binary=st.binary(max_size=60))
def test_sse_framing_cannot_be_injected(payload: str, offset: str, closed: bool, binary: bytes) -> None:
    raw = (sse.data_event(payload) + sse.control_event(offset, cursor="1", up_to_date=True, closed=closed)).decode()
    events = _parse_sse(raw)
    assert [k for k, _ in events] == ["data", "control"]
    assert events[0][1] == re.sub(r"\r\n|\r", "\n", payload)  # line breaks normalised, nothing else changed
    assert json.loads(events[1][1])["streamNextOffset"] == offset
    assert base64.b64decode(_parse_sse(sse.data_event(sse.encode_binary(binary)).decode())[0][1]) == binary


# ---------------------------------------------------------------- chunks
@st.composite
def chunk_objects(draw: st.DrawFn) -> tuple[bytes, chunks.ChunkHeader, list[tuple[int, int, bytes]]]:
    start = draw(st.integers(0, 2**40))
    datas = draw(st.lists(st.binary(min_size=1, max_size=30), min_size=1, max_size=6))
    records, end = [], start
    for d in datas:
        end += len(d)
        records.append((end, draw(st.integers(0, 255)), d))
    header = chunks.ChunkHeader(
        sid=draw(st.integers(0, 2**63)), chunk=draw(st.integers(0, 10**16 - 1)), start=start, end=end,
        content_type=draw(st.sampled_from(["text/plain", "application/json", "application/octet-stream"])),
        records=len(records), closed=draw(st.booleans()), created_at=draw(st.floats(0, 2e9)),
        path=draw(st.text(max_size=20)),
    )
    return chunks.encode_chunk(header, records), header, records


@fuzz(200)
@given(obj=chunk_objects())
def test_chunk_round_trip(obj: tuple[bytes, chunks.ChunkHeader, list[tuple[int, int, bytes]]]) -> None:
    raw, header, records = obj
    head, got = chunks.decode_chunk(raw)
    assert head.header == header
    assert [(r.end, r.flags, r.data) for r in got] == records


def _decode_or_format_error(raw: bytes) -> None:
    try:
        head, records = chunks.decode_chunk(raw)
    except chunks.ChunkFormatError:
        return
    # whatever decodes is self-consistent
    assert sum(len(r.data) for r in records) == head.header.end - head.header.start
    for r in records:
        head.record_at(r.start)


@fuzz(400)
@given(obj=chunk_objects(), data=st.data())
def test_corrupted_chunks_raise_chunk_format_error_only(
    obj: tuple[bytes, chunks.ChunkHeader, list[tuple[int, int, bytes]]], data: st.DataObject
) -> None:
    raw = bytearray(obj[0])
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice", "prelude"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1)):]
    elif how == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=20))
    elif how == "splice":
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i + data.draw(st.integers(0, 10))] = data.draw(st.binary(max_size=10))
    else:  # lengths in the prelude
        field_at = data.draw(st.sampled_from([8, 12, 16, 24]))
        size = 4 if field_at < 16 else 8
        raw[field_at:field_at + size] = data.draw(st.integers(0, 2 ** (8 * size) - 1)).to_bytes(size, "big")
    _decode_or_format_error(bytes(raw))


HEADER_FIELDS = ["sid", "chunk", "start", "end", "content_type", "records", "closed", "created_at", "path"]


@fuzz(300)
@given(obj=chunk_objects(), field_name=st.sampled_from(HEADER_FIELDS), value=st.one_of(
    json_values, st.integers(-(2**70), 2**70), st.sampled_from([10**400, -(10**400), 1e308, float("nan")])),
    nested=st.integers(0, 3))
def test_chunk_headers_with_odd_fields_raise_chunk_format_error_only(
    obj: tuple[bytes, chunks.ChunkHeader, list[tuple[int, int, bytes]]], field_name: str, value: Any, nested: int
) -> None:
    """A header JSON that is valid JSON but wrong: any value in any field, or deeply nested."""
    raw, header, _records = obj
    prelude = chunks.parse_prelude(raw)
    fields = json.loads(header.to_json())
    fields[field_name] = value
    text = json.dumps(fields).encode()
    if nested:
        text = b"[" * (900 * nested) + text + b"]" * (900 * nested)
    rest = raw[chunks.PRELUDE_SIZE + prelude.header_length:]
    new = struct.pack(">8sIIQQ", chunks.MAGIC, chunks.VERSION, len(text), prelude.index_length,
                      prelude.data_length) + text + rest
    _decode_or_format_error(new)

