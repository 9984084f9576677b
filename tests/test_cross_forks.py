"""Forks whose source lives on another ingester (issue 15 item 3), with real processes: two
ingesters sharing a local store and a cluster description, a reader routing in front.

The fork's owner pins the source at its owner (which rolls and seals what the fork inherits),
so the fork reads the source's bytes at the source's offsets from the store, takes its own
appends, survives the source's deletion (410 for the source meanwhile) and the source
ingester's death, and its deletion releases the source."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from shared import keys
from shared.placement import Cluster
from tests import procs
from tests.procs import request


@dataclass
class Setup:
    a: procs.Proc
    b: procs.Proc
    reader: procs.Proc
    store_root: Path
    cluster: Cluster

    def path_on(self, ingester_id: str, prefix: str) -> str:
        return next(p for p in (f"{prefix}-{n}" for n in range(1000)) if self.cluster.owner(p).id == ingester_id)

    def chunk_objects(self, uid: str) -> list[Path]:
        base = self.store_root / keys.chunk_prefix(uid)
        while True:
            try:
                return [p for p in base.rglob("*") if p.is_file()] if base.exists() else []
            except FileNotFoundError:  # a directory removed while walked (the GC at work): look again
                continue


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("xfork")
    store_root = root / "objects"
    pa, pb = procs.free_port(), procs.free_port()
    cluster = procs.write_cluster(store_root, {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"})
    common = ["--store", store_root.as_uri(), "--cluster-refresh", "0.2", "--write-rate", "0",
              "--seal-bytes", "2048", "--seal-age", "60", "--log-level", "warning"]
    a = procs.ingester(root / "a", *common, "--ingester-id", "a", port=pa)
    b = procs.ingester(root / "b", *common, "--ingester-id", "b", port=pb)
    rdr = procs.reader(root / "reader", a.url, store_root.as_uri(), "--cluster-refresh", "0.2",
                       "--log-level", "warning")
    started: list[procs.Proc] = []
    try:
        for p in (a, b, rdr):
            p.start()
            started.append(p)
        yield Setup(a, b, rdr, store_root, cluster)
    finally:
        for p in reversed(started):
            p.stop()


def put(p: procs.Proc, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    return request(p, "PUT", f"/v1/stream/{path}", body, headers={"Content-Type": "text/plain", **(headers or {})})


def append(p: procs.Proc, path: str, body: bytes, content_type: str = "text/plain") -> str:
    status, h, text = request(p, "POST", f"/v1/stream/{path}", body, headers={"Content-Type": content_type})
    assert status in (200, 204), (status, text)
    return h["stream-next-offset"]


def catch_up(p: procs.Proc, path: str, start: str = "-1") -> tuple[bytes, list[str]]:
    """Everything from `start` until up to date: (bytes, the next offsets of the pages)."""
    out, seen, offset = b"", [], start
    for _ in range(500):
        status, h, body = request(p, "GET", f"/v1/stream/{path}?offset={offset}")
        assert status == 200, (status, body)
        out += body
        offset = h["stream-next-offset"]
        seen.append(offset)
        if h.get("stream-up-to-date") == "true":
            return out, seen
    raise AssertionError("no end")


def head(p: procs.Proc, path: str) -> tuple[int, dict[str, str]]:
    status, h, _ = request(p, "HEAD", f"/v1/stream/{path}")
    return status, h


def wait_for(what: str, check: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_fork_reads_its_source_from_another_ingester(setup: Setup) -> None:
    r = setup.reader
    source, fork = setup.path_on("a", "src"), setup.path_on("b", "fork")
    assert put(r, source)[0] == 201
    written = [append(r, source, f"m{n:03d}-".encode() * 10) for n in range(100)]
    tail = written[-1]  # 2 KiB chunks: two sealed, the rest unsealed in the open chunk
    expected, _ = catch_up(r, source)
    status, h, body = put(r, fork, {"Stream-Forked-From": f"/v1/stream/{source}"})
    assert status == 201, body
    assert h["stream-next-offset"] == tail  # the fork's tail is the source's, offset for offset
    got, pages = catch_up(r, fork)
    assert got == expected and pages == catch_up(r, source)[1]  # the same pages at the same offsets
    # the ingesters: the fork lives on b, which pinned the source on a
    assert head(setup.b, fork)[0] == 200 and head(setup.a, fork)[0] == 421

    # from here on they part: appends to one never show in the other
    append(r, fork, b"fork-only")
    append(r, source, b"source-only")
    assert catch_up(r, fork)[0] == expected + b"fork-only"
    assert catch_up(r, source)[0] == expected + b"source-only"
    # reading the fork from an inherited offset gives the source's bytes from there
    for mid in (written[10], written[60]):  # in a sealed chunk, in the open one
        assert catch_up(r, fork, mid)[0] == catch_up(r, source, mid)[0][: -len(b"source-only")] + b"fork-only"

    # an idempotent re-create answers 200 and takes no second pin
    status, _, _ = put(r, fork, {"Stream-Forked-From": f"/v1/stream/{source}"})
    assert status == 200


def test_a_fork_at_an_offset_and_refusals_are_the_sources(setup: Setup) -> None:
    r = setup.reader
    source, fork = setup.path_on("a", "src-at"), setup.path_on("b", "fork-at")
    assert put(r, source)[0] == 201
    offsets = [append(r, source, f"part{n}|".encode() * 50) for n in range(12)]
    at = offsets[4]
    status, h, body = put(r, fork, {"Stream-Forked-From": f"/v1/stream/{source}", "Stream-Fork-Offset": at})
    assert status == 201, body
    assert h["stream-next-offset"] == at
    assert catch_up(r, fork)[0] == b"".join(f"part{n}|".encode() * 50 for n in range(5))

    other = setup.path_on("b", "fork-bad")
    fork_of = {"Stream-Forked-From": f"/v1/stream/{source}"}
    status, _, body = put(r, other, {**fork_of, "Stream-Fork-Offset": "0000000000099999_0000000099999999"})
    assert status == 400 and b"beyond the end" in body
    status, _, body = put(r, other, {**fork_of, "Content-Type": "application/json"})
    assert status == 409 and b"content type" in body
    status, _, body = put(r, other, {"Stream-Forked-From": f"/v1/stream/{setup.path_on('a', 'nothing')}"})
    assert status == 404 and b"not found" in body
    assert head(r, other)[0] == 404  # no fork was left behind by the refusals


def test_json_fork_across_ingesters(setup: Setup) -> None:
    r = setup.reader
    source, fork = setup.path_on("a", "jsrc"), setup.path_on("b", "jfork")
    status, _, _ = request(r, "PUT", f"/v1/stream/{source}", headers={"Content-Type": "application/json"})
    assert status == 201
    for n in range(30):
        append(r, source, orjson.dumps([{"n": n, "pad": "x" * 100}]), "application/json")
    status, _, body = request(r, "PUT", f"/v1/stream/{fork}", headers={
        "Content-Type": "application/json", "Stream-Forked-From": f"/v1/stream/{source}"})
    assert status == 201, body
    append(r, fork, orjson.dumps([{"n": "own"}]), "application/json")
    items = []
    offset = "-1"
    while True:
        status, h, body = request(r, "GET", f"/v1/stream/{fork}?offset={offset}")
        items += orjson.loads(body)
        offset = h["stream-next-offset"]
        if h.get("stream-up-to-date") == "true":
            break
    assert [i["n"] for i in items] == [*range(30), "own"]


def test_the_source_deleted_while_the_fork_lives_then_released(setup: Setup) -> None:
    r = setup.reader
    source, fork = setup.path_on("a", "src-del"), setup.path_on("b", "fork-del")
    assert put(r, source)[0] == 201
    for n in range(20):
        append(r, source, f"d{n}-".encode() * 40)
    expected, _ = catch_up(r, source)
    assert put(r, fork, {"Stream-Forked-From": f"/v1/stream/{source}"})[0] == 201
    uid = _descriptor_uid(setup, source)
    assert setup.chunk_objects(uid)

    assert request(r, "DELETE", f"/v1/stream/{source}")[0] == 204
    assert head(setup.a, source)[0] == 410  # soft-deleted: the fork still reads it
    assert put(r, source)[0] == 409  # the path cannot be reused while the fork lives
    assert catch_up(r, fork)[0] == expected

    assert request(r, "DELETE", f"/v1/stream/{fork}")[0] == 204
    # the fork's owner releases its pin; the source's owner then removes the source for good
    wait_for("the source to be removed", lambda: head(setup.a, source)[0] == 404)
    wait_for("the source's chunk objects to be deleted", lambda: not setup.chunk_objects(uid))
    text = procs.metrics(setup.b)
    assert (procs.metric(text, "ds3_cluster_fork_pins_released_total") or 0) >= 1
    assert (procs.metric(text, "ds3_cluster_remote_forks_created_total") or 0) >= 1
    assert put(r, source)[0] == 201  # the path is free again


def _descriptor_uid(setup: Setup, path: str) -> str:
    raw = (setup.store_root / keys.descriptor_key(path)).read_bytes()
    return str(orjson.loads(raw)["uid"])


def test_the_fork_outlives_its_source_ingester(tmp_path: Path) -> None:
    """a (the source's owner) SIGKILLed: the fork on b still reads everything it inherited
    (sealed in the store) and takes appends; a new fork of a's stream gets 503 meanwhile; a
    back on its data dir, forking works again."""
    store_root = tmp_path / "objects"
    pa, pb = procs.free_port(), procs.free_port()
    cluster = procs.write_cluster(store_root, {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"})
    common = ["--store", store_root.as_uri(), "--cluster-refresh", "0.2", "--write-rate", "0",
              "--seal-bytes", "2048", "--log-level", "warning"]
    a = procs.ingester(tmp_path / "a", *common, "--ingester-id", "a", port=pa)
    b = procs.ingester(tmp_path / "b", *common, "--ingester-id", "b", port=pb)
    rdr = procs.reader(tmp_path / "reader", a.url, store_root.as_uri(), "--cluster-refresh", "0.2",
                       "--log-level", "warning")
    s = Setup(a, b, rdr, store_root, cluster)
    a.start()
    try:
        b.start()
        rdr.start()
        source, fork = s.path_on("a", "src"), s.path_on("b", "fork")
        assert put(rdr, source)[0] == 201
        for n in range(25):
            append(rdr, source, f"k{n}-".encode() * 30)
        expected, _ = catch_up(rdr, source)
        assert put(rdr, fork, {"Stream-Forked-From": f"/v1/stream/{source}"})[0] == 201
        a.kill()
        assert catch_up(rdr, fork)[0] == expected
        append(rdr, fork, b"after the kill")
        assert catch_up(rdr, fork)[0] == expected + b"after the kill"
        status, h, body = put(rdr, s.path_on("b", "fork2"), {"Stream-Forked-From": f"/v1/stream/{source}"})
        assert status == 503 and "retry-after" in h, (status, body)
        a.start()
        status, _, body = put(rdr, s.path_on("b", "fork2"), {"Stream-Forked-From": f"/v1/stream/{source}"})
        assert status == 201, body
        assert catch_up(rdr, s.path_on("b", "fork2"))[0] == expected
    finally:
        rdr.stop()
        b.stop()
        a.stop()


def test_a_fork_inherits_its_remote_sources_snapshot_and_bootstraps(setup: Setup) -> None:
    """The source's snapshot (on a) is the fork's (on b): reads before it are 410 naming it,
    `/snapshot` redirects to it and `/bootstrap` is the snapshot plus every message after it."""
    r = setup.reader
    source, fork = setup.path_on("a", "snap-src"), setup.path_on("b", "snap-fork")
    assert put(r, source)[0] == 201
    offsets = [append(r, source, f"e{n};".encode()) for n in range(6)]
    at = offsets[2]
    status, _, body = request(r, "PUT", f"/v1/stream/{source}/snapshot/{at}", b"STATE", {"Content-Type": "text/plain"})
    assert status == 204, body
    assert put(r, fork, {"Stream-Forked-From": f"/v1/stream/{source}"})[0] == 201
    append(r, fork, b"own;")
    status, h, body = request(r, "GET", f"/v1/stream/{fork}?offset=-1")
    assert status == 410 and at.encode() in body, (status, body)
    status, h, _ = request(r, "GET", f"/v1/stream/{fork}/snapshot")
    assert status == 307 and h["location"].endswith(f"/snapshot/{at}")
    status, h, body = request(r, "GET", f"/v1/stream/{fork}/bootstrap")
    assert status == 200 and h["content-type"].startswith("multipart/mixed"), (status, body)
    boundary = h["content-type"].split("boundary=", 1)[1].strip('"').encode()
    parts = [p.split(b"\r\n\r\n", 1)[1].removesuffix(b"\r\n")
             for p in body.split(b"--" + boundary)[1:-1]]
    assert parts == [b"STATE", b"e3;", b"e4;", b"e5;", b"own;"]
    assert catch_up(r, fork, at)[0] == b"e3;e4;e5;own;"
