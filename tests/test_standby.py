"""`ds3 ingester --standby` with real processes and real faults (issue 14, items 4 and 6).

- owner + standby, 8 idempotent producers appending; the owner SIGKILLed: the standby takes
  over within the lease plus a few seconds (the time from the kill to its first acknowledged
  append is printed); in store mode every acknowledged append is there at the offset it was
  acknowledged at, and the producers' retries of their in-flight requests are deduplicated.
  Against the local-directory store and moto.
- the owner frozen (SIGSTOP) past its lease: the standby takes over and acknowledges; the old
  owner resumed (SIGCONT) acknowledges nothing more (503), and none of its later appends
  appears in the stream the new owner serves. Store and local durability.
- the store cut mid-segment (a TCP gate in front of moto) in store mode: appends in flight
  get 503 or are acknowledged only once their segment landed; after the store is back,
  nothing acknowledged is lost (an empty-disk restart compares).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cluster import StoreView
from tests.procs import Proc, ingester, metric, metrics
from tests.tcpgate import TcpGate
from tests.test_durability import POSITION, _read_all, _req

pytestmark = pytest.mark.slow

LEASE = 2.0  # --lease-seconds of both (the takeover waits for it, plus max skew, 1 s)
STREAMS = ["s0", "s1", "s2", "s3"]
TEXT = {"Content-Type": "text/plain"}



def _node(data: Path, store: StoreView, *extra: str, endpoint: str | None = None) -> Proc:
    return ingester(data, *store.server_args(endpoint), "--lease-seconds", str(LEASE), "--seal-bytes", "4096",
                    "--log-level", "info", *extra)


@dataclass
class Producer:
    """An idempotent producer appending lines to one stream; on a failure it retries the same
    request (same Producer-Seq) against each of `ports` in turn, as a client behind a load
    balancer would."""

    wid: int
    stream: str
    ports: list[int]
    acked: list[tuple[bytes, int | None, float, int]] = field(default_factory=list)  # line, end, when, port
    refused: int = 0  # 503s and broken connections
    inflight: bytes | None = None

    def line(self, n: int) -> bytes:
        return b"w%02d-%06d\n" % (self.wid, n)

    def run(self, stop: threading.Event, deadline: float) -> None:
        n, i = 0, 0
        conns: dict[int, http.client.HTTPConnection] = {}
        while not stop.is_set() and time.monotonic() < deadline:
            port = self.ports[i % len(self.ports)]
            line = self.line(n)
            self.inflight = line
            headers = TEXT | {"Producer-Id": f"p{self.wid:02d}", "Producer-Epoch": "0", "Producer-Seq": str(n)}
            try:
                conn = conns.get(port) or conns.setdefault(port, http.client.HTTPConnection("127.0.0.1", port,
                                                                                            timeout=10))
                conn.request("POST", f"/v1/stream/{self.stream}", body=line, headers=headers)
                resp = conn.getresponse()
                resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException):
                conns.pop(port, None)
                status = 0
            if status in (200, 204):
                pos = POSITION.fullmatch(resp.headers["Stream-Next-Offset"])
                assert pos is not None
                # 204: a duplicate (this request's earlier attempt was taken): no position to check
                self.acked.append((line, int(pos.group(1)) if status == 200 else None, time.monotonic(), port))
                self.inflight = None
                n += 1
                continue
            assert status in (0, 503), (self.wid, status)
            self.refused += 1
            i += 1
            time.sleep(0.02)


def _start(producers: list[Producer], seconds: float) -> tuple[threading.Event, list[threading.Thread]]:
    stop = threading.Event()
    deadline = time.monotonic() + seconds
    threads = [threading.Thread(target=p.run, args=(stop, deadline), daemon=True) for p in producers]
    for t in threads:
        t.start()
    return stop, threads


def _check(base: str, producers: list[Producer]) -> int:
    """Every acknowledged line is in its stream once, where it was acknowledged; returns how many."""
    contents = {s: _read_all(base, s) for s in STREAMS}
    n = 0
    for p in producers:
        data = contents[p.stream]
        for line, end, _, _ in p.acked:
            assert data.count(line) == 1, (line, data.count(line))
            if end is not None:
                assert data[end - len(line):end] == line, (line, end)
            n += 1
        if p.inflight is not None:
            assert data.count(p.inflight) <= 1
    return n


def _readyz(base: str) -> dict[str, object]:
    body: dict[str, object] = json.loads(_req("GET", f"{base}/readyz")[2])
    return body


def test_standby_takes_over_from_a_killed_owner(tmp_path: Path, store: StoreView) -> None:
    a = _node(tmp_path / "a", store, "--durability", "store").start()
    b = _node(tmp_path / "b", store, "--durability", "store", "--standby").start()
    try:
        for s in STREAMS:
            assert _req("PUT", f"{a.url}/v1/stream/{s}", headers=TEXT)[0] == 201
        # the standby refuses, naming the owner; /readyz says so
        status, headers, body = _req("POST", f"{b.url}/v1/stream/s0", b"x", TEXT)
        assert status == 503 and "Retry-After" in headers and a.url.encode() in body, (status, body)
        ready = _readyz(b.url)
        assert ready["status"] == "not ready"
        assert any(f"standby (owner: {a.url}, epoch 1)" in r for r in ready["reasons"]), ready  # type: ignore[attr-defined]
        assert _req("GET", f"{b.url}/v1/stream/s0?offset=-1")[0] == 503
        producers = [Producer(i, STREAMS[i % len(STREAMS)], [a.port, b.port]) for i in range(8)]
        stop, threads = _start(producers, 30)
        time.sleep(1.5)
        # the standby follows the owner's log meanwhile (a takeover replays only what follows)
        shipped = metric(metrics(a), "ds3_log_shipped_seq")
        assert shipped is not None and shipped > 0
        deadline = time.monotonic() + 10
        while (followed := metric(metrics(b), "ds3_standby_followed_seq") or 0) < shipped:
            assert time.monotonic() < deadline, f"the standby follows the log only to commit {followed} of {shipped}"
            time.sleep(0.1)
        before = sum(len(p.acked) for p in producers)
        killed_at = time.monotonic()
        a.kill()
        # the first append the standby acknowledges
        deadline = killed_at + LEASE + 15
        first = None
        while time.monotonic() < deadline and first is None:
            at = [at for p in producers for _, _, at, port in p.acked if port == b.port]
            first = min(at) if at else None
            time.sleep(0.01)
        assert first is not None, "the standby never acknowledged:\n" + b.log_path.read_text()[-3000:]
        takeover = first - killed_at
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(15)
        print(f"\n{store.kind} store, lease {LEASE}s (+1 s max skew): owner SIGKILLed after {before} appends; "
              f"first append acknowledged by the standby {takeover:.2f}s later")
        assert takeover < LEASE + 1 + 3, takeover
        assert "took over" in (log := b.log_path.read_text()) and "; followed the log to commit" in log, log[-3000:]
        assert _readyz(b.url)["status"] == "ready"
        acked = _check(b.url, producers)
        assert acked > before > 50
        # every producer's last acknowledged request, retried: a duplicate
        for p in producers:
            n = len(p.acked) - 1
            h = TEXT | {"Producer-Id": f"p{p.wid:02d}", "Producer-Epoch": "0", "Producer-Seq": str(n)}
            # (a 503 says "again later", as a client retries: the new owner's lease renewal
            # may stall a moment on a busy machine; the answer must then be the duplicate)
            for _ in range(20):
                status, _, body = _req("POST", f"{b.url}/v1/stream/{p.stream}", p.line(n), h)
                if status != 503:
                    break
                print(f"retry of p{p.wid:02d} seq {n}: 503 {body[:200]!r}")
                time.sleep(0.5)
            assert status == 204, (status, body[:300])
        assert _check(b.url, producers) == acked
    finally:
        a.kill()
        b.stop()


@pytest.mark.parametrize("durability", ["store", "local"])
def test_a_frozen_owner_resumed_acknowledges_nothing(tmp_path: Path, durability: str) -> None:
    store = StoreView.local(tmp_path / "objects")
    mode = ["--durability", durability, "--ship-interval", "0.2"]
    a = _node(tmp_path / "a", store, *mode).start()
    b = _node(tmp_path / "b", store, *mode, "--standby").start()
    assert a.popen is not None
    try:
        assert _req("PUT", f"{a.url}/v1/stream/x", headers=TEXT)[0] == 201
        for i in range(20):
            assert _req("POST", f"{a.url}/v1/stream/x", b"a-%03d\n" % i, TEXT)[0] == 204
        time.sleep(0.6)  # shipped (local mode)
        os.kill(a.popen.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + LEASE + 15
            status = 0
            while time.monotonic() < deadline:
                status = _req("POST", f"{b.url}/v1/stream/x", b"b-000\n", TEXT, timeout=5)[0]
                if status == 204:
                    break
                time.sleep(0.05)
            assert status == 204, b.log_path.read_text()[-3000:]
            for i in range(1, 10):
                assert _req("POST", f"{b.url}/v1/stream/x", b"b-%03d\n" % i, TEXT)[0] == 204
        finally:
            os.kill(a.popen.pid, signal.SIGCONT)
        # at once, and for a while: the old owner acknowledges nothing
        late = []
        conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=10)
        for i in range(20):
            status = _req("POST", f"{a.url}/v1/stream/x", b"late-%03d\n" % i, TEXT)[0]
            late.append(status)
            conn.request("POST", "/v1/stream/x", body=b"late-k%03d\n" % i, headers=TEXT)  # keep-alive: fast lane
            r = conn.getresponse()
            r.read()
            late.append(r.status)
            time.sleep(0.05)
        assert set(late) == {503}, late
        time.sleep(1.0)  # anything the old owner might still ship would have landed by now
        data = _read_all(b.url, "x")
        assert b"late-" not in data
        assert data.count(b"b-") == 10
        if durability == "store":
            assert all(data.count(b"a-%03d\n" % i) == 1 for i in range(20))
        log = a.log_path.read_text()
        assert "fenced" in log or "lease ran out" in log
    finally:
        a.kill()
        b.stop()
    # and the store's log, replayed on an empty disk, holds the new owner's history only
    c = _node(tmp_path / "c", store, *mode).start()
    try:
        assert _read_all(c.url, "x") == data
    finally:
        c.stop()


def test_store_cut_mid_segment_loses_nothing_acknowledged(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    store, gate = gated_s3
    a = _node(tmp_path / "a", store, "--durability", "store", "--owner-id", "node-a", endpoint=gate.url)
    a.start()
    try:
        for s in STREAMS:
            assert _req("PUT", f"{a.url}/v1/stream/{s}", headers=TEXT)[0] == 201
        producers = [Producer(i, STREAMS[i % len(STREAMS)], [a.port]) for i in range(8)]
        stop, threads = _start(producers, 40)
        time.sleep(1.0)
        cut_at = sum(len(p.acked) for p in producers)
        gate.down()  # every connection to the store cut, segment PUTs in flight included
        time.sleep(3.0)
        during = sum(len(p.acked) for p in producers)
        gate.up()
        # appends are acknowledged again once the shipper's next retry gets through (its
        # backoff may have grown during the cut; a loaded machine adds seconds)
        deadline = time.monotonic() + 20.0
        while sum(len(p.acked) for p in producers) <= during + 50 and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(15)
        refused = sum(p.refused for p in producers)
        after = sum(len(p.acked) for p in producers)
        print(f"\nstore cut for 3 s: {cut_at} acknowledged before, {during - cut_at} during, "
              f"{after - during} after; {refused} refused (503) and retried")
        assert refused > 0 and after > during
        live = _check(a.url, producers)
    finally:
        a.kill()
    shutil.rmtree(tmp_path / "a")
    b = _node(tmp_path / "b", store, "--durability", "store", "--owner-id", "node-a").start()
    try:
        assert _check(b.url, producers) == live
    finally:
        b.stop()


def test_a_restore_longer_than_the_lease_keeps_it(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    """The standby renews the lease it took while it restores: a log that takes longer to
    fetch than the lease (here: 320 segments through a store slowed to 0.2 s a piece: ~10 s) is
    restored without the lease lapsing (which would let another standby take the prefix) and
    without the new owner fencing itself once it starts."""
    store, gate = gated_s3
    lease = ("--lease-seconds", "3")  # (the last one given counts) renewals take ~3 pieces' delay
    a = _node(tmp_path / "a", store, "--durability", "store", "--owner-id", "node-a",
              "--checkpoint-interval", "3600", *lease).start()
    b = _node(tmp_path / "b", store, "--durability", "store", "--owner-id", "node-b", "--standby", *lease,
              endpoint=gate.url)
    b.env["DS3_STANDBY_FOLLOW"] = "0"  # it restores the whole log once it took the lease
    b.start()
    try:
        assert _req("PUT", f"{a.url}/v1/stream/s0", headers=TEXT)[0] == 201
        for n in range(320):  # sequential: a segment each
            assert _req("POST", f"{a.url}/v1/stream/s0", b"%04d;" % n, TEXT)[0] == 204
        gate.delay = 0.2
        a.kill()
        killed = time.monotonic()
        while "took over" not in b.log_path.read_text():  # restored (through the slow store) and serving
            assert time.monotonic() - killed < 90, b.log_path.read_text()[-3000:]
            time.sleep(0.2)
        took = time.monotonic() - killed
        gate.delay = 0.0  # (store-mode acks wait for segment PUTs: not what this test is about)
        while _req("POST", f"{b.url}/v1/stream/s0", b"after;", TEXT)[0] not in (200, 204):
            assert time.monotonic() - killed < 120, b.log_path.read_text()[-3000:]
            time.sleep(0.2)
        log = b.log_path.read_text()
        assert "took over" in log and "fenced" not in log and "lease was lost" not in log, log[-3000:]
        assert _read_all(b.url, "s0") == b"".join(b"%04d;" % n for n in range(320)) + b"after;"
        print(f"\ntakeover with a slow restore: {took:.1f} s (lease 3 s)")
        assert took > 3 + 1  # the restore did outlast the lease (else this proves nothing)
    finally:
        gate.delay = 0.0
        b.stop()
        a.stop()


def test_an_empty_disk_restore_longer_than_the_lease_keeps_it(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    """The same for an ingester started without --standby on an empty data dir (the lost disk's
    recovery): its restore outlasted the lease, it fenced itself at its first renewal and
    exited, and so at every restart (found by QA: ~1,000 segments on moto, a 3 s lease)."""
    store, gate = gated_s3
    lease = ("--lease-seconds", "3")
    a = _node(tmp_path / "a", store, "--durability", "store", "--owner-id", "node-a",
              "--checkpoint-interval", "3600", *lease).start()
    try:
        assert _req("PUT", f"{a.url}/v1/stream/s0", headers=TEXT)[0] == 201
        for n in range(200):  # sequential: a segment each
            assert _req("POST", f"{a.url}/v1/stream/s0", b"%04d;" % n, TEXT)[0] == 204
    finally:
        a.kill()
    shutil.rmtree(tmp_path / "a")
    time.sleep(3 + 1.5)  # the lease lapses: the new one need not wait for it
    gate.delay = 0.2
    started = time.monotonic()
    b = _node(tmp_path / "b", store, "--durability", "store", "--owner-id", "node-b", *lease, endpoint=gate.url)
    try:
        b.start(timeout=120)
        took = time.monotonic() - started
        gate.delay = 0.0
        assert _req("POST", f"{b.url}/v1/stream/s0", b"after;", TEXT)[0] == 204
        log = b.log_path.read_text()
        assert "fenced" not in log and "lease was lost" not in log and "lost:" not in log, log[-3000:]
        assert _read_all(b.url, "s0") == b"".join(b"%04d;" % n for n in range(200)) + b"after;"
        assert took > 3 + 1, took  # the restore did outlast the lease (else this proves nothing)
    finally:
        gate.delay = 0.0
        b.stop()


def test_a_clean_shutdown_hands_over_at_once(tmp_path: Path) -> None:
    """The owner releases its lease when it stops: the standby need not wait for it to lapse,
    only for its next read of the record (every third of its lease)."""
    store = StoreView.local(tmp_path / "objects")
    a = ingester(tmp_path / "a", *store.server_args(), "--durability", "store", "--lease-seconds", "6").start()
    b = ingester(tmp_path / "b", *store.server_args(), "--durability", "store", "--lease-seconds", "6",
                 "--standby").start()
    try:
        assert _req("PUT", f"{a.url}/v1/stream/x", headers=TEXT)[0] == 201
        assert _req("POST", f"{a.url}/v1/stream/x", b"one\n", TEXT)[0] == 204
        status, headers, _ = _req("POST", f"{b.url}/v1/stream/x", b"no\n", TEXT)
        assert status == 503 and int(headers["Retry-After"]) > 3  # the owner's lease, 6 s
        stopped = time.monotonic()
        a.stop()
        while time.monotonic() < stopped + 10:
            if _req("POST", f"{b.url}/v1/stream/x", b"two\n", TEXT)[0] == 204:
                break
            time.sleep(0.05)
        took = time.monotonic() - stopped
        print(f"\nclean shutdown of the owner -> first append acknowledged by the standby: {took:.2f}s")
        assert took < 6 / 3 + 1.5  # not the 6 s lease
        assert _read_all(b.url, "x") == b"one\ntwo\n"
    finally:
        a.kill()
        b.stop()


def test_standby_needs_a_store(tmp_path: Path) -> None:
    from shared.config import ConfigError, IngesterConfig

    with pytest.raises(ConfigError, match="standby"):
        IngesterConfig(data_dir=tmp_path, standby=True)


def test_a_standby_waits_for_an_owner_on_a_prefix_nobody_owned(tmp_path: Path) -> None:
    """A standby pointed at a prefix no ingester ever owned (a typo, or started before the
    owner) took it over at once and served an empty store; the owner started next was then
    refused (found by QA). It waits, says why, and follows the owner once one starts."""
    store = StoreView.local(tmp_path / "objects")
    b = _node(tmp_path / "b", store, "--durability", "store", "--standby").start()
    a = None
    try:
        time.sleep(LEASE + 1.5)  # (it took over after one look at the record before)
        status, _, body = _req("PUT", f"{b.url}/v1/stream/x", headers=TEXT)
        assert status == 503, (status, body)
        assert "nobody owns" in b.log_path.read_text()
        a = _node(tmp_path / "a", store, "--durability", "store").start()
        assert _req("PUT", f"{a.url}/v1/stream/x", b"a0\n", TEXT)[0] == 201
        a.kill()
        deadline = time.monotonic() + LEASE + 15
        while _req("POST", f"{b.url}/v1/stream/x", b"b0\n", TEXT)[0] != 204:
            assert time.monotonic() < deadline, "the standby never took over from the owner"
            time.sleep(0.1)
        assert _req("GET", f"{b.url}/v1/stream/x?offset=-1")[2] == b"a0\nb0\n"
    finally:
        b.stop()
        if a is not None:
            a.stop()


def test_a_standby_with_a_stale_wal_restores_from_the_store(tmp_path: Path) -> None:
    """A takes writes, dies; B takes over and takes more; A comes back as a standby on its old
    (now stale) data dir; B dies; A takes over again: its old WAL is replaced by the store's
    log, so it serves B's appends too, at the offsets B acknowledged."""
    store = StoreView.local(tmp_path / "objects")
    mode = ("--durability", "store")
    a = _node(tmp_path / "a", store, *mode).start()
    b = _node(tmp_path / "b", store, *mode, "--standby").start()
    a2: Proc | None = None
    try:
        assert _req("PUT", f"{a.url}/v1/stream/x", headers=TEXT)[0] == 201
        for i in range(5):
            assert _req("POST", f"{a.url}/v1/stream/x", b"a-%d\n" % i, TEXT)[0] == 204
        a.kill()
        deadline = time.monotonic() + LEASE + 15
        while _req("POST", f"{b.url}/v1/stream/x", b"b-0\n", TEXT)[0] != 204:
            assert time.monotonic() < deadline, b.log_path.read_text()[-3000:]
            time.sleep(0.05)
        ends = []
        for i in range(1, 5):
            status, headers, _ = _req("POST", f"{b.url}/v1/stream/x", b"b-%d\n" % i, TEXT)
            assert status == 204
            ends.append(headers["Stream-Next-Offset"])
        expected = _read_all(b.url, "x")
        a2 = Proc(args=[*a.args, "--standby"], port=a.port, log_path=a.log_path).start()  # its old data dir
        assert _req("POST", f"{a2.url}/v1/stream/x", b"no\n", TEXT)[0] == 503
        b.kill()
        deadline = time.monotonic() + LEASE + 15
        while _req("HEAD", f"{a2.url}/v1/stream/x")[0] != 200:
            assert time.monotonic() < deadline, a2.log_path.read_text()[-3000:]
            time.sleep(0.05)
        assert _read_all(a2.url, "x") == expected
        assert _req("HEAD", f"{a2.url}/v1/stream/x")[1]["Stream-Next-Offset"] == ends[-1]
        assert _req("POST", f"{a2.url}/v1/stream/x", b"a2\n", TEXT)[0] == 204
        assert _read_all(a2.url, "x") == expected + b"a2\n"
    finally:
        a.kill()
        b.kill()
        if a2 is not None:
            a2.stop()


def test_the_standby_that_loses_the_race_follows_the_winner(tmp_path: Path) -> None:
    """Two standbys: when the owner dies one takes over, and the other goes on following the
    log (now the winner's), so its own takeover later replays only the tail; and it does take
    over when the winner dies too, with every append of both owners."""
    store = StoreView.local(tmp_path / "objects")
    a = _node(tmp_path / "a", store, "--durability", "store").start()
    standbys = [_node(tmp_path / n, store, "--durability", "store", "--standby").start() for n in ("b", "c")]
    try:
        assert _req("PUT", f"{a.url}/v1/stream/x", headers=TEXT)[0] == 201
        lines = [b"a%d\n" % i for i in range(5)]
        for line in lines:
            assert _req("POST", f"{a.url}/v1/stream/x", line, TEXT)[0] == 204
        a.kill()
        deadline = time.monotonic() + LEASE + 15
        winner = None
        while winner is None:
            assert time.monotonic() < deadline, "no standby took over"
            for p in standbys:
                if _req("POST", f"{p.url}/v1/stream/x", b"b0\n", TEXT)[0] == 204:
                    winner = p
                    break
            time.sleep(0.05)
        lines.append(b"b0\n")
        loser = next(p for p in standbys if p is not winner)
        for i in range(1, 5):
            assert _req("POST", f"{winner.url}/v1/stream/x", b"b%d\n" % i, TEXT)[0] == 204
            lines.append(b"b%d\n" % i)
        shipped = metric(metrics(winner), "ds3_log_shipped_seq")
        assert shipped is not None
        deadline = time.monotonic() + 10
        while (followed := metric(metrics(loser), "ds3_standby_followed_seq") or 0) < shipped:
            assert time.monotonic() < deadline, f"the loser follows only to commit {followed} of {shipped}"
            time.sleep(0.1)
        winner.kill()
        deadline = time.monotonic() + LEASE + 15
        while _req("POST", f"{loser.url}/v1/stream/x", b"c0\n", TEXT)[0] != 204:
            assert time.monotonic() < deadline, "the second standby never took over"
            time.sleep(0.05)
        assert _read_all(loser.url, "x") == b"".join(lines) + b"c0\n"
        assert "; followed the log to commit" in loser.log_path.read_text()
    finally:
        for p in (a, *standbys):
            p.kill()
