"""Request bodies with a Content-Encoding (shared/http/codings.py), against real processes: an
ingester, a reader in front of it and a reader with two workers in front of it. Each case is
sent as a create (PUT with a body) and as an append (POST) to each of the three.

Found by QA: aiohttp's own decoding appended a partial body for a gzip stream cut off before its
trailer (204), stored bodies in codings it does not decode still encoded (`foo`, `x-gzip`,
`gzip, gzip`: 204) and answered `br` with a 400 asking to install Brotli. Now: a stream that
is not whole is 400 and a coding not decoded 415, nothing stored either way; x-gzip is gzip, and
a list of codings is decoded in the order they were applied."""

from __future__ import annotations

import gzip
import http.client
import socket
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests import procs

LIMIT = 256 * 1024  # --max-body-bytes of every process
TEXT = b"a body sent compressed, stored decoded. " * 40
BEFORE = b"already there|"
ACCEPTED = "identity, gzip, x-gzip, deflate"


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _bad_crc(data: bytes) -> bytes:
    z = _gz(data)
    crc, size = struct.unpack("<II", z[-8:])
    return z[:-8] + struct.pack("<II", crc ^ 1, size)


@dataclass(frozen=True)
class Case:
    name: str
    coding: str
    body: Callable[[bytes], bytes]
    status: int  # what a POST is answered (a PUT that creates: 201 for 204)
    says: tuple[str, ...] = ()  # in the answer's text

    @property
    def ok(self) -> bool:
        return self.status == 204


CASES = [
    Case("gzip", "gzip", _gz, 204),
    Case("x-gzip", "x-gzip", _gz, 204),
    Case("upper-case", "GZip", _gz, 204),
    Case("deflate", "deflate", zlib.compress, 204),
    Case("identity", "identity", lambda b: b, 204),
    Case("gzip-twice", "gzip, gzip", lambda b: _gz(_gz(b)), 204),
    Case("deflate-then-gzip", "deflate,gzip", lambda b: _gz(zlib.compress(b)), 204),
    Case("gzip-identity", "gzip, identity", _gz, 204),
    Case("truncated", "gzip", lambda b: _gz(b)[:-5], 400, ("could not be read", "cut off")),
    Case("no-trailer", "gzip", lambda b: _gz(b)[:-8], 400, ("could not be read", "cut off")),
    Case("bad-crc", "gzip", _bad_crc, 400, ("could not be read", "incorrect data check")),
    Case("trailing-garbage", "gzip", lambda b: _gz(b) + b"garbage", 400, ("could not be read", "7 bytes after")),
    Case("not-gzip", "gzip", lambda b: b, 400, ("could not be read", "not valid gzip")),
    Case("deflate-truncated", "deflate", lambda b: zlib.compress(b)[:-6], 400, ("could not be read", "cut off")),
    Case("foo", "foo", lambda b: b, 415, ("'foo'", ACCEPTED)),
    Case("br", "br", lambda b: b, 415, ("'br'", ACCEPTED)),
    Case("zstd", "zstd", lambda b: b, 415, ("'zstd'", ACCEPTED)),
    Case("gzip-then-foo", "gzip, foo", _gz, 415, ("'foo'", ACCEPTED)),
    Case("bomb", "gzip", lambda b: _gz(b"\0" * (LIMIT + 1)), 413, (f"larger than {LIMIT} bytes once decoded",)),
    Case("bomb-twice", "gzip, gzip", lambda b: _gz(_gz(b"\0" * (4 * LIMIT))), 413, ("once decoded",)),
]
TOPOLOGIES = ["ingester", "reader", "workers"]


def _free_ports(n: int) -> list[int]:
    """Free ports in 5600-5699 (where this repository's tests may listen)."""
    out = []
    for port in range(5600, 5700):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    raise RuntimeError("no free ports in 5600-5699")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, procs.Proc]]:
    root = tmp_path_factory.mktemp("codings")
    store = f"file://{root / 'objects'}"
    limit = ["--max-body-bytes", str(LIMIT), "--log-level", "warning"]
    ports = _free_ports(3)
    ingester = procs.ingester(root / "wal", "--store", store, *limit, port=ports[0])
    made = {
        "ingester": ingester,
        "reader": procs.reader(root / "reader", ingester.url, store, *limit, port=ports[1]),
        "workers": procs.reader(root / "workers", ingester.url, store, "--workers", "2", *limit, port=ports[2]),
    }
    started: list[procs.Proc] = []
    try:
        for p in made.values():
            p.start()
            started.append(p)
        yield made
    finally:
        for p in reversed(started):
            p.stop()
    for p in made.values():  # nothing went wrong on the servers' side
        text = p.log_path.read_text()
        assert "Traceback" not in text and "Unhandled exception" not in text, text[-3000:]


def _content(ingester: procs.Proc, path: str) -> bytes | None:
    """The stream's bytes (read from the ingester), None if there is no such stream."""
    status, _, _ = procs.request(ingester, "HEAD", path)
    if status == 404:
        return None
    assert status == 200, (path, status)
    return procs.read_all(ingester, path)


def _check_answer(case: Case, status: int, headers: dict[str, str], text: bytes, ok_status: int) -> None:
    want = ok_status if case.ok else case.status
    assert status == want, (case.name, status, text)
    if case.ok:
        return
    said = text.decode()
    assert headers["content-type"].startswith("text/plain") and said.endswith("\n"), (headers, said)
    for words in case.says:
        assert words in said, (case.name, said)
    if case.status == 415:
        assert headers["accept-encoding"] == ACCEPTED


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_append(servers: dict[str, procs.Proc], topology: str, case: Case) -> None:
    """POST to an existing stream: the decoded body is appended, or nothing is."""
    p, ingester = servers[topology], servers["ingester"]
    path = f"/v1/stream/ce-append-{topology}-{case.name}"
    status, _, text = procs.request(p, "PUT", path, BEFORE, {"Content-Type": "text/plain"})
    assert status == 201, text
    headers = {"Content-Type": "text/plain", "Content-Encoding": case.coding}
    status, answer_headers, text = procs.request(p, "POST", path, case.body(TEXT), headers)
    _check_answer(case, status, answer_headers, text, 204)
    assert _content(ingester, path) == (BEFORE + TEXT if case.ok else BEFORE)
    # the connection's next request, and the stream, are fine
    status, _, text = procs.request(p, "POST", path, b"|after", {"Content-Type": "text/plain"})
    assert status == 204, text
    assert _content(ingester, path) == (BEFORE + TEXT if case.ok else BEFORE) + b"|after"


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_create(servers: dict[str, procs.Proc], topology: str, case: Case) -> None:
    """PUT with a body: the stream is created with the decoded body, or not at all."""
    p, ingester = servers[topology], servers["ingester"]
    path = f"/v1/stream/ce-create-{topology}-{case.name}"
    headers = {"Content-Type": "text/plain", "Content-Encoding": case.coding}
    status, answer_headers, text = procs.request(p, "PUT", path, case.body(TEXT), headers)
    _check_answer(case, status, answer_headers, text, 201)
    assert _content(ingester, path) == (TEXT if case.ok else None)


def test_one_connection_goes_on(servers: dict[str, procs.Proc]) -> None:
    """A refused body leaves its keep-alive connection usable: the next request on it is answered."""
    for p in servers.values():
        path = f"/v1/stream/ce-keepalive-{p.port}"
        c = http.client.HTTPConnection(p.host, p.port, timeout=15)
        try:
            c.request("PUT", path, headers={"Content-Type": "text/plain"})
            r = c.getresponse()
            assert r.status == 201, r.read()
            r.read()
            for coding, body, want in (("gzip", _gz(TEXT)[:-3], 400), ("foo", TEXT, 415), ("x-gzip", _gz(TEXT), 204)):
                c.request("POST", path, body=body, headers={"Content-Type": "text/plain", "Content-Encoding": coding})
                r = c.getresponse()
                assert r.status == want, (p.args[0], coding, r.status, r.read())
                r.read()
        finally:
            c.close()
        assert _content(servers["ingester"], path) == TEXT
