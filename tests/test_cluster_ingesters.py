"""Placement with real processes (issue 15): two ingesters share one local store and a
cluster description naming both (in the store, written like `ds3 cluster set` does). Each
serves the streams placed on it and refuses the other's with 421 naming the owner, on every
method, the extensions, forks, buckets and the fast lane; /readyz and /metrics say who it is.
Also the settings' validation and the `ds3 cluster` command."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds3.cli import main
from shared.cluster import read_cluster
from shared.config import ConfigError, IngesterConfig
from shared.objectstore import LocalStore
from shared.placement import Cluster
from tests import procs
from tests.procs import metric, metrics, request
from tests.rawhttp import exchange


@dataclass
class Pair:
    a: procs.Proc
    b: procs.Proc
    store_root: Path
    cluster: Cluster

    def of(self, ingester_id: str) -> procs.Proc:
        return self.a if ingester_id == "a" else self.b

    def path_on(self, ingester_id: str, prefix: str) -> str:
        """A fresh plain stream path this cluster places on `ingester_id`."""
        return next(p for p in (f"{prefix}-{n}" for n in range(1000)) if self.cluster.owner(p).id == ingester_id)

    def bucket_on(self, ingester_id: str, prefix: str) -> str:
        return next(b for b in (f"{prefix}-{n}" for n in range(1000)) if self.cluster.bucket_owner(b).id == ingester_id)




@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("cluster")
    store_root = root / "objects"
    pa, pb = procs.free_port(), procs.free_port()
    cluster = procs.write_cluster(store_root, {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"})
    common = ["--store", store_root.as_uri(), "--cluster-refresh", "0.2", "--write-rate", "0"]
    a = procs.ingester(root / "a", *common, "--ingester-id", "a", port=pa)
    b = procs.ingester(root / "b", *common, "--ingester-id", "b", port=pb)
    a.start()
    try:
        b.start()
        try:
            yield Pair(a, b, store_root, cluster)
        finally:
            b.stop()
    finally:
        a.stop()








def readyz(p: procs.Proc) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{p.url}/readyz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_misdirected(status: int, headers: dict[str, str], body: bytes, owner: procs.Proc, owner_id: str,
                       head: bool = False) -> None:
    assert status == 421, (status, body)
    assert headers["ds3-owner"] == owner.url
    assert headers["ds3-owner-id"] == owner_id
    assert headers["ds3-cluster-generation"] == "1"
    assert headers["cache-control"] == "no-store"
    if not head:
        assert f"belongs to ingester {owner_id} at {owner.url}".encode() in body, body


def test_owner_serves_and_the_other_refuses_every_method(pair: Pair) -> None:
    path = pair.path_on("a", "plain")
    url = f"/v1/stream/{path}"
    a, b = pair.a, pair.b
    text = {"Content-Type": "text/plain"}
    # the non-owner refuses before anything happens, whatever the method
    assert_misdirected(*request(b, "PUT", url, headers=text), owner=a, owner_id="a")
    assert request(a, "PUT", url, headers=text)[0] == 201
    assert request(a, "POST", url, b"hello", text)[0] == 204
    for method, extra in [("POST", b"x"), ("GET", b""), ("DELETE", b"")]:
        assert_misdirected(*request(b, method, url, extra, text), owner=a, owner_id="a")
    assert_misdirected(*request(b, "HEAD", url), owner=a, owner_id="a", head=True)
    for query in ("?offset=-1", "?offset=now&live=long-poll", "?offset=-1&live=sse"):
        assert_misdirected(*request(b, "GET", url + query), owner=a, owner_id="a")
    # extensions: snapshot, bootstrap; and the internal endpoints readers use
    for method, ext in [("GET", "/snapshot"), ("GET", "/bootstrap"), ("PUT", "/snapshot/0000000000000000_0000000000000005")]:
        assert_misdirected(*request(b, method, url + ext), owner=a, owner_id="a")
    assert_misdirected(*request(b, "POST", f"/_ds3/touch?path={path}"), owner=a, owner_id="a")
    assert_misdirected(*request(b, "GET", f"/_ds3/parts?path={path}&from=0_0&until=0_0&boundary=ds3-x"),
                       owner=a, owner_id="a")
    # a fork is placed by its own path: B refuses a fork of A's stream that A owns ...
    fork_on_a = pair.path_on("a", "fork")
    assert_misdirected(*request(b, "PUT", f"/v1/stream/{fork_on_a}", headers={"Stream-Forked-From": url}),
                       owner=a, owner_id="a")
    assert request(a, "PUT", f"/v1/stream/{fork_on_a}", headers={"Stream-Forked-From": url})[0] == 201
    # the owner still has exactly what it acknowledged, and serves every method
    status, _, body = request(a, "GET", url + "?offset=-1")
    assert status == 200 and body == b"hello"
    assert request(a, "HEAD", url)[0] == 200
    assert request(a, "GET", f"/v1/stream/{fork_on_a}?offset=-1")[2] == b"hello"
    assert request(a, "DELETE", f"/v1/stream/{fork_on_a}")[0] == 204
    assert request(a, "DELETE", url)[0] == 204
    # and B never created it: it holds no such stream
    status, _, _ = request(b, "GET", f"/v1/stream/{pair.path_on('b', 'probe')}")
    assert status == 404


def test_fast_lane_appends_are_refused_too(pair: Pair) -> None:
    a, b = pair.a, pair.b
    path = pair.path_on("a", "lane")
    assert request(a, "PUT", f"/v1/stream/{path}", headers={"Content-Type": "text/plain"})[0] == 201
    served = metric(metrics(b), "ds3_http_fast_lane_appends_total")
    post = (f"POST /v1/stream/{path} HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
            "Content-Length: 3\r\n\r\nabc").encode()
    [answer] = exchange(b.port, post)
    after = metrics(b)
    # the lane leaves an append it may not own to aiohttp's path, which re-reads the description
    # before refusing (a router may follow a newer one already: docs/architecture.md "Moves")
    assert metric(after, "ds3_http_fast_lane_appends_total") == (served or 0)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 421 Misdirected Request\r\n"), answer
    assert f"DS3-Owner: {a.url}\r\n".encode() in head and b"DS3-Owner-Id: a\r\n" in head
    assert f"belongs to ingester a at {a.url}".encode() in body
    # the same answer as aiohttp's (a query keeps the request off the lane)
    status, headers, slow_body = request(b, "POST", f"/v1/stream/{path}?x", b"abc", {"Content-Type": "text/plain"})
    assert status == 421 and slow_body == body and headers["ds3-owner"] == a.url
    # nothing was appended anywhere
    assert request(a, "GET", f"/v1/stream/{path}?offset=-1")[2] == b""
    # the owner's lane takes it
    [ok] = exchange(a.port, post)
    assert ok.startswith(b"HTTP/1.1 204"), ok


def test_buckets_live_with_their_streams(pair: Pair) -> None:
    a, b = pair.a, pair.b
    bucket = pair.bucket_on("b", "tenant")
    assert_misdirected(*request(a, "PUT", f"/v1/buckets/{bucket}"), owner=b, owner_id="b")
    assert request(b, "PUT", f"/v1/buckets/{bucket}")[0] == 201
    for stream_id in ("s1", "s2", "s3"):  # every stream of the bucket is B's, whatever its id
        assert_misdirected(*request(a, "PUT", f"/v1/buckets/{bucket}/{stream_id}"), owner=b, owner_id="b")
        assert request(b, "PUT", f"/v1/buckets/{bucket}/{stream_id}", headers={"Content-Type": "text/plain"})[0] == 201
    assert_misdirected(*request(a, "GET", f"/v1/buckets/{bucket}/streams"), owner=b, owner_id="b")
    listing = json.loads(request(b, "GET", f"/v1/buckets/{bucket}/streams")[2])
    assert [s["stream_id"] for s in listing["streams"]] == ["s1", "s2", "s3"]
    assert_misdirected(*request(a, "DELETE", f"/v1/buckets/{bucket}"), owner=b, owner_id="b")
    assert request(b, "DELETE", f"/v1/buckets/{bucket}")[0] == 409  # not empty


def test_each_member_keeps_its_log_and_ownership_record_in_its_own_namespace(pair: Pair) -> None:
    """Members share the store, not their commit logs: each logs (and owns) under
    _ds3/ingesters/<id>/, so both run (one ownership record at the root would let only one start)
    and their segments, numbered by their own commits, never collide."""
    for p, ident in ((pair.a, "a"), (pair.b, "b")):
        path = next(f"/v1/stream/ns-{ident}-{i}" for i in range(1000)
                    if pair.cluster.owner(f"ns-{ident}-{i}").id == ident)
        assert request(p, "PUT", path, headers={"Content-Type": "text/plain"})[0] == 201
        assert request(p, "POST", path, b"x", headers={"Content-Type": "text/plain"})[0] == 204
    deadline = time.monotonic() + 10
    root = pair.store_root
    while time.monotonic() < deadline and not all(list((root / "_ds3/ingesters" / i / "log").glob("*.seg"))
                                                  for i in "ab"):
        time.sleep(0.1)
    for ident in "ab":
        assert list((root / "_ds3/ingesters" / ident / "log").glob("*.seg")), f"no segments of {ident}"
        assert (root / "_ds3/ingesters" / ident / "_ds3/owner.json").exists()
    assert not (root / "log").exists() and not (root / "_ds3/owner.json").exists()


def test_the_same_ingester_id_or_data_dir_twice_is_refused_by_its_name(pair: Pair, tmp_path: Path) -> None:
    """A second process with a running member's --ingester-id finds that id's lease live: it says
    which id and where it runs (it used to speak of the store prefix's owner record only)."""
    out = subprocess.run([procs.DS3, "ingester", "--host", "127.0.0.1", "--port", str(procs.free_port()),
                          "--data-dir", str(tmp_path / "again"), "--store", pair.store_root.as_uri(),
                          "--ingester-id", "a"], capture_output=True, timeout=60, text=True)
    assert out.returncode != 0
    assert f"ingester id 'a' is already running at {pair.a.url}" in out.stderr, out.stderr
    assert "needs an --ingester-id of its own" in out.stderr
    # The same id with the same data dir (so the same owner id) took the ownership over and
    # opened the running one's WAL too, and a answered 503 from then on (found by QA).
    data_dir = pair.a.args[pair.a.args.index("--data-dir") + 1]
    out = subprocess.run([procs.DS3, "ingester", "--host", "127.0.0.1", "--port", str(procs.free_port()),
                          "--data-dir", data_dir, "--store", pair.store_root.as_uri(), "--ingester-id", "a"],
                         capture_output=True, timeout=60, text=True)
    assert out.returncode != 0
    assert f"another ds3 ingester (process {pair.a.popen.pid if pair.a.popen else '?'}) is running" in out.stderr, \
        out.stderr
    path = next(f"/v1/stream/dup-{n}" for n in range(1000) if pair.cluster.owner(f"dup-{n}").id == "a")
    assert request(pair.a, "PUT", path, headers={"Content-Type": "text/plain"})[0] == 201  # a goes on


def test_readyz_and_metrics_say_who_holds_what(pair: Pair) -> None:
    a, b = pair.a, pair.b
    for n in range(3):
        path = pair.path_on("b", f"count{n}")
        assert request(b, "PUT", f"/v1/stream/{path}", headers={"Content-Type": "text/plain"})[0] == 201
    for p, me in ((a, "a"), (b, "b")):
        status, body = readyz(p)
        assert status == 200, body
        cluster = body["cluster"]
        assert isinstance(cluster, dict)
        assert cluster["ingester_id"] == me and cluster["url"] == p.url and cluster["generation"] == 1
        assert [i["id"] for i in cluster["ingesters"]] == ["a", "b"]
        assert isinstance(cluster["streams"], int)
        assert body["checks"]["cluster"] == "ok"  # type: ignore[index]
        text = metrics(p)
        assert metric(text, "ds3_cluster_generation") == 1
        assert metric(text, "ds3_cluster_ingesters") == 2
        assert metric(text, f'ds3_cluster_member{{ingester_id="{me}",url="{p.url}"}}') == 1
        assert metric(text, f'ds3_cluster_streams{{ingester_id="{me}"}}') == cluster["streams"]
        assert (metric(text, "ds3_cluster_misdirected_total") or 0) > 0
    assert readyz(b)[1]["cluster"]["streams"] >= 3  # type: ignore[index]


def test_a_new_description_reaches_running_ingesters(tmp_path: Path) -> None:
    """Generation 2 drops B: within the refresh interval A owns everything (B's stream moves to
    it), and B owns nothing (421 naming A, /readyz 503 saying why)."""
    store_root = tmp_path / "objects"
    pa, pb = procs.free_port(), procs.free_port()
    ab = {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"}
    first = procs.write_cluster(store_root, ab)
    common = ["--store", store_root.as_uri(), "--cluster-refresh", "0.2"]
    a = procs.ingester(tmp_path / "a", *common, "--ingester-id", "a", port=pa).start()
    try:
        b = procs.ingester(tmp_path / "b", *common, "--ingester-id", "b", port=pb).start()
        try:
            pair = Pair(a, b, store_root, first)
            path = pair.path_on("b", "moving")
            assert request(b, "PUT", f"/v1/stream/{path}")[0] == 201
            assert request(a, "PUT", f"/v1/stream/{path}")[0] == 421
            procs.write_cluster(store_root, {"a": ab["a"]})
            deadline = time.monotonic() + 10
            while request(b, "HEAD", f"/v1/stream/{path}")[0] != 421:
                assert time.monotonic() < deadline, "B never read generation 2"
                time.sleep(0.1)
            status, headers, _ = request(b, "GET", f"/v1/stream/{path}")
            assert status == 421 and headers["ds3-owner-id"] == "a" and headers["ds3-cluster-generation"] == "2"
            status, body = readyz(b)
            assert status == 503 and "not in the cluster description (generation 2: a)" in body["checks"]["cluster"]  # type: ignore[index]
            while readyz(a)[1]["cluster"]["generation"] != 2:  # type: ignore[index]
                assert time.monotonic() < deadline, "A never read generation 2"
                time.sleep(0.1)
            # A's now, and B's stream moved in with it: the PUT finds it (200), it creates nothing
            assert request(a, "PUT", f"/v1/stream/{path}")[0] == 200
        finally:
            b.stop()
    finally:
        a.stop()


def test_without_a_description_stream_requests_wait(tmp_path: Path) -> None:
    """--ingester-id with a store that holds no description yet: 503 (never serve a stream
    it may not own), not ready; the first description written is picked up."""
    store_root = tmp_path / "objects"
    port = procs.free_port()
    a = procs.ingester(tmp_path / "a", "--store", store_root.as_uri(), "--ingester-id", "a",
                       "--cluster-refresh", "0.2", port=port).start()
    try:
        status, headers, body = request(a, "PUT", "/v1/stream/x")
        assert status == 503 and "has not read the cluster description yet" in body.decode()
        assert "retry-after" in headers
        assert readyz(a)[0] == 503
        procs.write_cluster(store_root, {"a": a.url})
        deadline = time.monotonic() + 10
        while readyz(a)[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert request(a, "PUT", "/v1/stream/x")[0] == 201
    finally:
        a.stop()


def test_a_cluster_file(tmp_path: Path) -> None:
    """`--cluster FILE` (ds3 dev, tests): a single-ingester description owns every stream."""
    port = procs.free_port()
    f = tmp_path / "cluster.json"
    f.write_bytes(Cluster.of({"solo": f"http://127.0.0.1:{port}"}).encode())
    a = procs.ingester(tmp_path / "a", "--cluster", str(f), "--ingester-id", "solo", port=port).start()
    try:
        for n in range(20):
            assert request(a, "PUT", f"/v1/stream/s{n}")[0] == 201
        assert request(a, "PUT", "/v1/buckets/tenant-1")[0] == 201
        assert readyz(a)[1]["cluster"]["generation"] == 1  # type: ignore[index]
    finally:
        a.stop()


def _config(tmp_path: Path, **kw: object) -> IngesterConfig:
    return IngesterConfig(data_dir=tmp_path, **kw)  # type: ignore[arg-type]


def test_settings_are_validated(tmp_path: Path) -> None:
    f = tmp_path / "cluster.json"
    f.write_bytes(Cluster.of({"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}).encode())
    store = (tmp_path / "objects").as_uri()
    assert _config(tmp_path).ingester_id is None  # no cluster: as before
    assert _config(tmp_path, ingester_id="a", store=store).ingester_id == "a"
    assert _config(tmp_path, ingester_id="b", cluster=f).cluster == f
    cases: list[tuple[dict[str, object], str]] = [
        (dict(cluster=f), "cluster (DS3_CLUSTER): needs ingester-id (DS3_INGESTER_ID)"),
        (dict(ingester_id="a"), "ingester-id (DS3_INGESTER_ID): the cluster description is read from the store"),
        (dict(ingester_id="a b", store=store), "ingester-id (DS3_INGESTER_ID): ingester id 'a b' is invalid"),
        (dict(ingester_id="c", cluster=f), "ingester-id (DS3_INGESTER_ID): 'c' is not in the cluster file"),
        (dict(ingester_id="a", cluster=tmp_path / "missing.json"), "cluster (DS3_CLUSTER): cluster file"),
        (dict(ingester_id="a", store=store, cluster_refresh=0), "cluster-refresh (DS3_CLUSTER_REFRESH)"),
    ]
    for kw, message in cases:
        with pytest.raises(ConfigError) as e:
            _config(tmp_path, **kw)
        assert message in str(e.value), (kw, e.value)
    bad = tmp_path / "bad.json"
    bad.write_text('{"generation": 1, "ingesters": [{"id": "a", "url": "ftp://x"}]}')
    with pytest.raises(ConfigError, match="must start with http:// or https://"):
        _config(tmp_path, ingester_id="a", cluster=bad)


def test_cluster_show_on_a_dev_store_points_at_devs_file(tmp_path: Path) -> None:
    """Found by QA: on `ds3 dev --ingesters N`'s store, show said to write a description with
    `cluster set`, where dev keeps one in DATA_DIR/cluster.json."""
    (tmp_path / "objects").mkdir()
    procs.write_cluster(tmp_path / "elsewhere", {"i1": "http://127.0.0.1:1"})
    (tmp_path / "cluster.json").write_bytes((tmp_path / "elsewhere" / "_ds3" / "cluster.json").read_bytes())
    r = CliRunner().invoke(main, ["cluster", "show", "--store", (tmp_path / "objects").as_uri()])
    assert r.exit_code == 1 and f"give --file {tmp_path / 'cluster.json'}" in r.output, r.output


def test_cluster_command(tmp_path: Path) -> None:
    store = (tmp_path / "objects").as_uri()
    run = CliRunner().invoke
    # a local store that is not there: refused by show (a typo read as "no description"), made by set
    r = run(main, ["cluster", "show", "--store", store])
    assert r.exit_code == 1 and f"the local store {tmp_path / 'objects'} does not exist" in r.output, r.output
    assert not (tmp_path / "objects").exists()
    r = run(main, ["cluster", "set", "--store", store, "--ingester", "a=http://127.0.0.1:1",
                   "--ingester", "b=http://127.0.0.1:2/"])
    assert r.exit_code == 0, r.output
    assert "does not exist: creating it" in r.stderr
    assert json.loads(r.stdout)["generation"] == 1
    # nothing listens there: said on stderr (the description is written all the same)
    for i, port in (("a", 1), ("b", 2)):
        assert f"warning: ingester {i} at http://127.0.0.1:{port} does not answer" in r.stderr, r.stderr
    r = run(main, ["cluster", "show", "--store", store])
    shown = json.loads(r.output)
    assert shown["ingesters"] == [{"id": "a", "url": "http://127.0.0.1:1"}, {"id": "b", "url": "http://127.0.0.1:2"}]
    assert shown["etag"]
    r = run(main, ["cluster", "set", "--store", store, "--ingester", "a=http://127.0.0.1:1", "--if-generation", "0"])
    assert r.exit_code == 1 and "at generation 1, not 0" in r.output
    r = run(main, ["cluster", "set", "--store", store, "--ingester", "a=http://127.0.0.1:1", "--if-generation", "-1"])
    assert r.exit_code == 2 and "-1 is not in the range x>=0" in r.output  # (was taken, then "not -1")
    r = run(main, ["cluster", "set", "--store", store, "--ingester", "a=http://127.0.0.1:1", "--if-generation", "1"])
    assert r.exit_code == 0 and json.loads(r.stdout)["generation"] == 2
    assert "ingester b (http://127.0.0.1:2) is removed: keep it running until it has handed its streams over" in r.stderr
    assert "retired_at 2" in r.stderr
    r = run(main, ["cluster", "set", "--store", store, "--ingester", "a=http://127.0.0.1:1"])  # the same list
    assert r.exit_code == 0 and json.loads(r.stdout)["generation"] == 2
    assert "unchanged: generation 2 lists these ingesters already; nothing was written" in r.stderr
    assert "is removed" not in r.stderr  # (not said again)
    r = run(main, ["cluster", "owner", "--store", store, "/v1/stream/x", "/v1/buckets/tenant-1",
                   "/v1/buckets/tenant-1/s%20s"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == ["/v1/stream/x a http://127.0.0.1:1", "/v1/buckets/tenant-1 a http://127.0.0.1:1",
                                     "/v1/buckets/tenant-1/s%20s a http://127.0.0.1:1"]
    r = run(main, ["cluster", "owner", "--store", store, "/v1/nope"])
    assert r.exit_code == 2 and "not a stream URL" in r.output
    # a description file (the servers' --cluster, `ds3 dev --ingesters N`'s DATA_DIR/cluster.json)
    described = tmp_path / "cluster.json"
    described.write_text('{"generation": 3, "ingesters": [{"id": "i1", "url": "http://127.0.0.1:7"}]}')
    r = run(main, ["cluster", "owner", "--file", str(described), "/v1/stream/x"])
    assert r.exit_code == 0 and r.output.splitlines() == ["/v1/stream/x i1 http://127.0.0.1:7"], r.output
    r = run(main, ["cluster", "show", "--file", str(described)])
    assert r.exit_code == 0 and json.loads(r.output)["generation"] == 3 and "etag" not in json.loads(r.output)
    r = run(main, ["cluster", "show", "--file", str(tmp_path / "missing.json")])
    assert r.exit_code == 1 and "missing.json" in r.output, r.output
    r = run(main, ["cluster", "show", "--file", str(described), "--store", store])
    assert r.exit_code == 2 and "not both" in r.output, r.output
    r = run(main, ["cluster", "owner", "/v1/stream/x"], env={"DS3_STORE": ""})
    assert r.exit_code == 2 and "--store" in r.output and "--file" in r.output, r.output
    for bad, message in [(["--ingester", "a"], "write it as id=url"),
                         (["--ingester", "a=http://h:1", "--ingester", "a=http://h:2"], "appears more than once")]:
        r = run(main, ["cluster", "set", "--store", store, *bad])
        assert r.exit_code == 2 and message in r.output, r.output

    async def stored() -> Cluster | None:
        s = LocalStore(tmp_path / "objects")
        try:
            found = await read_cluster(s)
            return None if found is None else found.cluster
        finally:
            await s.close()

    # generation 2 carries generation 1 (where moved streams' previous owners are found)
    first = Cluster.of({"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}, 1)
    assert asyncio.run(stored()) == Cluster.of({"a": "http://127.0.0.1:1"}, 2, previous=first)


def test_swapped_urls_are_named_as_such(pair: Pair, tmp_path: Path) -> None:
    """Two members' URLs swapped in the description: `cluster set` said nothing, both ingesters
    were ready, and through a reader every request answered 503 "the description is changing;
    retry" (found by QA). `cluster set` now says which URL answers as which member, and the
    reader says the description's URLs are wrong."""
    swapped = ["--ingester", f"a={pair.b.url}", "--ingester", f"b={pair.a.url}"]
    r = CliRunner().invoke(main, ["cluster", "set", "--store", (tmp_path / "other").as_uri(), *swapped])
    assert r.exit_code == 0, r.output
    assert f"warning: {pair.b.url} answers as ingester b, not a: the URLs are swapped" in r.stderr, r.stderr
    assert f"warning: {pair.a.url} answers as ingester a, not b" in r.stderr
    (tmp_path / "right").mkdir()  # (a store that exists: no warning about it either)
    right = CliRunner().invoke(main, ["cluster", "set", "--store", (tmp_path / "right").as_uri(),
                                      "--ingester", f"a={pair.a.url}", "--ingester", f"b={pair.b.url}"])
    assert right.exit_code == 0 and "warning" not in right.stderr, right.stderr
    # a reader routing by the swapped description, in front of the same two ingesters (their own
    # description is right): b is asked for a's streams and names its own URL as their owner
    store = tmp_path / "reader-store"
    procs.write_cluster(store, {"a": pair.b.url, "b": pair.a.url})
    reader = procs.reader(tmp_path / "reader", None, store.as_uri()).start()
    try:
        on_a = next(f"/v1/stream/sw-{n}" for n in range(1000) if pair.cluster.owner(f"sw-{n}").id == "a")
        for method in ("HEAD", "PUT", "POST"):
            status, _, body = request(reader, method, on_a, b"x" if method == "POST" else None,
                                      headers={"Content-Type": "text/plain"})
            assert status == 503, (method, status, body)
            if method != "HEAD":
                assert f"names ingester a at {pair.b.url}, but the ingester answering there is another member".encode() \
                    in body, body
                assert b"check them with `ds3 cluster show`" in body
    finally:
        reader.stop()


def test_an_ingester_added_and_removed_before_it_ran_holds_nothing(tmp_path: Path) -> None:
    """Found by QA: `cluster set` with an ingester d that was never started, then without it
    again: the streams d's description placed on it answered 503 ("moving here from ingester
    d, which does not answer") until the next change. d never owned its namespace (no
    ownership record), so it holds nothing: they are created at once."""
    store_root = tmp_path / "objects"
    pa, pb = procs.free_port(), procs.free_port()
    ab = {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"}
    procs.write_cluster(store_root, ab)
    common = ["--store", store_root.as_uri(), "--cluster-refresh", "0.2"]
    a = procs.ingester(tmp_path / "a", *common, "--ingester-id", "a", port=pa).start()
    b = procs.ingester(tmp_path / "b", *common, "--ingester-id", "b", port=pb).start()
    try:
        with_d = procs.write_cluster(store_root, {**ab, "d": f"http://127.0.0.1:{procs.free_port()}"})
        paths = [p for p in (f"new-{n}" for n in range(200)) if with_d.owner(p).id == "d"][:4]
        assert paths
        back = procs.write_cluster(store_root, ab)
        deadline = time.monotonic() + 10
        while any(readyz(p)[1]["cluster"]["generation"] != back.generation for p in (a, b)):  # type: ignore[index]
            assert time.monotonic() < deadline, "the members never read the last description"
            time.sleep(0.1)
        for path in paths:
            owner = a if back.owner(path).id == "a" else b
            status, _, body = request(owner, "PUT", f"/v1/stream/{path}")
            assert status == 201, (path, status, body)
    finally:
        b.stop()
        a.stop()
