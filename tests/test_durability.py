"""The commit log in the store, with real processes (issue 14): SIGKILL the ingester under 16
writers, lose its data dir, start a new one on an empty dir with the same store.

- store durability: every acknowledged append is there, at the offset it was acknowledged at,
  and producer retries after the restart are deduplicated; stream metadata (content type,
  TTL, closure, forks, buckets) is restored. Against the local-directory store and moto.
- local durability: what is lost is only what was acknowledged within the last ship
  intervals (the measured RPO is printed).
- a restart on the same disk after SIGKILL (local seq ahead of the shipped log: a
  checkpoint first), then an empty-disk recovery: still complete.
- store mode, a restart on a disk whose WAL is behind the store's log (a kill between a
  segment's PUT and its LMDB commit): restored from the store, complete; and on a disk whose
  WAL is ahead of a hole in the log (an earlier upload lost, a later one landed): the hole is
  covered first, so a later restore from the store is complete.
- two ingesters on one store: the second refuses to start while the first's lease is live.
- a fenced ingester (its ownership record taken over) answers 503 to writes and uploads no
  further segment.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.objectstore import open_store
from shared.ownership import OwnerRecord
from tests.cluster import StoreView, scrape
from tests.procs import DS3, Proc, free_port, ingester, reader
from tests.s3server import TEST_ENV, MotoS3
from tests.tcpgate import TcpGate

pytestmark = pytest.mark.slow

WRITERS = 16
STREAMS = ["s0", "s1", "s2", "s3"]
POSITION = re.compile(r"\d+_(\d+)")
OWNER = "node-a"
LOCAL_INTERVAL = float(os.environ.get("DS3_TEST_SHIP_INTERVAL", "0.5"))  # local mode's --ship-interval  # the replacement takes the dead one's record over at once (same owner id)



@pytest.fixture
def file_store(tmp_path: Path) -> StoreView:
    return StoreView.local(tmp_path / "objects")


def _ingester(data: Path, store: StoreView, *extra: str, port: int | None = None) -> Proc:
    return ingester(data, *store.server_args(), "--owner-id", OWNER, "--seal-bytes", "4096", "--log-level",
                    "info", *extra, port=port)


def _req(method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None,
         timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    r = urllib.request.Request(url, data=body if method in ("POST", "PUT") else None, method=method,
                               headers=headers or {})
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _read_all(base: str, stream: str) -> bytes:
    out = b""
    offset = "-1"
    while True:
        status, headers, body = _req("GET", f"{base}/v1/stream/{stream}?offset={offset}")
        assert status == 200, (stream, status, body)
        out += body
        nxt = headers["Stream-Next-Offset"]
        if headers.get("Stream-Up-To-Date") == "true" or nxt == offset:
            return out
        offset = nxt


@dataclass
class Writer:
    wid: int
    stream: str
    producer: bool
    acked: list[tuple[bytes, int, float]] = field(default_factory=list)  # (line, end position, ack time)
    inflight: tuple[int, bytes] | None = None  # (seq, line) of the unanswered request

    def line(self, n: int) -> bytes:
        return b"w%02d-%06d\n" % (self.wid, n)

    def headers(self, n: int) -> dict[str, str]:
        h = {"Content-Type": "text/plain"}
        if self.producer:
            h |= {"Producer-Id": f"p{self.wid:02d}", "Producer-Epoch": "0", "Producer-Seq": str(n)}
        return h


def _write(port: int, w: Writer, stop: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    n = 0
    while not stop.is_set():
        line = w.line(n)
        w.inflight = (n, line)
        try:
            conn.request("POST", f"/v1/stream/{w.stream}", body=line, headers=w.headers(n))
            resp = conn.getresponse()
            resp.read()
        except (OSError, http.client.HTTPException):
            return  # killed: the request stays in flight
        if resp.status not in (200, 204):
            return
        pos = POSITION.fullmatch(resp.headers["Stream-Next-Offset"])
        assert pos is not None
        w.acked.append((line, int(pos.group(1)), time.monotonic()))
        w.inflight = None
        n += 1


def _setup_metadata(base: str) -> None:
    """Streams and metadata that must survive: content types, TTL, closure, a fork, a bucket."""
    for s in STREAMS:
        assert _req("PUT", f"{base}/v1/stream/{s}", headers={"Content-Type": "text/plain"})[0] == 201
    assert _req("PUT", f"{base}/v1/stream/ttl", headers={"Content-Type": "application/json",
                                                          "Stream-TTL": "3600"})[0] == 201
    assert _req("POST", f"{base}/v1/stream/ttl", b'{"a":1}', {"Content-Type": "application/json"})[0] in (200, 204)
    assert _req("PUT", f"{base}/v1/stream/closed", headers={"Content-Type": "text/plain"})[0] == 201
    assert _req("POST", f"{base}/v1/stream/closed", b"bye", {"Content-Type": "text/plain",
                                                               "Stream-Closed": "true"})[0] in (200, 204)
    assert _req("PUT", f"{base}/v1/buckets/agents")[0] == 201
    assert _req("PUT", f"{base}/v1/buckets/agents/user-1", headers={"Content-Type": "text/plain"})[0] == 201
    assert _req("POST", f"{base}/v1/buckets/agents/user-1", b"hello", {"Content-Type": "text/plain"})[0] in (200, 204)
    assert _req("PUT", f"{base}/v1/stream/fork", headers={
        "Content-Type": "text/plain", "Stream-Forked-From": "/v1/buckets/agents/user-1"})[0] == 201


def _metadata(base: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for path in ("/v1/stream/ttl", "/v1/stream/closed", "/v1/buckets/agents/user-1", "/v1/stream/fork"):
        status, h, _ = _req("HEAD", base + path)
        out[path] = (status, h.get("Content-Type"), h.get("Stream-Closed"), h.get("Stream-TTL"),
                     h.get("Stream-Next-Offset"), _req("GET", base + path + "?offset=-1")[2])
    status, _, body = _req("GET", f"{base}/v1/buckets/agents")
    bucket = json.loads(body)
    out["bucket"] = (status, bucket.get("bucket_id"), bucket.get("streams"))
    return out


def _load_then_kill(proc: Proc, seconds: float, first_wid: int = 0) -> tuple[list[Writer], float]:
    writers = [Writer(i, STREAMS[i % len(STREAMS)], i % 2 == 1) for i in range(first_wid, first_wid + WRITERS)]
    stop = threading.Event()
    threads = [threading.Thread(target=_write, args=(proc.port, w, stop), daemon=True) for w in writers]
    for t in threads:
        t.start()
    time.sleep(seconds)
    killed_at = time.monotonic()
    proc.kill()
    stop.set()
    for t in threads:
        t.join(15)
    return writers, killed_at


def _check_acked(base: str, writers: list[Writer], before: float = float("inf")) -> tuple[int, int]:
    """Every append acknowledged before `before` is present once, ending at the position it was
    acknowledged at. Returns (acknowledged, lost) over all appends."""
    contents = {s: _read_all(base, s) for s in STREAMS}
    acked = lost = 0
    for w in writers:
        data = contents[w.stream]
        for line, end, at in w.acked:
            acked += 1
            if data.count(line) == 0:
                lost += 1
                assert at >= before, f"{line!r} acknowledged {time.monotonic() - at:.2f}s ago is lost"
                continue
            assert data.count(line) == 1, line
            assert data[end - len(line):end] == line, (line, end)
    return acked, lost


def _retry_producers(base: str, writers: list[Writer]) -> None:
    """A producer's in-flight request retried after the restart is taken once; its last
    acknowledged one, retried, is a duplicate."""
    for w in writers:
        if not w.producer:
            continue
        if w.acked:
            n = len(w.acked) - 1
            status, _, _ = _req("POST", f"{base}/v1/stream/{w.stream}", w.line(n), w.headers(n))
            assert status == 204, (w.wid, n, status)
        if w.inflight is not None:
            n, line = w.inflight
            status, _, body = _req("POST", f"{base}/v1/stream/{w.stream}", line, w.headers(n))
            assert status in (200, 204), (w.wid, status, body)
    for s in STREAMS:
        data = _read_all(base, s)
        for w in writers:
            if w.producer and w.stream == s:
                for line, _, _ in w.acked:
                    assert data.count(line) == 1


def test_store_mode_recovers_every_acknowledged_append(tmp_path: Path, store: StoreView) -> None:
    a = _ingester(tmp_path / "a", store, "--durability", "store").start()
    # A reader in front (sealed chunks from the store, the rest from the ingester at a.url): it
    # serves the same bytes at the same offsets before and after the replacement.
    rd = reader(tmp_path / "reader", a.url, store.url, *(["--s3-endpoint", store.endpoint] if store.endpoint
                                                         else [])).start()
    try:
        try:
            _setup_metadata(a.url)
            for i in range(30):
                for s in STREAMS:
                    _req("POST", f"{a.url}/v1/stream/{s}", b"pre-%03d\n" % i, {"Content-Type": "text/plain"})
            # One writer, one append at a time: each is acknowledged only once a segment holding
            # it landed, so each had a PUT of its own, timed in the segment PUT histogram.
            m = scrape(a.url)
            assert m["ds3_log_segments_uploaded_total"] >= 30 * len(STREAMS)
            assert m["ds3_log_segment_put_seconds_count"] == m["ds3_log_segments_uploaded_total"]
            assert 0 < m["ds3_log_segment_put_seconds_sum"] < 30 * m["ds3_log_segment_put_seconds_count"]
            meta = _metadata(rd.url)
            before = {s: _read_all(rd.url, s) for s in STREAMS}
            writers, _ = _load_then_kill(a, 1.5)
        finally:
            a.kill()
        shutil.rmtree(tmp_path / "a")
        assert sum(len(w.acked) for w in writers) > 50
        assert store.keys("log/"), "no log segment in the store"
        started = time.monotonic()
        b = _ingester(tmp_path / "b", store, "--durability", "store", port=a.port).start()
        try:
            print(f"\nrestart on an empty disk ({len(store.keys('log/'))} segments): {time.monotonic() - started:.2f}s")
            assert "restored the WAL from the store" in b.log_path.read_text()
            assert _metadata(b.url) == meta
            assert _metadata(rd.url) == meta
            for s in STREAMS:
                assert _read_all(rd.url, s).startswith(before[s])
                assert _read_all(rd.url, s) == _read_all(b.url, s)
            acked, lost = _check_acked(rd.url, writers)
            assert lost == 0 and acked > 50
            _retry_producers(rd.url, writers)
            # it carries on: new appends follow
            assert _req("POST", f"{rd.url}/v1/stream/s0", b"after\n", {"Content-Type": "text/plain"})[0] == 204
            assert _read_all(rd.url, "s0").endswith(b"after\n")
        finally:
            b.stop()
    finally:
        rd.stop()


def test_local_mode_loses_at_most_the_ship_interval(tmp_path: Path, file_store: StoreView) -> None:
    interval = LOCAL_INTERVAL
    a = _ingester(tmp_path / "a", file_store, "--durability", "local", "--ship-interval", str(interval)).start()
    try:
        for s in STREAMS:
            _req("PUT", f"{a.url}/v1/stream/{s}", headers={"Content-Type": "text/plain"})
        writers, killed_at = _load_then_kill(a, 2.0)
    finally:
        a.kill()
    shutil.rmtree(tmp_path / "a")
    b = _ingester(tmp_path / "b", file_store).start()
    try:
        acked, lost = _check_acked(b.url, writers, before=killed_at - 2 * interval)
        contents = {s: _read_all(b.url, s) for s in STREAMS}
        newest_lost = max((killed_at - at for w in writers for line, _, at in w.acked
                           if line not in contents[w.stream]), default=0.0)
        print(f"\nlocal mode, ship interval {interval}s: {acked} appends acknowledged, {lost} lost "
              f"(the oldest lost was acknowledged {newest_lost:.3f}s before the kill)")
    finally:
        b.stop()


def test_restart_on_same_disk_then_empty_disk(tmp_path: Path, file_store: StoreView) -> None:
    a = _ingester(tmp_path / "a", file_store, "--durability", "local", "--ship-interval", "5").start()
    try:
        for s in STREAMS:
            _req("PUT", f"{a.url}/v1/stream/{s}", headers={"Content-Type": "text/plain"})
        first, _ = _load_then_kill(a, 1.0)  # commits shipped nowhere yet (5 s interval)
    finally:
        a.kill()
    a2 = _ingester(tmp_path / "a", file_store, "--durability", "store").start()  # same disk
    try:
        assert "checkpointing first" in a2.log_path.read_text()
        second, _ = _load_then_kill(a2, 1.0, first_wid=WRITERS)
    finally:
        a2.kill()
    shutil.rmtree(tmp_path / "a")
    b = _ingester(tmp_path / "b", file_store).start()
    try:
        _, lost = _check_acked(b.url, first + second)
        assert lost == 0
    finally:
        b.stop()


def test_store_mode_restart_with_a_wal_behind_the_log_restores_it(tmp_path: Path, file_store: StoreView) -> None:
    """In store mode a segment's PUT starts before its LMDB commit, so a kill between the two
    leaves the log ahead of the WAL; a restart on that disk restores from the store (before:
    it refused to start). Made certain here with a copy of the data dir from an earlier kill."""
    a = _ingester(tmp_path / "a", file_store, "--durability", "store").start()
    try:
        for s in STREAMS:
            _req("PUT", f"{a.url}/v1/stream/{s}", headers={"Content-Type": "text/plain"})
        first, _ = _load_then_kill(a, 1.0)
    finally:
        a.kill()
    shutil.copytree(tmp_path / "a", tmp_path / "old")
    a2 = _ingester(tmp_path / "a", file_store, "--durability", "store").start()  # same disk: carries on
    try:
        second, _ = _load_then_kill(a2, 1.0, first_wid=WRITERS)
    finally:
        a2.kill()
    b = _ingester(tmp_path / "old", file_store, "--durability", "store").start()  # its WAL: before `second`
    try:
        assert "restoring the WAL from the store" in b.log_path.read_text()
        acked, lost = _check_acked(b.url, first + second)
        assert lost == 0 and acked > 50
        assert _req("POST", f"{b.url}/v1/stream/s0", b"after\n", {"Content-Type": "text/plain"})[0] == 204
        assert _read_all(b.url, "s0").endswith(b"after\n")
    finally:
        b.stop()


def test_a_hole_in_the_stores_log_is_covered_before_the_log_goes_on(tmp_path: Path, file_store: StoreView) -> None:
    """Store mode uploads a few segments at a time: a SIGKILL while an earlier upload is in
    flight and a later one landed leaves a hole in the store's log (the commit is in the WAL,
    never acknowledged). A restart on that disk must cover the hole (a checkpoint) before it
    ships on: before, it carried on past it, and no restore could ever get beyond the hole
    again (a standby or a lost disk lost everything acknowledged since). The hole is made by
    deleting the segment after a SIGKILL."""
    objects = tmp_path / "objects"
    a = _ingester(tmp_path / "a", file_store, "--durability", "store").start()
    try:
        _req("PUT", f"{a.url}/v1/stream/s0", headers={"Content-Type": "text/plain"})
        for n in range(20):
            assert _req("POST", f"{a.url}/v1/stream/s0", b"one-%02d\n" % n, {"Content-Type": "text/plain"})[0] == 204
    finally:
        a.kill()
    segments = sorted((objects / "log").iterdir())
    checkpoints = sorted((objects / "checkpoint").iterdir())
    assert len(segments) >= 10 and checkpoints
    hole = segments[-3]  # (after the checkpoint: one a restore needs)
    hole.unlink()
    a2 = _ingester(tmp_path / "a", file_store, "--durability", "store").start()  # same disk
    try:
        for n in range(10):
            assert _req("POST", f"{a2.url}/v1/stream/s0", b"two-%02d\n" % n, {"Content-Type": "text/plain"})[0] == 204
    finally:
        a2.kill()
    b = _ingester(tmp_path / "b", file_store, "--durability", "store").start()  # a lost disk: from the store
    try:
        want = b"".join(b"one-%02d\n" % n for n in range(20)) + b"".join(b"two-%02d\n" % n for n in range(10))
        assert _read_all(b.url, "s0") == want
    finally:
        b.stop()
    assert "past a hole in the store's log" in a2.log_path.read_text()


def test_a_start_refused_by_the_store_says_why_and_leaves_nothing_open(tmp_path: Path, s3_server: MotoS3) -> None:
    # a bucket that does not exist: one clear line, no "Unclosed client session" after it
    out = subprocess.run([DS3, "ingester", "--host", "127.0.0.1", "--port", str(free_port()), "--data-dir",
                          str(tmp_path / "d"), "--store", "s3://no-such-bucket/p", "--s3-endpoint", s3_server.endpoint],
                         capture_output=True, timeout=60, env=os.environ | TEST_ENV)
    assert out.returncode != 0
    assert b"bucket 'no-such-bucket' does not exist" in out.stderr, out.stderr
    assert b"Unclosed" not in out.stderr and b"Traceback" not in out.stderr, out.stderr


def test_second_ingester_refuses_while_the_lease_is_live(tmp_path: Path, file_store: StoreView) -> None:
    a = ingester(tmp_path / "a", *file_store.server_args()).start()
    try:
        port = free_port()
        out = subprocess.run([DS3, "ingester", "--host", "127.0.0.1", "--port", str(port), "--data-dir",
                              str(tmp_path / "b"), *file_store.server_args()], capture_output=True, timeout=30)
        assert out.returncode != 0
        assert b"not starting: store prefix is owned by" in out.stderr, out.stderr
        assert _req("PUT", f"{a.url}/v1/stream/x", headers={"Content-Type": "text/plain"})[0] == 201
    finally:
        a.stop()
    # released on a clean shutdown: the next one starts at once, with the stream
    b = ingester(tmp_path / "b", *file_store.server_args()).start()
    try:
        assert _req("HEAD", f"{b.url}/v1/stream/x")[0] == 200
    finally:
        b.stop()


def test_fenced_ingester_answers_503_and_ships_nothing(tmp_path: Path, file_store: StoreView) -> None:
    a = _ingester(tmp_path / "a", file_store, "--durability", "store", "--lease-seconds", "3").start()
    try:
        assert _req("PUT", f"{a.url}/v1/stream/x", headers={"Content-Type": "text/plain"})[0] == 201
        assert _req("POST", f"{a.url}/v1/stream/x", b"one", {"Content-Type": "text/plain"})[0] == 204

        async def take_over() -> None:
            objects = open_store(file_store.url)
            data, etag = await objects.get_with_etag("_ds3/owner.json")
            old = OwnerRecord.decode(data)
            now = time.time()
            new = OwnerRecord(old.epoch + 1, "thief", "http://thief", now + 60, now)
            await objects.put("_ds3/owner.json", new.encode(), if_match=etag)
            await objects.close()

        asyncio.run(take_over())
        deadline = time.monotonic() + 5
        status = 204
        while time.monotonic() < deadline:  # the next renewal (every lease/3) finds it taken
            status, headers, _ = _req("POST", f"{a.url}/v1/stream/x", b"more", {"Content-Type": "text/plain"})
            if status == 503:
                break
            time.sleep(0.1)
        assert status == 503 and "Retry-After" in headers
        segments = file_store.keys("log/")
        # every write answers 503 now, on the fast lane (keep-alive) and aiohttp's path alike
        conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=5)
        for _ in range(3):
            conn.request("POST", "/v1/stream/x", body=b"again", headers={"Content-Type": "text/plain"})
            r = conn.getresponse()
            r.read()
            assert r.status == 503
        assert _req("PUT", f"{a.url}/v1/stream/y", headers={"Content-Type": "text/plain"})[0] == 503
        time.sleep(0.5)
        assert file_store.keys("log/") == segments  # nothing uploaded once fenced
    finally:
        a.kill()


def test_a_store_outage_longer_than_the_lease_pauses_then_resumes(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    """The lease lapses while the store is unreachable: writes answer 503 (the prefix may be
    someone else's by now); once the store answers and the record is still ours, the ingester
    takes it back (a new epoch, a checkpoint of what the log missed) and acknowledges again.
    Nothing acknowledged is missing after an empty-disk recovery."""
    store, gate = gated_s3
    a = ingester(tmp_path / "a", *store.server_args(endpoint=gate.url), "--owner-id", OWNER, "--lease-seconds",
                 "2", "--ship-interval", "0.2", "--log-level", "info").start()
    acked: list[bytes] = []

    def append(i: int) -> int:
        line = b"line-%04d\n" % i
        status = _req("POST", f"{a.url}/v1/stream/x", line, {"Content-Type": "text/plain"}, timeout=20)[0]
        if status == 204:
            acked.append(line)
        return status

    try:
        assert _req("PUT", f"{a.url}/v1/stream/x", headers={"Content-Type": "text/plain"})[0] == 201
        i = 0
        assert append(i) == 204
        gate.down()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            i += 1
            if append(i) == 503:
                break
            time.sleep(0.05)
        else:
            pytest.fail("still acknowledging with the store down and the lease lapsed")
        gate.up()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            i += 1
            if append(i) == 204:
                break
            time.sleep(0.2)
        else:
            pytest.fail("never acknowledged again once the store came back:\n" + a.log_path.read_text()[-3000:])
        assert "taken back" in a.log_path.read_text()
        for _ in range(5):
            i += 1
            assert append(i) == 204
        time.sleep(1.0)  # shipped (local mode, 0.2 s interval)
    finally:
        a.kill()
    b = ingester(tmp_path / "b", *store.server_args(), "--owner-id", OWNER).start()
    try:
        data = _read_all(b.url, "x")
        assert all(data.count(line) == 1 for line in acked), (acked, data)
    finally:
        b.stop()
