"""Protocol headers sent twice, and a closed JSON stream's answer, through real processes:
the ingester alone and a reader in front (both with their fast lanes, over keep-alive
connections, and aiohttp's path), tried as a client would send them."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest
from multidict import CIMultiDict

from tests import procs, rawhttp

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(params=["ingester", "reader"], scope="module")
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp(request.param)
    objects = (work / "objects").as_uri()
    ing = procs.ingester(work / "data", "--store", objects).start()
    rd = procs.reader(work / "reader", ing.url, objects).start() if request.param == "reader" else None
    try:
        yield (rd or ing).url
    finally:
        if rd is not None:
            rd.stop()
        ing.stop()


REPEATED = [
    ("PUT", "Stream-TTL", ["60", "3600"]),
    ("PUT", "Stream-Expires-At", ["2099-01-01T00:00:00Z", "2098-01-01T00:00:00Z"]),
    ("PUT", "Stream-Closed", ["true", "false"]),
    ("POST", "Stream-Seq", ["b", "a"]),
    ("POST", "Stream-Closed", ["false", "true"]),
    ("POST", "Producer-Id", ["p1", "p2"]),
    ("POST", "Producer-Epoch", ["0", "1"]),
    ("POST", "Producer-Seq", ["0", "5"]),
]


@pytest.mark.parametrize(("method", "name", "values"), REPEATED)
async def test_a_protocol_header_sent_twice_is_refused(base: str, method: str, name: str, values: list[str]) -> None:
    """Which of two Stream-TTL (or Producer-Seq...) headers counts would be a guess: 400 naming
    the header, and nothing created or appended. (Before, the first counted silently.)"""
    path = f"{base}/v1/stream/twice-{method}-{name}"
    async with aiohttp.ClientSession() as s:
        if method == "POST":
            async with s.put(path, headers=TEXT) as r:
                assert r.status == 201
        producer = {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"} if name.startswith("Producer") else {}
        headers: CIMultiDict[str] = CIMultiDict({**TEXT, **{k: v for k, v in producer.items() if k != name}})
        for v in values:
            headers.add(name, v)
        for _ in range(2):  # (a keep-alive connection: the second may take the fast lane's path)
            async with s.request(method, path, data=b"x", headers=headers) as r:
                text = await r.text()
                assert r.status == 400, (r.status, text)
                assert name.lower() in text.lower() and "one" in text, text
        async with s.get(path, params={"offset": "-1"}) as r:  # nothing created, nothing appended
            assert r.status == (200 if method == "POST" else 404)
            assert method == "PUT" or await r.read() == b""


async def test_a_closed_json_stream_says_closed_whatever_the_body(base: str) -> None:
    """An append to a closed JSON stream is told 409 with Stream-Closed, as any append to a
    closed stream, even when its body is not JSON. (Before, the body was judged first: 400.)"""
    path = f"{base}/v1/stream/closed-json"
    async with aiohttp.ClientSession() as s:
        async with s.put(path, headers=JSON, data=b"[1]") as r:
            assert r.status == 201
        async with s.post(path, headers={"Stream-Closed": "true"}) as r:
            assert r.status == 204
        for body in (b"not json", b"[1, 2", b"{}", b"[2]"):
            async with s.post(path, headers=JSON, data=body) as r:
                assert r.status == 409, (body, r.status, await r.text())
                assert r.headers.get("Stream-Closed") == "true"
        # open, the same bad body is a 400 saying why
        async with s.put(path + "-open", headers=JSON) as r:
            assert r.status == 201
        async with s.post(path + "-open", headers=JSON, data=b"[1, 2") as r:
            assert r.status == 400 and "json" in (await r.text()).lower()


BAD_HOSTS = [
    b"evil.example/<script>",  # a path in the Host: it went into Location as is
    b"a b",
    b"example.com:80@evil.example",
    b"x:99999",  # a port out of range: 500 after the stream was created
    b"ho\xffst",  # not ASCII: 500
    b"[::1",
]


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


@pytest.mark.parametrize("host", BAD_HOSTS, ids=lambda h: h.decode("latin-1"))
def test_an_invalid_host_is_refused_and_nothing_is_created(base: str, host: bytes) -> None:
    """RFC 9112 §3.2: 400 for a Host that is not host[:port] (a server builds the Location of a
    new stream from it). Sent twice on one keep-alive connection: the second request may take
    the fast lane's path. Before, the Host went into Location verbatim, or the create was
    answered 500 after the stream had been made."""
    name = f"/v1/stream/host-{host.hex()}"
    req = b"PUT " + name.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n"
    for answer in rawhttp.exchange(_port(base), req, req, answers=2):
        status, _headers, body = rawhttp.parsed(answer)
        assert status == 400, answer[:300]
        assert b"Host" in body, body
    [answer] = rawhttp.exchange(_port(base), rawhttp.put(name, "Content-Type: text/plain"))
    assert rawhttp.parsed(answer)[0] == 201, "the invalid requests created the stream"


@pytest.mark.parametrize("host", [b"ok.example", b"ok.example:8080", b"127.0.0.1:1", b"[::1]:443", b"xn--bcher-kva.example"])
def test_a_valid_host_names_the_new_stream(base: str, host: bytes) -> None:
    name = f"/v1/stream/good-host-{host.hex()}"
    req = b"PUT " + name.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n"
    [answer] = rawhttp.exchange(_port(base), req)
    status, headers, _body = rawhttp.parsed(answer)
    assert status == 201 and headers["location"] == "http://" + host.decode() + name, answer[:300]


def test_one_host_header_is_required(base: str) -> None:
    name = "/v1/stream/no-host"
    for head in (b"PUT " + name.encode() + b" HTTP/1.1\r\n",
                 b"PUT " + name.encode() + b" HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n"):
        [answer] = rawhttp.exchange(_port(base), head + b"Content-Type: text/plain\r\nContent-Length: 0\r\n\r\n")
        assert rawhttp.parsed(answer)[0] == 400, answer[:300]
    [answer] = rawhttp.exchange(_port(base), b"GET " + name.encode() + b"?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n")
    assert rawhttp.parsed(answer)[0] == 404, "a request without one Host created the stream"


@pytest.mark.parametrize("version", [b"HTTP/2.0"])
def test_a_request_in_another_major_version_is_answered_505(base: str, version: bytes) -> None:
    """A plain-text request line naming HTTP/2 (not a prior-knowledge h2 preface): 505,
    nothing created (before: answered as if it were HTTP/1.1). (HTTP/3.0 is a 400 from the
    parser: no such request line exists.)"""
    name = "/v1/stream/h" + version[5:6].decode()
    [answer] = rawhttp.exchange(_port(base), b"PUT " + name.encode() + b" " + version +
                                b"\r\nHost: t\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n")
    status, _headers, body = rawhttp.parsed(answer)
    assert status == 505 and b"HTTP/1.1" in body, answer[:300]
    [answer] = rawhttp.exchange(_port(base), b"GET " + name.encode() + b"?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n")
    assert rawhttp.parsed(answer)[0] == 404, "the refused request created the stream"
