"""SIGTERM drains a reader with real processes (`ds3 reader --workers 2`, and a lone one):
every request in flight gets a complete HTTP answer before its connection closes. Parked
long-polls, on the fast lane (reader/lane_long_poll.py) and on aiohttp's path (reader/http.py)
alike, get the live channel's end (503, Retry-After: 1); a long-poll forwarded to the ingester
as a read (offset=now) gets the same; SSE responses end with their last chunk; a request whose
body is still arriving is answered once it is in; new connections are refused; the workers and
the parent exit 0."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil  # type: ignore[import-untyped, unused-ignore]
import pytest

from tests.cluster import Cluster, StoreView, scrape
from tests.procs import request
from tests.test_workers import _wait

ENDED = b"the live subscription ended\n"
PER_CALL_HEADERS = {"date", "x-request-id", "stream-cursor"}


def _gathered(port: int, name: str) -> float:
    """`name` summed over the workers (a gathered scrape labels each worker's sample)."""
    m = scrape(f"http://127.0.0.1:{port}")
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


@pytest.fixture(params=[2, 1], ids=["2-workers", "1-worker"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    # a long-poll timeout far beyond the test: whatever answers a parked long-poll is the drain
    args = ["--workers", str(request.param), "--long-poll-timeout", "60"]
    with Cluster(tmp_path, StoreView.local(tmp_path / "objects"), reader_args=args,
                 ingester_args=["--long-poll-timeout", "60"]) as c:
        if request.param > 1:
            assert c.reader.popen is not None
            _wait(lambda: _all_ready(c.reader.port, request.param), 20, "the workers")
        yield c


def _all_ready(port: int, n: int) -> bool:
    """`n` workers answer (each one's samples are in the gathered /metrics)."""
    try:
        m = scrape(f"http://127.0.0.1:{port}")
    except OSError:
        return False
    return m.get("ds3_reader_worker_scrape_errors") == 0 and all(
        f'process_cpu_seconds_total{{worker="{i}"}}' in m for i in range(n))


class Outcome:
    """What one client got: a whole response (status, lower-cased headers, body) or the
    exception that ended its read (no response, or a response cut short)."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = b""
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        return f"Outcome({self.status}, {self.headers}, {self.body[:80]!r}, {self.error!r})"


def _get(port: int, path: str, out: Outcome) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=40)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        out.status, out.headers = r.status, {k.lower(): v for k, v in r.getheaders()}
        out.body = r.read()  # IncompleteRead when cut short (a chunked SSE body without its last chunk)
    except (OSError, http.client.HTTPException) as e:
        out.error = e
    finally:
        conn.close()


def _start(port: int, path: str, outcomes: list[Outcome]) -> threading.Thread:
    out = Outcome()
    outcomes.append(out)
    t = threading.Thread(target=_get, args=(port, path, out), daemon=True)
    t.start()
    return t


def _send_half_post(port: int, path: str, body: bytes, *, lane: bool) -> socket.socket:
    """A POST whose head and first half of `body` are sent: in flight until the rest comes.
    `lane`: one the reader's fast lane takes (HTTP/1.1); else HTTP/1.0, which is aiohttp's."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    version = "HTTP/1.1" if lane else "HTTP/1.0"
    s.sendall(f"POST {path} {version}\r\nHost: x\r\nContent-Type: text/plain\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
    return s


def _finish_post(s: socket.socket, body: bytes) -> bytes:
    """Send the rest of the body; the whole response (until the server closes)."""
    s.sendall(body[len(body) // 2:])
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    finally:
        s.close()
    return got


def test_sigterm_answers_every_long_poll_and_sse_client_then_exits_0(cluster: Cluster) -> None:
    port = cluster.reader.port
    assert request(cluster.reader, "PUT", "/v1/stream/t", headers={"Content-Type": "text/plain"})[0] == 201
    assert request(cluster.reader, "POST", "/v1/stream/t", b"hello", {"Content-Type": "text/plain"})[0] == 204
    tail = request(cluster.reader, "HEAD", "/v1/stream/t")[1]["stream-next-offset"]
    assert cluster.reader.popen is not None
    parent = cluster.reader.popen.pid
    workers = [c.pid for c in psutil.Process(parent).children()]

    long_polls: list[Outcome] = []
    threads = []
    # In each worker the first long-poll at the tail starts the stream's live channel through
    # aiohttp's path; those that come once it runs are the fast lane's: both are parked.
    for _ in range(4):
        threads.append(_start(port, f"/v1/stream/t?offset={tail}&live=long-poll", long_polls))
    time.sleep(0.5)
    for _ in range(6):
        threads.append(_start(port, f"/v1/stream/t?offset={tail}&live=long-poll", long_polls))
    _wait(lambda: _gathered(port, "ds3_reader_long_poll_waiters") == 10, 15, "10 parked long-polls")
    forwarded: list[Outcome] = []  # waits at the ingester (offset=now is never a channel's)
    threads.append(_start(port, "/v1/stream/t?offset=now&live=long-poll", forwarded))
    sse: list[Outcome] = []
    for _ in range(2):
        threads.append(_start(port, f"/v1/stream/t?offset={tail}&live=sse", sse))
    _wait(lambda: _gathered(port, "ds3_reader_sse_clients") == 2, 15, "2 SSE clients")
    time.sleep(0.5)

    started = time.monotonic()
    os.kill(parent, signal.SIGTERM)  # the parent alone, as a service manager stopping it would
    assert cluster.reader.popen.wait(20) == 0
    took = time.monotonic() - started
    for t in threads:
        t.join(20)
        assert not t.is_alive()

    for out in long_polls + forwarded:
        assert out.error is None, f"a long-poll got no complete answer: {out}"
        assert out.status == 503 and out.headers.get("retry-after") == "1" and out.body == ENDED, out
    # the same answer on every path: the same headers but for those of each request
    shapes = {frozenset((k, v) for k, v in o.headers.items() if k not in PER_CALL_HEADERS)
              for o in long_polls + forwarded}
    assert len(shapes) == 1, shapes
    for out in sse:
        assert out.error is None, f"an SSE response was cut short: {out}"
        assert out.status == 200 and b"event: control" in out.body, out
    assert took < 5, f"parked long-polls are ended at once, not when the shutdown timeout runs out ({took:.1f} s)"
    for pid in workers:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_connections(cluster: Cluster) -> None:
    port = cluster.reader.port
    assert request(cluster.reader, "PUT", "/v1/stream/b", headers={"Content-Type": "text/plain"})[0] == 201
    assert cluster.reader.popen is not None
    body = b"x" * 2000
    # appends whose bodies are still arriving when SIGTERM comes: on the fast lane and aiohttp's path
    lane = [_send_half_post(port, "/v1/stream/b", body, lane=True) for _ in range(3)]
    plain = [_send_half_post(port, "/v1/stream/b", body, lane=False) for _ in range(3)]
    time.sleep(0.5)
    os.kill(cluster.reader.popen.pid, signal.SIGTERM)
    time.sleep(1.0)
    with socket.socket() as s:  # draining: new connections are refused
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert cluster.reader.popen.poll() is None, "the reader left before the requests in flight were answered"
    answers = [_finish_post(s, body) for s in lane + plain]
    for got in answers:
        assert got.startswith((b"HTTP/1.1 204 ", b"HTTP/1.0 204 ")), got[:200]
    assert cluster.reader.popen.wait(20) == 0
    # every append went in: the ingester, still up, has them all
    data, offset = b"", "-1"
    while True:
        status, headers, page = request(cluster.ingester, "GET", f"/v1/stream/b?offset={offset}")
        assert status == 200
        data += page
        offset = headers["stream-next-offset"]
        if headers.get("stream-up-to-date") == "true":
            break
    assert data == body * 6
