"""`--durability store`: what readers see is what the store's log holds (ingester/visibility.py).

Before, a commit was served from the WAL as soon as LMDB had it, while its segment was still on
its way to the store. With the store failing, an append answered 503 (nothing promised) was
nonetheless read back at once, through the reader and by a live follower; a standby taking over
then had no trace of it and gave its offset to other bytes: a reader had seen two different
contents at one offset ("bytes at a given offset never change"). Real processes: moto behind a
TCP gate that cuts the store, an ingester in store mode, a reader in front.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from ingester.service import SERVICE
from shared.errors import ObjectStoreUnavailable, Unavailable
from tests import procs
from tests.cluster import StoreView
from tests.procs import request
from tests.tcpgate import TcpGate

pytestmark = pytest.mark.slow

TEXT = {"Content-Type": "text/plain"}


def _owner(tmp_path: Path, name: str, store: StoreView, gate: TcpGate, lease: float) -> procs.Proc:
    return procs.ingester(tmp_path / name, *store.server_args(gate.url), "--durability", "store",
                          "--lease-seconds", str(lease), "--long-poll-timeout", "2", "--write-rate", "0")


def _page(reader: procs.Proc, path: str, offset: str) -> tuple[bytes, str]:
    status, headers, body = request(reader, "GET", f"{path}?offset={offset}")
    assert status == 200, (status, body)
    return body, headers["stream-next-offset"]


def _long_poll(reader: procs.Proc, path: str, offset: str, out: list[tuple[int, bytes]]) -> threading.Thread:
    def run() -> None:
        status, _, body = request(reader, "GET", f"{path}?offset={offset}&live=long-poll", timeout=30)
        out.append((status, body))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_refused_append_is_not_read_until_the_store_has_it(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    store, gate = gated_s3
    owner = _owner(tmp_path, "a", store, gate, lease=60).start()  # (the lease outlasts the cut)
    reader = procs.reader(tmp_path / "reader", owner.url, store.url, *store.server_args()[2:], "--write-rate", "0",
                          "--long-poll-timeout", "3")  # (a long-poll that must time out: not the default 30 s)
    reader.start()
    path = "/v1/stream/s"
    try:
        assert request(reader, "PUT", path, headers=TEXT)[0] == 201
        assert request(reader, "POST", path, b"a\n", TEXT)[0] == 204
        after_a = _page(reader, path, "-1")[1]
        gate.down()
        status, _, body = request(reader, "POST", path, b"ghost\n", TEXT)
        assert status == 503, (status, body)
        assert request(reader, "PUT", "/v1/stream/new", headers=TEXT)[0] == 503
        # Nothing of either is seen: not by a catch-up read, a HEAD, nor a long-poll.
        assert _page(reader, path, after_a) == (b"", after_a)
        assert _page(reader, path, "-1") == (b"a\n", after_a)
        status, headers, _ = request(reader, "HEAD", path)
        assert status == 200 and headers["stream-next-offset"] == after_a
        assert request(reader, "HEAD", "/v1/stream/new")[0] == 404
        assert (procs.metric(procs.metrics(owner), "ds3_log_unseen_commits") or 0) >= 2
        polled: list[tuple[int, bytes]] = []
        _long_poll(reader, path, after_a, polled).join(10)
        assert polled and polled[0][0] == 204, polled
        # The store back, the commits it lacked are shipped: now they are read, and a waiting
        # follower is woken with them.
        waiting: list[tuple[int, bytes]] = []
        follower = _long_poll(reader, path, after_a, waiting)
        time.sleep(0.3)
        gate.up()
        follower.join(10)
        deadline = time.monotonic() + 20
        while _page(reader, path, after_a)[0] != b"ghost\n":
            assert time.monotonic() < deadline, "the shipped append is not read"
            time.sleep(0.1)
        assert waiting and (waiting[0] == (200, b"ghost\n") or waiting[0][0] == 204), waiting
        assert request(reader, "HEAD", "/v1/stream/new")[0] == 200
        # every commit shipped (the ingester's own chores commit too: one may be on its way)
        while (procs.metric(procs.metrics(owner), "ds3_log_unseen_commits") or 0) != 0:
            assert time.monotonic() < deadline, "commits the store lacks after it came back"
            time.sleep(0.1)
        # the outage is said by the shipper; the chores refused meanwhile do not add tracebacks
        assert "Traceback" not in owner.log_path.read_text()
    finally:
        reader.stop()
        owner.stop()


def test_a_takeover_never_gives_a_read_offset_other_bytes(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    """The owner cut off from the store refuses an append and dies; the standby's history lacks
    it, and the offset goes to the next append. No reader saw the refused one there."""
    store, gate = gated_s3
    owner = _owner(tmp_path, "a", store, gate, lease=2).start()
    standby = procs.ingester(tmp_path / "b", *store.server_args(), "--durability", "store", "--lease-seconds", "2",
                             "--write-rate", "0", "--standby").start()
    reader = procs.reader(tmp_path / "reader", None, store.url, *store.server_args()[2:], "--write-rate", "0")
    reader.start()
    path = "/v1/stream/s"
    seen: dict[str, bytes] = {}
    try:
        assert request(reader, "PUT", path, headers=TEXT)[0] == 201
        assert request(reader, "POST", path, b"a\n", TEXT)[0] == 204
        after_a = _page(reader, path, "-1")[1]
        gate.down()
        assert request(reader, "POST", path, b"ghost\n", TEXT)[0] == 503
        seen[after_a] = _page(reader, path, after_a)[0]
        owner.kill()
        deadline = time.monotonic() + 20
        while (status := request(reader, "POST", path, b"new\n", TEXT)[0]) != 204:
            assert status == 503 and time.monotonic() < deadline, status
            time.sleep(0.2)
        now = _page(reader, path, after_a)[0]
        assert now == b"new\n"
        assert seen[after_a] in (b"", now), f"offset {after_a} read {seen[after_a]!r}, then {now!r}"
        assert procs.read_all(reader, path) == b"a\nnew\n"
    finally:
        gate.up()
        reader.stop()
        standby.stop()
        owner.stop()


def test_an_owner_restarted_after_a_takeover_continues_the_new_owners_history(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    """The owner, cut off from the store, refuses appends (503: in its WAL only) and dies; the
    standby takes over and acknowledges more; then the first owner is restarted on its old disk
    (same owner id), not as a standby. Its WAL is not the history any more: the store's log is.
    (Found by QA: when the old WAL held more commits than the new owner had written, it was kept,
    and its first checkpoint replaced every append the new owner had acknowledged.)"""
    store, gate = gated_s3
    owner = _owner(tmp_path, "a", store, gate, lease=2).start()
    standby = procs.ingester(tmp_path / "b", *store.server_args(), "--durability", "store", "--lease-seconds", "2",
                             "--write-rate", "0", "--standby").start()
    path = "/v1/stream/s"
    try:
        assert request(owner, "PUT", path, headers=TEXT)[0] == 201
        for i in range(3):
            assert request(owner, "POST", path, b"ok%d\n" % i, TEXT)[0] == 204
        gate.down()
        for i in range(4):  # in the old owner's WAL only (each waits for its failed gate)
            assert request(owner, "POST", path, b"hidden%d\n" % i, TEXT)[0] == 503
        owner.kill()
        deadline = time.monotonic() + 20
        while request(standby, "POST", path, b"b0\n", TEXT)[0] != 204:
            assert time.monotonic() < deadline, "the standby did not take over"
            time.sleep(0.1)
        assert request(standby, "POST", path, b"b1\n", TEXT)[0] == 204
        standby.stop()  # a clean stop: the lease released at once
        gate.up()
        owner.start()
        assert procs.read_all(owner, path) == b"ok0\nok1\nok2\nb0\nb1\n"
        assert "set aside at" in owner.log_path.read_text()
    finally:
        gate.up()
        standby.stop()
        owner.stop()


def test_what_a_refused_close_would_mean_is_not_answered_either(
        tmp_path: Path, gated_s3: tuple[StoreView, TcpGate]) -> None:
    """A close answered 503 (in the WAL only): an append after it is refused with 503 too, not
    with 409 "stream is closed", and so is a producer's request whose answer relies on it; once
    the store has the close, the 409 is the answer. (Found by QA: the 409 came at once, and the
    standby that took over had the stream open.)"""
    store, gate = gated_s3
    owner = _owner(tmp_path, "a", store, gate, lease=60).start()
    path = "/v1/stream/s"
    try:
        assert request(owner, "PUT", path, headers=TEXT)[0] == 201
        assert request(owner, "POST", path, b"a\n", TEXT)[0] == 204
        gate.down()
        assert request(owner, "POST", path, b"", {**TEXT, "Stream-Closed": "true"})[0] == 503
        status, headers, body = request(owner, "POST", path, b"b\n", TEXT)
        assert status == 503 and "stream-closed" not in headers, (status, headers, body)
        gate.up()
        deadline = time.monotonic() + 20
        while (status := request(owner, "POST", path, b"b\n", TEXT)[0]) != 409:
            assert status == 503 and time.monotonic() < deadline, status
            time.sleep(0.1)
        assert procs.read_all(owner, path) == b"a\n"
    finally:
        gate.up()
        owner.stop()



def fail_log_puts(objects: Any) -> dict[str, bool]:
    """The ingester's store `objects` refuses log segment PUTs (503 to the appends they carry)
    while the returned switch's "on" is True; chunks, blobs and the rest still go through."""
    put, failing = objects.put, {"on": False}

    async def log_puts_fail(key: str, data: bytes, **kw: Any) -> str:
        if failing["on"] and key.startswith("log/"):
            raise ObjectStoreUnavailable("the store is down for log segments (test)")
        return cast(str, await put(key, data, **kw))

    objects.put = log_puts_fail
    return failing

async def test_a_snapshot_refused_for_the_stores_sake_is_there_once_it_ships(
        tmp_path: Path, make_ingester: Any) -> None:
    """A snapshot PUT answered 503 because its commit's log segment did not reach the store
    (the blob did) keeps its blob: once the commit ships, the snapshot it names is readable,
    and so is /bootstrap. (Found by QA: the blob was deleted as if nothing had been committed,
    and both answered 404 once the commit shipped.) In-process, so that only the log's PUTs fail."""
    client = await make_ingester(store=(tmp_path / "objects").as_uri(), durability="store")
    svc = client.server.app[SERVICE]
    failing = fail_log_puts(svc.shipper.objects)
    path = "/v1/stream/s"
    assert (await client.put(path, headers=TEXT)).status == 201
    assert (await client.post(path, data=b"a\n", headers=TEXT)).status == 204
    offset = (await client.head(path)).headers["Stream-Next-Offset"]
    failing["on"] = True
    assert (await client.put(f"{path}/snapshot/{offset}", data=b"SNAP", headers=TEXT)).status == 503
    failing["on"] = False
    deadline = time.monotonic() + 20
    while (await client.head(path)).headers.get("Stream-Snapshot-Offset") != offset:
        assert time.monotonic() < deadline, "the snapshot's commit never shipped"
        await asyncio.sleep(0.1)
    got = await client.get(f"{path}/snapshot/{offset}")
    assert (got.status, await got.read()) == (200, b"SNAP")
    assert (await client.get(f"{path}/bootstrap")).status == 200


async def test_buckets_and_listings_show_only_what_the_store_holds(tmp_path: Path, make_ingester: Any) -> None:
    """A bucket create, a stream create and a bucketed stream's create answered 503 (in the WAL,
    not in the store's log) are not shown by the bucket's GET, its listing or the listings of
    streams and buckets: those answer 503 until the store has the commits, then show them. (Before,
    they read the WAL as it was: a bucket whose create was refused was there, and a standby
    taking over would not have it.) In-process, so that only the log's PUTs fail."""
    client = await make_ingester(store=(tmp_path / "objects").as_uri(), durability="store")
    failing = fail_log_puts(client.server.app[SERVICE].shipper.objects)

    async def listed(url: str, entries: str, key: str) -> list[str]:
        got = await client.get(url)
        assert got.status == 200, (url, got.status, await got.text())
        return [entry[key] for entry in (await got.json())[entries]]

    assert (await client.put("/v1/buckets/olds")).status == 201
    assert (await client.put("/v1/stream/old", headers=TEXT)).status == 201
    failing["on"] = True
    assert (await client.put("/v1/buckets/bbbb")).status == 503
    assert (await client.put("/v1/stream/new", headers=TEXT)).status == 503
    assert (await client.put("/v1/buckets/olds/x", headers=TEXT)).status == 503
    for url in ("/v1/buckets/bbbb", "/ds3/buckets", "/ds3/streams", "/v1/buckets/olds", "/v1/buckets/olds/streams"):
        got = await client.get(url)
        assert got.status == 503, (url, got.status, await got.text())
        assert "retry-after" in got.headers
    failing["on"] = False
    deadline = time.monotonic() + 20
    while (got := await client.get("/v1/buckets/bbbb")).status != 200:
        assert got.status == 503 and time.monotonic() < deadline, got.status
        await asyncio.sleep(0.1)
    assert (await got.json())["bucket_id"] == "bbbb"
    assert await listed("/ds3/buckets", "buckets", "bucket_id") == ["bbbb", "olds"]
    assert "/v1/stream/new" in await listed("/ds3/streams", "streams", "url")
    assert (await (await client.get("/v1/buckets/olds")).json())["streams"] == 1


async def test_a_stream_that_expired_is_gone_while_its_removal_ships(tmp_path: Path, make_ingester: Any) -> None:
    """A stream past its TTL answers 404 whether or not the store has the expiry sweep's commit
    yet: its expiry is decided by the metadata the store already holds, so there is nothing to
    wait for. (Before, HEAD answered 503 until the sweep's segment landed, and the reader, told
    503 by the touch it sends for a sealed stream with a TTL, served the expired stream's bytes
    with 200: seen in CI's conformance run in store mode.) In-process, so that only the log's PUTs fail."""
    # (no sweep of its own meanwhile: it would remove the stream, shipped, before the cut)
    client = await make_ingester(store=(tmp_path / "objects").as_uri(), durability="store",
                                 sweep_interval=3600.0, seal_age=7200.0)
    svc = client.server.app[SERVICE]
    failing = fail_log_puts(svc.shipper.objects)
    path = "/v1/stream/brief"
    assert (await client.put(path, data=b"test data", headers={**TEXT, "Stream-TTL": "1"})).status == 201
    await asyncio.sleep(1.2)
    failing["on"] = True
    with pytest.raises(Unavailable):  # the sweep's commit is in the WAL, its segment refused
        await svc.committer.submit(svc.store.sweep_expired)
    assert (await client.head(path)).status == 404
    assert (await client.get(path)).status == 404
    assert (await client.post("/_ds3/touch", params={"path": path})).status == 404
    failing["on"] = False  # an append is refused until the sweep's commit ships, then told 404
    deadline = time.monotonic() + 20
    while (got := await client.post(path, data=b"more", headers=TEXT)).status != 404:
        assert got.status == 503 and time.monotonic() < deadline, got.status
        await asyncio.sleep(0.1)
