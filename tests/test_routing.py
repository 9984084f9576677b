"""Routing with real processes (issue 15, item 2): a reader in front of two ingesters that share
one local store and a cluster description naming both (in the store, as `ds3 cluster set`
writes it). Every forwarded request reaches the stream's owner: streams created through the
reader land on their owners (the other ingester answers 421), appends, reads, HEAD, long-poll
and SSE work for streams on both, a bucket's streams all live on the bucket's owner, the
listings span both ingesters, and a new description (a third ingester) is picked up without a
restart: the reader learns it from an ingester's 421 and re-routes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import aiohttp
import pytest

from shared.placement import Cluster
from tests import procs
from tests.procs import metric, metrics, request

TEXT = {"Content-Type": "text/plain"}


@dataclass
class Tier:
    ingesters: dict[str, procs.Proc]  # a, b (in the description), c (started, named later)
    reader: procs.Proc
    store_root: Path
    cluster: Cluster

    def path_on(self, ingester_id: str, prefix: str, cluster: Cluster | None = None) -> str:
        c = cluster or self.cluster
        return next(p for p in (f"{prefix}-{n}" for n in range(1000)) if c.owner(p).id == ingester_id)

    def bucket_on(self, ingester_id: str, prefix: str) -> str:
        return next(b for b in (f"{prefix}-{n}" for n in range(1000)) if self.cluster.bucket_owner(b).id == ingester_id)




@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    root = tmp_path_factory.mktemp("routing")
    store_root = root / "objects"
    ports = {i: procs.free_port() for i in "abc"}
    cluster = procs.write_cluster(store_root, {i: f"http://127.0.0.1:{ports[i]}" for i in "ab"})
    common = ["--store", store_root.as_uri(), "--cluster-refresh", "0.2", "--write-rate", "0",
              "--long-poll-timeout", "2", "--seal-bytes", "4096", "--seal-age", "0.5"]
    ingesters = {i: procs.ingester(root / i, *common, "--ingester-id", i, port=ports[i]) for i in "abc"}
    # The reader re-reads the description only once a minute: it must learn of changes from 421s.
    rdr = procs.reader(root / "reader", ingesters["a"].url, store_root.as_uri(), "--cluster-refresh", "60",
                       "--long-poll-timeout", "2", "--write-rate", "0")
    started: list[procs.Proc] = []
    try:
        for p in (*ingesters.values(), rdr):
            p.start()
            started.append(p)
        yield Tier(ingesters, rdr, store_root, cluster)
    finally:
        for p in reversed(started):
            p.stop()








def wait_for(check, timeout: float = 10.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_streams_land_on_their_owners_and_work_through_the_reader(tier: Tier) -> None:
    for owner, other in (("a", "b"), ("b", "a")):
        path = tier.path_on(owner, "plain")
        url = f"/v1/stream/{path}"
        assert request(tier.reader, "PUT", url, headers=TEXT)[0] == 201
        for word in (b"one ", b"two ", b"three"):
            assert request(tier.reader, "POST", url, word, TEXT)[0] == 204  # the fast lane
        status, headers, body = request(tier.reader, "GET", url + "?offset=-1")
        assert (status, body) == (200, b"one two three")
        head = request(tier.reader, "HEAD", url)
        assert head[0] == 200 and head[1]["stream-next-offset"] == headers["stream-next-offset"]
        # it lives on its owner, and only there
        assert request(tier.ingesters[owner], "GET", url + "?offset=-1")[2] == b"one two three"
        status, refused, _ = request(tier.ingesters[other], "GET", url + "?offset=-1")
        assert status == 421 and refused["ds3-owner-id"] == owner
        assert request(tier.reader, "DELETE", url)[0] == 204
        assert request(tier.ingesters[owner], "HEAD", url)[0] == 404
    m = metrics(tier.reader)
    assert metric(m, "ds3_reader_cluster_generation") == 1
    with urllib.request.urlopen(f"{tier.reader.url}/readyz", timeout=5) as r:
        ready = json.loads(r.read())
    assert ready["cluster"]["generation"] == 1 and [i["id"] for i in ready["cluster"]["ingesters"]] == ["a", "b"]
    for i in "ab":
        url = tier.ingesters[i].url
        assert (metric(m, f'ds3_reader_ingester_requests_per_ingester_total{{ingester_id="{i}",url="{url}"}}') or 0) > 0


def test_long_poll_and_sse_follow_streams_on_both_ingesters(tier: Tier) -> None:
    async def run(owner: str) -> None:
        path = tier.path_on(owner, "live")
        url = f"{tier.reader.url}/v1/stream/{path}"
        async with aiohttp.ClientSession() as s:
            async with s.put(url, headers=TEXT) as r:
                assert r.status == 201
                tail = r.headers["Stream-Next-Offset"]

            async def long_poll() -> bytes:
                async with s.get(url, params={"offset": tail, "live": "long-poll"}) as r:
                    assert r.status == 200, await r.text()
                    return await r.read()

            async def sse() -> str:
                got = ""
                async with s.get(url, params={"offset": tail, "live": "sse"}) as r:
                    assert r.status == 200
                    async for line in r.content:
                        text = line.decode()
                        if text.startswith("data:"):
                            got += text[5:].strip()
                            if "hello" in got:
                                return got
                return got

            lp, ev = asyncio.create_task(long_poll()), asyncio.create_task(sse())
            await asyncio.sleep(0.3)
            async with s.post(url, data=b"hello", headers=TEXT) as r:
                assert r.status == 204
            assert await asyncio.wait_for(lp, 10) == b"hello"
            assert "hello" in await asyncio.wait_for(ev, 10)

    for owner in "ab":
        asyncio.run(run(owner))


def test_a_buckets_streams_all_live_on_the_bucket_owner(tier: Tier) -> None:
    for owner, other in (("a", "b"), ("b", "a")):
        bucket = tier.bucket_on(owner, "bkt")
        assert request(tier.reader, "PUT", f"/v1/buckets/{bucket}")[0] == 201
        names = ["s1", "s2", "s3", "s4", "s5"]
        for n in names:
            url = f"/v1/buckets/{bucket}/{n}"
            assert request(tier.reader, "PUT", url, headers=TEXT)[0] == 201
            assert request(tier.reader, "POST", url, n.encode(), TEXT)[0] == 204
            assert request(tier.reader, "GET", url + "?offset=-1")[2] == n.encode()
            assert request(tier.ingesters[owner], "HEAD", url)[0] == 200
            assert request(tier.ingesters[other], "HEAD", url)[0] == 421
        status, _, body = request(tier.reader, "GET", f"/v1/buckets/{bucket}/streams")
        assert status == 200 and [s["stream_id"] for s in json.loads(body)["streams"]] == names
        assert json.loads(request(tier.reader, "GET", f"/v1/buckets/{bucket}")[2])["streams"] == 5
        assert request(tier.reader, "DELETE", f"/v1/buckets/{bucket}")[0] == 409  # it holds streams


def test_listings_span_every_ingester(tier: Tier) -> None:
    paths = sorted([tier.path_on("a", f"list-{n}") for n in range(3)] + [tier.path_on("b", f"list-{n}") for n in range(3)])
    paths = sorted(set(paths))
    for p in paths:
        assert request(tier.reader, "PUT", f"/v1/stream/{quote(p)}", headers=TEXT)[0] == 201
    status, _, body = request(tier.reader, "GET", "/ds3/streams?prefix=list-")
    page = json.loads(body)
    assert status == 200 and [s["path"] for s in page["streams"]] == paths and page["has_more"] is False
    # paged one at a time, with the cursor each page gives
    seen: list[str] = []
    after = None
    for _ in range(len(paths) + 2):
        q = "/ds3/streams?prefix=list-&limit=2" + (f"&after={quote(after)}" if after else "")
        page = json.loads(request(tier.reader, "GET", q)[2])
        seen += [s["path"] for s in page["streams"]]
        if not page["has_more"]:
            break
        after = page["next_cursor"]
    assert seen == paths
    # buckets too
    buckets = sorted({tier.bucket_on("a", "lb"), tier.bucket_on("b", "lb")})
    for b in buckets:
        assert request(tier.reader, "PUT", f"/v1/buckets/{b}")[0] == 201
    page = json.loads(request(tier.reader, "GET", "/ds3/buckets?prefix=lb-")[2])
    assert [b["bucket_id"] for b in page["buckets"]] == buckets


def test_forks_on_one_ingester_and_across_ingesters(tier: Tier) -> None:
    """A fork and its source on one ingester: as ever. Across ingesters: the fork's owner pins
    the source at its owner (tests/test_cross_forks.py has the rest); a source that does not
    exist is 404 and creates nothing."""
    source = tier.path_on("a", "fsrc")
    assert request(tier.reader, "PUT", f"/v1/stream/{source}", b"abc", TEXT)[0] == 201
    near, far = tier.path_on("a", "fork"), tier.path_on("b", "fork")
    fork = {**TEXT, "Stream-Forked-From": f"/v1/stream/{source}"}
    for path in (near, far):
        assert request(tier.reader, "PUT", f"/v1/stream/{path}", headers=fork)[0] == 201
        assert request(tier.reader, "POST", f"/v1/stream/{path}", b"d", TEXT)[0] == 204
        assert request(tier.reader, "GET", f"/v1/stream/{path}?offset=-1")[2] == b"abcd"
    assert request(tier.ingesters["b"], "HEAD", f"/v1/stream/{far}")[0] == 200  # placed by its own path
    missing, other = tier.path_on("a", "nosuch"), tier.path_on("b", "fork-of-nothing")
    status, _, body = request(tier.reader, "PUT", f"/v1/stream/{other}",
                              headers={**TEXT, "Stream-Forked-From": f"/v1/stream/{missing}"})
    assert status == 404, body
    assert request(tier.ingesters["b"], "HEAD", f"/v1/stream/{other}")[0] == 404  # nothing was created


def test_a_new_description_is_picked_up_without_a_restart(tier: Tier) -> None:
    """The last test of the module: it changes the description (a, b, c)."""
    a, b, c = (tier.ingesters[i] for i in "abc")
    new = procs.write_cluster(tier.store_root, {i: tier.ingesters[i].url for i in "abc"})
    assert new.generation == 2
    for p in (a, b, c):
        wait_for(lambda p=p: metric(metrics(p), "ds3_cluster_generation") == 2, 10, f"{p.url} to read generation 2")
    assert metric(metrics(tier.reader), "ds3_reader_cluster_generation") == 1  # it reads only once a minute
    # an append through the fast lane to a stream c owns now: the old owner answers 421 naming
    # generation 2, the reader re-reads the description and sends it to c (which has no such stream)
    moved = tier.path_on("c", "moved", new)
    status, _, body = request(tier.reader, "POST", f"/v1/stream/{moved}", b"x", TEXT)
    assert status == 404, body
    m = metrics(tier.reader)
    assert metric(m, "ds3_reader_cluster_generation") == 2
    assert (metric(m, "ds3_reader_misdirected_total") or 0) >= 1
    assert (metric(m, "ds3_reader_rerouted_total") or 0) >= 1
    assert request(tier.reader, "PUT", f"/v1/stream/{moved}", headers=TEXT)[0] == 201
    assert request(tier.reader, "POST", f"/v1/stream/{moved}", b"on c", TEXT)[0] == 204
    assert request(c, "GET", f"/v1/stream/{moved}?offset=-1")[2] == b"on c"
    assert request(a, "HEAD", f"/v1/stream/{moved}")[0] == 421
    assert request(tier.reader, "GET", f"/v1/stream/{moved}?offset=-1")[2] == b"on c"


def test_dev_runs_several_ingesters_behind_its_reader(tmp_path: Path) -> None:
    """`ds3 dev --ingesters 2`: two ingesters (i1, i2) with their own WALs, one store, the
    description in DATA_DIR/cluster.json, and the reader routing over them. Started again with
    `--ingesters 3` on the same data dir, every stream reads the same at once (i3's streams
    move to it: the description carries the last run's, with this run's URLs)."""
    import os
    import signal
    import subprocess
    from contextlib import contextmanager

    port = procs.free_port()
    data = tmp_path / "d"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS3_")}

    @contextmanager
    def dev(n: int) -> Iterator[procs.Proc]:
        log = tmp_path / f"dev-{n}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([procs.DS3, "dev", "--ingesters", str(n), "--workers", "1", "--port", str(port),
                                     "--data-dir", str(data)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        try:
            wait_for(lambda: "ds3 dev ready" in log.read_text() or proc.poll() is not None, 40, "ds3 dev to start")
            assert proc.poll() is None, log.read_text()
            yield procs.Proc([], port, log)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)

    with dev(2) as front:
        cluster = Cluster.decode((data / "cluster.json").read_bytes())
        assert cluster.ids == ("i1", "i2") and (data / "i1" / "wal").is_dir() and (data / "i2" / "wal").is_dir()
        owners: dict[str, int] = {}
        for n in range(12):
            url = f"/v1/stream/dev-{n}"
            assert request(front, "PUT", url, headers=TEXT)[0] == 201
            assert request(front, "POST", url, b"x", TEXT)[0] == 204
            assert request(front, "GET", url + "?offset=-1")[2] == b"x"
            owners[cluster.owner(f"dev-{n}").id] = owners.get(cluster.owner(f"dev-{n}").id, 0) + 1
        assert set(owners) == {"i1", "i2"}
        for ing in cluster.ingesters:  # each holds exactly the streams placed on it
            with urllib.request.urlopen(f"{ing.url}/metrics", timeout=5) as r:
                held = metric(r.read().decode(), f'ds3_cluster_streams{{ingester_id="{ing.id}"}}')
            assert held == owners[ing.id]
        m = metrics(front)
        assert metric(m, "ds3_reader_cluster_ingesters") == 2 and metric(m, "ds3_reader_cluster_generation") == 1
    with dev(3) as front:
        three = Cluster.decode((data / "cluster.json").read_bytes())
        assert three.generation == 2 and three.ids == ("i1", "i2", "i3")
        assert three.previous is not None and three.previous.ids == ("i1", "i2")
        assert {i.url for i in three.previous.ingesters} <= {i.url for i in three.ingesters}  # this run's ports
        assert any(three.owner(f"dev-{n}").id == "i3" for n in range(12))
        for n in range(12):
            assert request(front, "GET", f"/v1/stream/dev-{n}?offset=-1")[2] == b"x", n
            assert request(front, "POST", f"/v1/stream/dev-{n}", b"y", TEXT)[0] == 204
    # Back to 2: i3 runs outside the description until it has handed its streams over, then
    # stops, its data dir moved aside. Its streams used to answer 404 (i3 was not started).
    on_i3 = [n for n in range(12) if three.owner(f"dev-{n}").id == "i3"]
    with dev(2) as front:
        for n in range(12):
            got = request(front, "GET", f"/v1/stream/dev-{n}?offset=-1")
            assert got[0] == 200 and got[2] == b"xy", (n, got)
        new = [s for s in (f"new-{k}" for k in range(200)) if three.owner(s).id == "i3"][:3]
        for s in new:  # placed on i3 last time, never held by it
            assert request(front, "PUT", f"/v1/stream/{s}", headers=TEXT)[0] == 201
        wait_for(lambda: (data / "retired" / "i3-g3").is_dir(), 30, "i3 to hand its streams over")
        assert not (data / "i3").exists()
        assert "ingester i3 has handed every stream it held to the others" in front.log_path.read_text()
        # the ingesters share dev's terminal: each line says which one wrote it
        assert re.search(r"INFO \[i[12]\] ds3\.moves moved in '", front.log_path.read_text())
        for n in on_i3:  # after i3 stopped
            assert request(front, "POST", f"/v1/stream/dev-{n}", b"z", TEXT)[0] == 204
            assert request(front, "GET", f"/v1/stream/dev-{n}?offset=-1")[2] == b"xyz"
        for s in [*new, *(f"new2-{k}" for k in range(6))]:
            status = request(front, "PUT", f"/v1/stream/{s}", headers=TEXT)[0]
            assert status in (200, 201) and request(front, "HEAD", f"/v1/stream/{s}")[0] == 200, s
    with dev(2) as front:  # i3 is not started again
        assert "left out" not in front.log_path.read_text()
        for n in range(12):
            assert request(front, "HEAD", f"/v1/stream/dev-{n}")[0] == 200, n


def test_one_frozen_ingester_does_not_make_the_reader_unready(tier: Tier) -> None:
    """The reader is ready while one ingester answers: a frozen one (SIGSTOP: its /healthz
    probe hangs) made every reader's /readyz time out (found by QA), which a load balancer
    would have taken as all of them down."""
    frozen = tier.ingesters["b"]
    assert frozen.popen is not None
    on_a = tier.path_on("a", "frozen-b")
    assert request(tier.reader, "PUT", f"/v1/stream/{on_a}", headers=TEXT)[0] == 201
    os.kill(frozen.popen.pid, signal.SIGSTOP)
    try:
        for _ in range(4):
            status, _, body = request(tier.reader, "GET", "/readyz")
            assert status == 200, body
            time.sleep(0.6)  # (the check is cached for 2 s: each second answer is a new probe)
        assert request(tier.reader, "POST", f"/v1/stream/{on_a}", b"x", TEXT)[0] == 204
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
