"""`ds3 reader --workers N` with real processes: the workers share the public port, one scrape
of /metrics answers for all of them, a dead worker is replaced, SIGTERM drains, and workers do
not outlive their parent."""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil  # type: ignore[import-untyped, unused-ignore]
import pytest

from reader.workers import PARENT_FILE, RUN_DIR_PREFIX, sweep_stale_run_dirs
from tests.cluster import Cluster, StoreView, parse_metrics, scrape
from tests.procs import free_port, reader


def _request(base_port: int, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 10) -> tuple[int, bytes]:
    """One request on a fresh connection (the kernel picks a worker per connection)."""
    conn = http.client.HTTPConnection("127.0.0.1", base_port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _workers(parent_pid: int) -> list[int]:
    return sorted(c.pid for c in psutil.Process(parent_pid).children() if c.status() != psutil.STATUS_ZOMBIE)


def _wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _all_ready(port: int, parent: int, n: int) -> bool:
    """`n` workers are up and each answers on its private socket (the gathered /metrics says so)."""
    if len(_workers(parent)) != n:
        return False
    try:
        m = scrape(f"http://127.0.0.1:{port}")
    except OSError:
        return False
    return m.get("ds3_reader_worker_scrape_errors") == 0 and all(
        f'process_cpu_seconds_total{{worker="{i}"}}' in m for i in range(n))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path, StoreView.local(tmp_path / "objects"),
                 reader_args=["--workers", "3", "--log-level", "info", "--access-log"]) as c:
        assert c.reader.popen is not None
        _wait(lambda: _all_ready(c.reader.port, c.reader.popen.pid, 3), 20, "3 workers")  # type: ignore[union-attr]
        yield c


def test_workers_share_the_port_and_one_scrape_counts_them_all(cluster: Cluster) -> None:
    port = cluster.reader.port
    assert _request(port, "PUT", "/v1/stream/w", headers={"Content-Type": "text/plain"})[0] == 201
    for i in range(40):
        assert _request(port, "POST", "/v1/stream/w", f"{i},".encode(), {"Content-Type": "text/plain"})[0] == 204
    status, body = _request(port, "GET", "/v1/stream/w?offset=-1")
    assert status == 200 and body == b"".join(f"{i},".encode() for i in range(40))

    m = scrape(cluster.reader.url)
    assert m["ds3_reader_workers"] == 3 and m["ds3_reader_worker_scrape_errors"] == 0
    per_worker = {i: m.get(f'ds3_http_requests_total{{route="stream_append",status="204",worker="{i}"}}', 0.0)
                  for i in range(3)}
    assert sum(per_worker.values()) == 40, per_worker  # every append counted once, by the worker that took it
    assert sum(1 for v in per_worker.values() if v > 0) >= 2, per_worker  # the kernel spread the connections
    # the siblings' scrapes over their unix sockets are not in the access log (found by QA: one
    # scrape of the port made a line per worker); the client's own request is
    _wait(lambda: "GET /metrics " in cluster.reader.log_path.read_text(), 10, "the scrape's access log line")
    assert "GET /metrics?scope=worker" not in cluster.reader.log_path.read_text()
    # ?scope=worker: the answering worker's own figures, unlabelled
    own = parse_metrics(_request(port, "GET", "/metrics?scope=worker")[1].decode())
    assert "ds3_reader_workers" not in own and not any('worker="' in k for k in own)
    # a scope that names none is refused, not taken for every worker's (a typo went unnoticed)
    status, body = _request(port, "GET", "/metrics?scope=workers")
    assert status == 400 and b"unknown metrics scope 'workers'" in body
    assert _request(cluster.ingester.port, "GET", "/metrics?scope=x")[0] == 400


def test_a_killed_worker_is_replaced_and_the_port_keeps_answering(cluster: Cluster) -> None:
    assert cluster.reader.popen is not None
    parent = cluster.reader.popen.pid
    before = _workers(parent)
    assert len(before) == 3
    os.kill(before[0], signal.SIGKILL)
    _wait(lambda: _all_ready(cluster.reader.port, parent, 3) and before[0] not in _workers(parent), 20,
          "the killed worker's replacement")
    assert len(set(_workers(parent)) - set(before)) == 1
    port = cluster.reader.port
    assert _request(port, "PUT", "/v1/stream/k", headers={"Content-Type": "text/plain"})[0] == 201
    statuses = [_request(port, "POST", "/v1/stream/k", b"x", {"Content-Type": "text/plain"})[0] for _ in range(30)]
    assert statuses == [204] * 30
    assert "starting it again" in cluster.reader.log_path.read_text()


def test_sigterm_drains_the_workers_and_the_parent_exits_0(cluster: Cluster) -> None:
    assert cluster.reader.popen is not None
    parent = cluster.reader.popen.pid
    workers = _workers(parent)
    port = cluster.reader.port
    assert _request(port, "PUT", "/v1/stream/d", headers={"Content-Type": "text/plain"})[0] == 201
    tail = _request(port, "HEAD", "/v1/stream/d")
    assert tail[0] == 200
    outcome: list[object] = []

    def long_poll() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("GET", "/v1/stream/d?offset=now&live=long-poll")
            r = conn.getresponse()
            outcome.append((r.status, r.read()))
        except (OSError, http.client.HTTPException) as e:  # a clean close is an answer too
            outcome.append(e)
        finally:
            conn.close()

    t = threading.Thread(target=long_poll)
    t.start()
    time.sleep(0.5)  # the long-poll is parked in a worker
    os.kill(parent, signal.SIGTERM)
    assert cluster.reader.popen.wait(20) == 0
    t.join(20)
    assert not t.is_alive() and outcome, "the in-flight long-poll got neither an answer nor a close"
    if isinstance(outcome[0], tuple):
        assert outcome[0][0] in (200, 204, 503), outcome
    for pid in workers:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with socket.socket() as s:  # nothing listens on the port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_workers_leave_when_their_parent_is_killed(cluster: Cluster) -> None:
    assert cluster.reader.popen is not None
    parent = cluster.reader.popen.pid
    workers = _workers(parent)
    run_dirs = [d for d in Path(tempfile.gettempdir()).glob(RUN_DIR_PREFIX + "*")
                if (d / PARENT_FILE).exists() and (d / PARENT_FILE).read_text() == str(parent)]
    assert len(run_dirs) == 1 and list(run_dirs[0].glob("*.sock"))
    os.kill(parent, signal.SIGKILL)  # the parent alone: it cannot pass anything on
    cluster.reader.popen.wait(10)

    def gone() -> bool:
        return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in workers)

    _wait(gone, 10, "orphaned workers to stop")
    # their run dir (metrics sockets) goes with them: a SIGKILLed parent cannot remove it
    _wait(lambda: not run_dirs[0].exists(), 10, "the orphans' run dir to be removed")


def test_a_new_parent_sweeps_run_dirs_left_by_killed_ones(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f"{RUN_DIR_PREFIX}old"
    left.mkdir()
    (left / PARENT_FILE).write_text(str(dead.pid))
    (left / "worker-0.sock").write_text("")
    alive = tmp_path / f"{RUN_DIR_PREFIX}live"
    alive.mkdir()
    (alive / PARENT_FILE).write_text(str(os.getpid()))
    foreign = tmp_path / f"{RUN_DIR_PREFIX}foreign"  # not a run dir of ours: no parent file
    foreign.mkdir()
    assert sweep_stale_run_dirs(tmp_path) == 1
    assert not left.exists() and alive.exists() and foreign.exists()


def test_bursts_of_connections_are_spread_over_every_worker(cluster: Cluster) -> None:
    """Five times, 30 clients connect at once (as a load generator or a CDN's pool does): every
    worker takes some of each burst, and a fair share of them all. (With one accept queue
    shared by all, the worker that woke first took most of a burst: 29 of 32 in the append
    benchmark, at times all; one core was busy and the other idle.)"""
    assert cluster.reader.popen is not None
    workers = _workers(cluster.reader.popen.pid)
    port = cluster.reader.port

    async def burst() -> dict[int, int]:
        conns = await asyncio.gather(*[asyncio.open_connection("127.0.0.1", port) for _ in range(30)])
        try:
            for _, w in conns:  # each connection answered: accepted by some worker
                w.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            for r, _ in conns:
                assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            ours = {w.get_extra_info("sockname")[1] for _, w in conns}
            return {pid: sum(1 for k in psutil.Process(pid).net_connections("tcp") if k.raddr and k.raddr.port in ours)
                    for pid in workers}
        finally:
            for _, w in conns:
                w.close()

    bursts = [asyncio.run(burst()) for _ in range(5)]
    assert all(sum(held.values()) == 30 for held in bursts), bursts
    assert all(min(held.values()) >= 1 for held in bursts), bursts  # (2/3)^30 by chance: 5e-6
    assert min(sum(held[pid] for held in bursts) for pid in workers) >= 25, bursts  # fair: 50 of 150


def _refused_start(work: Path, port: int) -> str:
    """Start `ds3 reader --workers 2` on `port`, which must exit 1 at once; its log."""
    from tests.procs import DS3

    proc = reader(work / "r", "http://127.0.0.1:1", (work / "o").as_uri(), "--workers", "2", port=port)
    (work / "o").mkdir()
    with open(proc.log_path, "wb") as log:
        p = subprocess.Popen([DS3, *proc.args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert p.wait(30) == 1
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return proc.log_path.read_text()


def test_a_second_reader_on_the_port_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    """The workers' sockets share the port (SO_REUSEPORT), yet a second `ds3 reader --workers`
    started on it does not join them: it exits 1 with a clear message."""
    port = cluster.reader.port
    assert f"cannot listen on 127.0.0.1 port {port}" in _refused_start(tmp_path, port)


def test_a_taken_port_stops_the_parent_at_once(tmp_path: Path) -> None:
    """The parent makes the listening socket: a port another program holds is a clear error and
    exit 1 before any worker starts."""
    port = free_port()
    with socket.socket() as taken:  # an ordinary listener holds the port
        taken.bind(("127.0.0.1", port))
        taken.listen()
        text = _refused_start(tmp_path, port)
    assert f"cannot listen on 127.0.0.1 port {port}" in text and "workers (pids" not in text


def test_connections_queued_behind_a_killed_worker_are_served(cluster: Cluster) -> None:
    """With every worker frozen, 30 clients connect and send a request; one worker is
    SIGKILLed, the rest resume, and every client gets its answer: the killed worker's share
    waited in its socket's queue, which the parent holds, for its replacement. (With each
    worker its socket's only holder, that share was reset.)"""
    assert cluster.reader.popen is not None
    parent = cluster.reader.popen.pid
    workers = _workers(parent)
    port = cluster.reader.port
    assert _request(port, "PUT", "/v1/stream/q", headers={"Content-Type": "text/plain"})[0] == 201
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    clients = []
    try:
        for _ in range(30):
            c = socket.create_connection(("127.0.0.1", port), timeout=20)
            c.sendall(b"HEAD /v1/stream/q HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            clients.append(c)
        os.kill(workers[0], signal.SIGKILL)
    finally:
        for pid in workers[1:]:
            os.kill(pid, signal.SIGCONT)
        os.kill(workers[0], signal.SIGCONT)
    answers = []
    for c in clients:
        with c:
            data = b""
            while chunk := c.recv(65536):
                data += chunk
            answers.append(data.split(b"\r\n", 1)[0])
    assert answers == [b"HTTP/1.1 200 OK"] * 30
