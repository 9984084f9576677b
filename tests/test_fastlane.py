"""The ingester's fast lane (ingester/fastlane.py) against real `ds3 ingester` processes.

Every append is sent, byte for byte, to an ingester with the lane and to one without it
(DS3_FAST_LANE=0: aiohttp answers everything); status, headers and body must match
(Date and X-Request-Id aside). Then what only raw sockets show: pipelined requests answered
in order, a body arriving after its head, bytes a client trickles, requests the lane leaves
to aiohttp on the same connection, and the lane's counter in /metrics."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import procs

VOLATILE = {"date", "x-request-id"}
STREAM_OFFSET = re.compile(rb"\d{16}_\d{16}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[procs.Proc, procs.Proc]]:
    root = tmp_path_factory.mktemp("fastlane")
    fast = procs.ingester(root / "fast", "--write-rate", "0", "--max-body-bytes", "100000")
    slow = procs.ingester(root / "slow", "--write-rate", "0", "--max-body-bytes", "100000")
    slow.env["DS3_FAST_LANE"] = "0"
    fast.start()
    try:
        slow.start()
        try:
            yield fast, slow
        finally:
            slow.stop()
    finally:
        fast.stop()


def exchange(port: int, *parts: bytes, answers: int = 1, timeout: float = 5.0, pause: float = 0.0) -> list[bytes]:
    """Send `parts` (each its own write, `pause` s apart) on one connection; read `answers`
    whole responses."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, part in enumerate(parts):
            if i and pause:
                time.sleep(pause)
            s.sendall(part)
        buf = b""
        out: list[bytes] = []
        while len(out) < answers:
            while True:
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0:
                    m = re.search(rb"(?im)^content-length:\s*(\d+)", buf[:head_end])
                    total = head_end + 4 + (int(m.group(1)) if m else 0)
                    if len(buf) >= total:
                        out.append(buf[:total])
                        buf = buf[total:]
                        break
                chunk = s.recv(65536)
                if not chunk:
                    raise AssertionError(f"connection closed after {len(out)} answers: {buf[:300]!r}")
                buf += chunk
        return out


def parsed(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.lower() not in VOLATILE:
            headers[name.lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def post(path: str, body: bytes, *headers: str) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers)
    return head.encode("latin-1") + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def put(path: str, *headers: str) -> bytes:
    head = f"PUT {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers)
    return head.encode("latin-1") + b"Content-Length: 0\r\n\r\n"


def fast_count(p: procs.Proc) -> float:
    with urllib.request.urlopen(f"{p.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^ds3_http_fast_lane_appends_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else -1.0


# (name, setup requests, the request compared). Offsets differ between the two processes
# (they encode when each stream was made), so they are compared by shape.
CASES = [
    ("plain", [put("/v1/stream/p1", "Content-Type: text/plain")], post("/v1/stream/p1", b"abc", "Content-Type: text/plain")),
    ("json", [put("/v1/stream/j1", "Content-Type: application/json")],
     post("/v1/stream/j1", b'[{"a":1},{"b":2}]', "Content-Type: application/json")),
    ("json empty array", [put("/v1/stream/j2", "Content-Type: application/json")],
     post("/v1/stream/j2", b"[]", "Content-Type: application/json")),
    ("json invalid", [put("/v1/stream/j3", "Content-Type: application/json")],
     post("/v1/stream/j3", b"{nope", "Content-Type: application/json")),
    ("missing stream", [], post("/v1/stream/absent", b"x", "Content-Type: text/plain")),
    ("content type mismatch", [put("/v1/stream/m1", "Content-Type: text/plain")],
     post("/v1/stream/m1", b"x", "Content-Type: text/html")),
    ("no content type", [put("/v1/stream/m2", "Content-Type: text/plain")], post("/v1/stream/m2", b"x")),
    ("empty body", [put("/v1/stream/e1", "Content-Type: text/plain")], post("/v1/stream/e1", b"", "Content-Type: text/plain")),
    ("close", [put("/v1/stream/c1", "Content-Type: text/plain")],
     post("/v1/stream/c1", b"last", "Content-Type: text/plain", "Stream-Closed: true")),
    ("append to closed", [put("/v1/stream/c2", "Content-Type: text/plain", "Stream-Closed: true")],
     post("/v1/stream/c2", b"x", "Content-Type: text/plain")),
    ("producer new", [put("/v1/stream/pr1", "Content-Type: text/plain")],
     post("/v1/stream/pr1", b"x", "Content-Type: text/plain", "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 0")),
    ("producer duplicate", [put("/v1/stream/pr2", "Content-Type: text/plain"),
                            post("/v1/stream/pr2", b"x", "Content-Type: text/plain", "Producer-Id: w",
                                 "Producer-Epoch: 0", "Producer-Seq: 0")],
     post("/v1/stream/pr2", b"x", "Content-Type: text/plain", "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 0")),
    ("producer gap", [put("/v1/stream/pr3", "Content-Type: text/plain")],
     post("/v1/stream/pr3", b"x", "Content-Type: text/plain", "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 5")),
    ("producer bad headers", [put("/v1/stream/pr4", "Content-Type: text/plain")],
     post("/v1/stream/pr4", b"x", "Content-Type: text/plain", "Producer-Id: w")),
    ("stream seq regression", [put("/v1/stream/s1", "Content-Type: text/plain"),
                               post("/v1/stream/s1", b"x", "Content-Type: text/plain", "Stream-Seq: b")],
     post("/v1/stream/s1", b"x", "Content-Type: text/plain", "Stream-Seq: a")),
    ("bad path segment", [], post("/v1/stream/a//b", b"x", "Content-Type: text/plain")),
    ("over the body limit", [put("/v1/stream/big", "Content-Type: application/octet-stream")],
     post("/v1/stream/big", b"x" * 100_001, "Content-Type: application/octet-stream")),
    ("at the body limit", [put("/v1/stream/big2", "Content-Type: application/octet-stream")],
     post("/v1/stream/big2", b"y" * 100_000, "Content-Type: application/octet-stream")),
    ("wrong internal token", [put("/v1/stream/it", "Content-Type: text/plain")],
     post("/v1/stream/it", b"x", "Content-Type: text/plain", "DS3-Internal-Token: guess")),
    ("snapshot endpoint", [put("/v1/stream/sn", "Content-Type: text/plain")],
     post("/v1/stream/sn/snapshot", b"x", "Content-Type: text/plain")),
    ("bare LF line ends", [put("/v1/stream/lf", "Content-Type: text/plain")],
     b"POST /v1/stream/lf HTTP/1.1\nHost: t\nContent-Type: text/plain\nContent-Length: 8\n\nab\r\n\r\ncd"),
    ("a body that looks like requests", [put("/v1/stream/lk", "Content-Type: text/plain")],
     post("/v1/stream/lk", b"\r\n\r\nPOST /v1/stream/lk HTTP/1.1\r\n\r\n", "Content-Type: text/plain")),
    ("escaped path", [put("/v1/stream/e%20s", "Content-Type: text/plain")],
     post("/v1/stream/e%20s", b"x", "Content-Type: text/plain")),
]


@pytest.mark.parametrize(("setup", "request_"), [(s, r) for _, s, r in CASES], ids=[c[0] for c in CASES])
def test_the_lane_answers_as_aiohttp_does(servers: tuple[procs.Proc, procs.Proc], setup: list[bytes],
                                          request_: bytes) -> None:
    fast, slow = servers
    answers = []
    for p in (fast, slow):
        for r in setup:
            assert parsed(exchange(p.port, r)[0])[0] < 300
        answers.append(parsed(exchange(p.port, request_)[0]))
    (fs, fh, fb), (ss, sh, sb) = answers
    assert fs == ss
    assert {k: STREAM_OFFSET.sub(b"O", v.encode()) for k, v in fh.items()} == \
        {k: STREAM_OFFSET.sub(b"O", v.encode()) for k, v in sh.items()}
    assert STREAM_OFFSET.sub(b"O", fb) == STREAM_OFFSET.sub(b"O", sb)


def test_appends_take_the_lane_and_land_in_order(servers: tuple[procs.Proc, procs.Proc]) -> None:
    fast, _ = servers
    before = fast_count(fast)
    exchange(fast.port, put("/v1/stream/order", "Content-Type: text/plain"))
    # pipelined: three appends and a read in one write
    burst = b"".join(post("/v1/stream/order", str(i).encode(), "Content-Type: text/plain") for i in range(3))
    burst += b"GET /v1/stream/order?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n"
    answers = exchange(fast.port, burst, answers=4)
    # then a body that arrives after its head, in two pieces
    last = post("/v1/stream/order", b"3456", "Content-Type: text/plain")
    split = last.index(b"\r\n\r\n") + 4
    answers += exchange(fast.port, last[:split], last[split:split + 2], last[split + 2:], pause=0.05)
    assert [parsed(a)[0] for a in answers] == [204, 204, 204, 200, 204]
    assert parsed(answers[3])[2] == b"012"
    offsets = [parsed(a)[1]["stream-next-offset"] for a in answers]
    assert offsets[0] < offsets[1] < offsets[2] == offsets[3] < offsets[4]
    final = parsed(exchange(fast.port, b"GET /v1/stream/order?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n")[0])
    assert final[2] == b"0123456"
    assert fast_count(fast) - before == 4


def test_requests_the_lane_leaves_share_the_connection(servers: tuple[procs.Proc, procs.Proc]) -> None:
    """A chunked append, an HTTP/1.0-style close and a HEAD between fast appends: each
    answered once, in order, by whoever takes it."""
    fast, _ = servers
    exchange(fast.port, put("/v1/stream/mixed", "Content-Type: text/plain"))
    chunked = (b"POST /v1/stream/mixed HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n")
    head = b"HEAD /v1/stream/mixed HTTP/1.1\r\nHost: t\r\n\r\n"
    answers = exchange(fast.port, post("/v1/stream/mixed", b"1", "Content-Type: text/plain"), chunked,
                       post("/v1/stream/mixed", b"2", "Content-Type: text/plain"), head,
                       post("/v1/stream/mixed", b"3", "Content-Type: text/plain"), answers=5)
    statuses = [parsed(a)[0] for a in answers]
    assert statuses == [204, 204, 204, 200, 204]
    read = parsed(exchange(fast.port, b"GET /v1/stream/mixed?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n")[0])
    assert read[2] == b"1abc23"


def test_garbage_after_a_fast_append_is_a_400(servers: tuple[procs.Proc, procs.Proc]) -> None:
    fast, _ = servers
    exchange(fast.port, put("/v1/stream/garbage", "Content-Type: text/plain"))
    answers = exchange(fast.port, post("/v1/stream/garbage", b"ok", "Content-Type: text/plain") + b"NOT HTTP\r\n\r\n",
                       answers=2)
    assert [parsed(a)[0] for a in answers] == [204, 400]
    read = parsed(exchange(fast.port, b"GET /v1/stream/garbage?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n")[0])
    assert read[2] == b"ok"


def test_switched_off_lane_serves_nothing(servers: tuple[procs.Proc, procs.Proc], tmp_path: Path) -> None:
    _, slow = servers
    exchange(slow.port, put("/v1/stream/off", "Content-Type: text/plain"))
    assert parsed(exchange(slow.port, post("/v1/stream/off", b"x", "Content-Type: text/plain"))[0])[0] == 204
    assert fast_count(slow) == 0
