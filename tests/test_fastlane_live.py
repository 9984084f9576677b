"""Long-polls on the ingester's fast lane (ingester/fastlane.py, _LongPoll) against real
`ds3 ingester` processes: each long-poll goes to an ingester with the lane and to one without
it (DS3_FAST_LANE=0: aiohttp's handle_get), and the answers must match byte for byte (Date,
request id, the time-based cursor's value and the stream's ids aside): data there at once,
data a commit brings while it waits, the timeout's 204, a closed stream's end, refusals, a
start in a sealed chunk (read from the store), more than the loop reads itself (the read
pool's). Then what only the lane's bookkeeping shows: many waiters woken by one commit, a
client that leaves while it waits, the per-client live cap, and a stop with long-polls parked."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import procs
from tests.rawhttp import STREAM_OFFSET, exchange, parsed, post, put

TIMEOUT = 0.6  # --long-poll-timeout of both ingesters
LIVE_CAP = 3  # --max-live-per-client of both ingesters


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[procs.Proc, procs.Proc]]:
    """Two ingesters sealing 4 KiB chunks into local stores, one with the lane."""
    with procs.lane_and_aiohttp(tmp_path_factory.mktemp("fastlane-live"), "--write-rate", "0", "--seal-bytes", "4096",
                                "--seal-age", "0.2", "--long-poll-timeout", str(TIMEOUT),
                                "--max-live-per-client", str(LIVE_CAP)) as pair:
        yield pair


def metric(p: procs.Proc, pattern: str) -> float:
    with urllib.request.urlopen(f"{p.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{pattern} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def lane_count(p: procs.Proc) -> float:
    return metric(p, "ds3_http_fast_lane_requests_total")


def long_poll(path: str, offset: str, cursor: str | None = None, *headers: str) -> bytes:
    q = f"offset={offset}&live=long-poll" + (f"&cursor={cursor}" if cursor else "")
    return (f"GET {path}?{q} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def tail(p: procs.Proc, path: str) -> str:
    raw = exchange(p.port, f"HEAD {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode(), bodiless=True)[0]
    return parsed(raw)[1]["stream-next-offset"]


def normal(raw: bytes, port: int) -> tuple[int, dict[str, str], bytes]:
    status, headers, body = parsed(raw)
    headers.pop("date", None)
    headers.pop("x-request-id", None)
    if "stream-cursor" in headers:
        headers["stream-cursor"] = "CURSOR"  # (time-based: the two may fall in different intervals)
    if "etag" in headers:
        headers["etag"] = re.sub(r'^"\d+\.', '"SID.', headers["etag"])
    out = {k: STREAM_OFFSET.sub(b"O", v.encode()).decode().replace(str(port), "PORT") for k, v in headers.items()}
    return status, out, STREAM_OFFSET.sub(b"O", body)


def in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)  # type: ignore[operator]
    t.start()
    return t, out


START = "0000000000000000_0000000000000000"


def _scenario(p: procs.Proc, where: str) -> bytes:
    """Set up `where`'s stream on `p` and make its long-poll; the raw answer."""
    json_ = where.startswith("json")
    ct = "application/json" if json_ else "text/plain"
    path = f"/v1/stream/lp-{where.replace(' ', '-')}-{p.port}"
    if where == "missing":
        return exchange(p.port, long_poll(path, START))[0]
    if where == "missing bucket":
        return exchange(p.port, long_poll("/v1/buckets/nolpb/s", START))[0]
    assert parsed(exchange(p.port, put(path, f"Content-Type: {ct}", "Stream-TTL: 3600"))[0])[0] == 201
    first = b'{"a":1}' if json_ else b"abc"
    assert parsed(exchange(p.port, post(path, first, f"Content-Type: {ct}"))[0])[0] == 204
    if where in ("data", "json data"):
        return exchange(p.port, long_poll(path, START))[0]
    if where == "data with cursor":
        return exchange(p.port, long_poll(path, START, "12345"))[0]
    if where == "beyond":
        return exchange(p.port, long_poll(path, "0000000000000000_0000000000099999"))[0]
    if where == "json not a boundary":
        return exchange(p.port, long_poll(path, "0000000000000000_0000000000000002"))[0]
    at = tail(p, path)
    if where in ("woken", "json woken"):
        t, out = in_thread(lambda: exchange(p.port, long_poll(path, at, "7"), timeout=10)[0])
        time.sleep(0.2)
        more = b'{"b":2}' if json_ else b"defg"
        assert parsed(exchange(p.port, post(path, more, f"Content-Type: {ct}"))[0])[0] == 204
        t.join(10)
        return out[0]  # type: ignore[return-value]
    if where == "timeout":
        return exchange(p.port, long_poll(path, at, "7"), timeout=10)[0]
    if where == "closed":
        assert parsed(exchange(p.port, post(path, b"", "Stream-Closed: true"))[0])[0] == 204
        return exchange(p.port, long_poll(path, tail(p, path), "7"), timeout=10)[0]
    if where in ("sealed", "more than the loop reads"):
        n = 12 if where == "sealed" else 80  # 80 x 1,000 bytes after the offset: the read pool's
        for i in range(n):
            assert parsed(exchange(p.port, post(path, bytes([65 + i % 26]) * 1000, f"Content-Type: {ct}"))[0])[0] == 204
        if where == "sealed":
            deadline = time.monotonic() + 20
            while not any((Path(p.args[p.args.index("--store") + 1][7:]) / "chunks").rglob("*")):
                assert time.monotonic() < deadline, "nothing sealed"
                time.sleep(0.05)
            time.sleep(0.5)
        return exchange(p.port, long_poll(path, at), timeout=10)[0]
    raise AssertionError(where)


WHERE = ["data", "data with cursor", "json data", "woken", "json woken", "timeout", "closed", "missing",
         "missing bucket", "beyond", "json not a boundary", "sealed", "more than the loop reads"]


@pytest.mark.parametrize("where", WHERE)
def test_long_polls_take_the_lane_and_answer_as_aiohttp_does(live: tuple[procs.Proc, procs.Proc],
                                                            where: str) -> None:
    answers = []
    for p in live:
        before = lane_count(p)
        answers.append(normal(_scenario(p, where), p.port))
        if p is live[0]:
            assert lane_count(p) - before >= 1  # (its setup's HEADs and appends are the lane's too)
    assert answers[0] == answers[1]
    status = answers[0][0]
    expected = {"timeout": 204, "closed": 204, "missing": 404, "missing bucket": 404, "beyond": 400,
                "json not a boundary": 400}.get(where, 200)
    assert status == expected, answers[0]
    if where == "timeout":
        assert answers[0][1]["stream-cursor"] == "CURSOR" and "stream-closed" not in answers[0][1]
    if where == "closed":
        assert answers[0][1]["stream-closed"] == "true" and "stream-cursor" not in answers[0][1]


def test_one_commit_wakes_every_waiter(live: tuple[procs.Proc, procs.Proc]) -> None:
    fast = live[0]
    path = "/v1/stream/lp-many"
    exchange(fast.port, put(path, "Content-Type: text/plain"))
    at = tail(fast, path)
    waiters = [in_thread(lambda: exchange(fast.port, long_poll(path, at), timeout=10)[0]) for _ in range(LIVE_CAP)]
    deadline = time.monotonic() + 5
    while metric(fast, 'ds3_http_live_connections{mode="long-poll"}') < LIVE_CAP:
        assert time.monotonic() < deadline, "the long-polls did not park"
        time.sleep(0.02)
    assert parsed(exchange(fast.port, post(path, b"news", "Content-Type: text/plain"))[0])[0] == 204
    for t, out in waiters:
        t.join(10)
        status, _, body = parsed(out[0])  # type: ignore[arg-type]
        assert (status, body) == (200, b"news")
    assert metric(fast, 'ds3_http_live_connections{mode="long-poll"}') == 0


def test_a_client_that_leaves_while_it_waits_frees_its_place(live: tuple[procs.Proc, procs.Proc]) -> None:
    fast = live[0]
    path = "/v1/stream/lp-leaves"
    exchange(fast.port, put(path, "Content-Type: text/plain"))
    at = tail(fast, path)
    closed = 'ds3_http_requests_total{route="stream_long_poll",status="499"}'
    before = metric(fast, closed)
    for _ in range(LIVE_CAP + 2):  # more than the live cap: each place was given back
        with socket.create_connection(("127.0.0.1", fast.port)) as s:
            s.sendall(long_poll(path, at))
            time.sleep(0.05)
    deadline = time.monotonic() + 5
    while metric(fast, closed) < before + LIVE_CAP + 2:
        assert time.monotonic() < deadline, "the departures were not counted"
        time.sleep(0.02)
    assert metric(fast, 'ds3_http_live_connections{mode="long-poll"}') == 0
    t, out = in_thread(lambda: exchange(fast.port, long_poll(path, at), timeout=10)[0])
    time.sleep(0.1)
    assert parsed(exchange(fast.port, post(path, b"still", "Content-Type: text/plain"))[0])[0] == 204
    t.join(10)
    assert parsed(out[0])[0::2] == (200, b"still")  # type: ignore[arg-type]


def test_the_live_cap_refuses_as_aiohttp_does(live: tuple[procs.Proc, procs.Proc]) -> None:
    """One client (a proxy's X-Forwarded-For: loopback itself is a trusted proxy, unlimited)
    holds LIVE_CAP long-polls; its next one is refused."""
    client = "X-Forwarded-For: 203.0.113.9"
    answers = []
    for p in live:
        path = f"/v1/stream/lp-cap-{p.port}"
        exchange(p.port, put(path, "Content-Type: text/plain"))
        at = tail(p, path)
        held = [socket.create_connection(("127.0.0.1", p.port)) for _ in range(LIVE_CAP)]
        try:
            for s in held:
                s.sendall(long_poll(path, at, None, client))
            deadline = time.monotonic() + 5
            while metric(p, 'ds3_http_live_connections{mode="long-poll"}') < LIVE_CAP:
                assert time.monotonic() < deadline, "the long-polls did not park"
                time.sleep(0.02)
            answers.append(normal(exchange(p.port, long_poll(path, at, None, client))[0], p.port))
        finally:
            for s in held:
                s.close()
    assert answers[0] == answers[1]
    assert answers[0][0] == 429 and "retry-after" in answers[0][1]


def test_a_stop_with_long_polls_parked_is_prompt(tmp_path: Path) -> None:
    p = procs.ingester(tmp_path / "wal", "--long-poll-timeout", "30")
    p.start()
    try:
        path = "/v1/stream/lp-stop"
        exchange(p.port, put(path, "Content-Type: text/plain"))
        at = tail(p, path)
        held = [socket.create_connection(("127.0.0.1", p.port)) for _ in range(5)]
        for s in held:
            s.sendall(long_poll(path, at))
        time.sleep(0.3)
        assert p.popen is not None
        started = time.monotonic()
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(15) == 0
        assert time.monotonic() - started < 10
        for s in held:
            s.close()
    finally:
        p.stop()
