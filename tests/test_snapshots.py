"""Snapshots, retention and bootstrap (extensions §2-3), through the reader and the
ingester, with chunks sealed into moto's S3.

One cluster serves the module (each test uses its own streams); tests that restart or
slow down processes start their own."""

from __future__ import annotations

import asyncio
import email
import email.message
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from multidict import CIMultiDict

from shared.extensions import MAX_SNAPSHOT_CONTENT_TYPE
from tests.cluster import Cluster, StoreView, append, create, read_pages, scrape, wait_for
from tests.s3server import CLEARED_ENV, TEST_ENV, MotoS3
from tests.tcpgate import TcpGate

SEAL = 1024
MAX_SNAPSHOT = 256 * 1024
TIMEOUT = aiohttp.ClientTimeout(total=30)


@pytest.fixture(scope="module")
def cluster(s3_server: MotoS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    bucket = s3_server.new_bucket()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in TEST_ENV.items():
            mp.setenv(k, v)
        for k in CLEARED_ENV:
            mp.delenv(k, raising=False)
        # As `ds3 dev` runs them: the pair shares an internal token (/_ds3/ needs it).
        limit = ["--max-snapshot-bytes", str(MAX_SNAPSHOT), "--internal-token", "snapshot-tests-" + "t" * 32]
        c = Cluster(
            tmp_path_factory.mktemp("snapshots"), StoreView.s3_store(s3_server, bucket), seal_bytes=SEAL,
            seal_age=0.3, ingester_args=limit, reader_args=limit,
        )
        with c:
            yield c
    s3_server.drop_bucket(bucket)


@pytest.fixture(params=["reader", "ingester"])
def base(request: pytest.FixtureRequest, cluster: Cluster) -> str:
    proc = cluster.reader if request.param == "reader" else cluster.ingester
    return proc.url


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


_names = iter(range(10**6))


def stream_url(base: str, kind: str = "s") -> str:
    return f"{base}/v1/stream/snap-{kind}-{next(_names)}"


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> dict[str, object]:
        found = json.loads(self.body)
        assert isinstance(found, dict)
        return found


async def call(session: aiohttp.ClientSession, method: str, url: str, body: bytes | None = None,
               headers: dict[str, str] | None = None) -> Reply:
    async with session.request(method, url, data=body, headers=headers, allow_redirects=False) as r:
        return Reply(r.status, CIMultiDict(r.headers), await r.read())


def message(i: int, pad: int = 60) -> dict[str, object]:
    return {"i": i, "pad": "x" * pad}


async def fill_json(session: aiohttp.ClientSession, url: str, n: int, start: int = 0) -> list[str]:
    """Append messages start..start+n-1 one per POST; return the offset after each."""
    return [await append(session, url, json.dumps(message(i)).encode(), "application/json")
            for i in range(start, start + n)]


async def sealed(cluster: Cluster, url: str, at_least: int) -> None:
    """Wait until the stream has at least `at_least` chunks in the store."""
    path = url.split("/v1/stream/", 1)[1]

    def enough() -> bool:
        desc = cluster.store.descriptor(path)
        return desc is not None and len(cluster.store.chunk_keys(desc["uid"])) >= at_least

    await asyncio.to_thread(wait_for, enough, 15, f"{at_least} sealed chunks of {path}")


def parse_multipart(content_type: str, body: bytes) -> list[email.message.Message]:
    """Parse a bootstrap body with the standard library's MIME parser."""
    msg = email.message_from_bytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    assert msg.is_multipart(), content_type
    parts = msg.get_payload()
    assert isinstance(parts, list)
    return parts


def payload(part: email.message.Message) -> bytes:
    data = part.get_payload(decode=True)
    assert isinstance(data, bytes)
    return data


async def bootstrap(session: aiohttp.ClientSession, url: str) -> tuple[Reply, list[email.message.Message]]:
    r = await call(session, "GET", f"{url}/bootstrap")
    assert r.status == 200, (r.status, r.body[:300])
    return r, parse_multipart(r.headers["Content-Type"], r.body)


# ---------------------------------------------------------------- publish and read
async def test_publish_then_head_latest_and_read(session: aiohttp.ClientSession, base: str) -> None:
    url = stream_url(base)
    await create(session, url, "application/json")
    offs = await fill_json(session, url, 5)
    head = await call(session, "HEAD", url)
    assert "Stream-Snapshot-Offset" not in head.headers
    assert (await call(session, "GET", f"{url}/snapshot")).status == 404

    r = await call(session, "PUT", f"{url}/snapshot/{offs[2]}", b'{"upto":3}', {"Content-Type": "application/json"})
    assert r.status == 204, r.body
    head = await call(session, "HEAD", url)
    assert head.headers["Stream-Snapshot-Offset"] == offs[2]

    latest = await call(session, "GET", f"{url}/snapshot")
    assert latest.status == 307
    assert latest.headers["Location"].endswith(f"/snapshot/{offs[2]}")
    assert latest.headers["Location"].startswith("/v1/stream/")

    got = await call(session, "GET", f"{url}/snapshot/{offs[2]}")
    assert got.status == 200 and got.body == b'{"upto":3}'
    assert got.headers["Content-Type"] == "application/json"
    assert got.headers["Stream-Snapshot-Offset"] == offs[2]
    assert got.headers["Stream-Next-Offset"] == offs[2]
    assert got.headers["Stream-Up-To-Date"] == "false"  # two messages follow it

    # At the tail: the snapshot covers everything.
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[4]}", b"all")).status == 204
    got = await call(session, "GET", f"{url}/snapshot/{offs[4]}")
    assert got.headers["Stream-Up-To-Date"] == "true"
    assert got.headers["Content-Type"] == "application/octet-stream"  # the default
    assert got.body == b"all"
    # The superseded one is gone at once (only one snapshot is visible).
    assert (await call(session, "GET", f"{url}/snapshot/{offs[2]}")).status == 404


async def test_snapshot_offset_validation(session: aiohttp.ClientSession, base: str) -> None:
    url = stream_url(base)
    await create(session, url, "application/octet-stream")
    a = await append(session, url, b"0123456789", "application/octet-stream")
    b = await append(session, url, b"abcdefghij", "application/octet-stream")
    chunk, pos = a.split("_")
    mid = f"{chunk}_{int(pos) + 3:016d}"  # inside the second append
    cases = {
        "garbage": 400, "-1": 400, "now": 400, "0000000000000001_0000000000000001x": 400,
        mid: 400,  # not at a message boundary
        f"{int(chunk) + 7:016d}_{pos}": 400,  # a position this stream names with another chunk id
        f"{chunk}_{int(b.split('_')[1]) + 10:016d}": 409,  # beyond the tail
    }
    for offset, status in cases.items():
        r = await call(session, "PUT", f"{url}/snapshot/{offset}", b"s")
        assert r.status == status, (offset, r.status, r.body)
    # {stream}/snapshot is not a stream to create: the 405 says where a snapshot goes
    reserved = await call(session, "PUT", f"{url}/snapshot", b"", {"Content-Type": "text/plain"})
    assert reserved.status == 405 and b"PUT {stream}/snapshot/{offset}" in reserved.body, reserved.body
    missing = await call(session, "PUT", f"{stream_url(base)}/snapshot/{a}", b"s")
    assert missing.status == 404
    too_big = await call(session, "PUT", f"{url}/snapshot/{a}", b"z" * (MAX_SNAPSHOT + 1))
    assert too_big.status == 413 and b"a snapshot is at most 262144 bytes (--max-snapshot-bytes" in too_big.body, \
        too_big.body
    bad_type = await call(session, "PUT", f"{url}/snapshot/{a}", b"s", {"Content-Type": "not a type"})
    assert bad_type.status == 400
    # a type longer than what the store keeps with an object (the local store answered 503
    # "No space left on device", Retry-After: 1, from its extended attribute)
    long_type = "text/plain; x=" + "a" * (MAX_SNAPSHOT_CONTENT_TYPE - 13)
    too_long = await call(session, "PUT", f"{url}/snapshot/{a}", b"s", {"Content-Type": long_type})
    assert too_long.status == 400 and b"at most 1024 bytes" in too_long.body, (too_long.status, too_long.body)
    # None of that published anything.
    assert "Stream-Snapshot-Offset" not in (await call(session, "HEAD", url)).headers
    longest = long_type[:-1]  # the longest allowed: kept and given back
    assert (await call(session, "PUT", f"{url}/snapshot/{a}", b"s", {"Content-Type": longest})).status == 204
    assert (await call(session, "GET", f"{url}/snapshot/{a}")).headers["Content-Type"] == longest
    assert (await call(session, "PUT", f"{url}/snapshot/{a}", b"s")).status == 204
    older = await call(session, "PUT", f"{url}/snapshot/{url_start(await call(session, 'HEAD', url))}", b"s")
    assert older.status == 410 and older.json()["earliest_offset"] == a


def url_start(head: Reply) -> str:
    """The offset of position 0 (chunk id of the stream's first chunk)."""
    chunk = head.headers["Stream-Next-Offset"].split("_")[0]
    return f"{chunk}_{0:016d}"


async def test_json_snapshot_must_fall_between_messages_of_a_batch(session: aiohttp.ClientSession, base: str) -> None:
    url = stream_url(base)
    await create(session, url, "application/json")
    start = (await call(session, "HEAD", url)).headers["Stream-Next-Offset"]
    end = await append(session, url, b'[{"a":1},{"b":2},{"c":3}]', "application/json")
    chunk = end.split("_")[0]
    first_end = len(b'{"a":1},')
    inside = f"{chunk}_{first_end - 2:016d}"
    between = f"{start.split('_')[0]}_{first_end:016d}"
    assert (await call(session, "PUT", f"{url}/snapshot/{inside}", b"{}")).status == 400
    assert (await call(session, "PUT", f"{url}/snapshot/{between}", b"{}")).status == 204
    _r, parts = await bootstrap(session, url)
    assert [payload(p) for p in parts[1:]] == [b'{"b":2}', b'{"c":3}']


# ---------------------------------------------------------------- retention
async def test_reads_before_the_snapshot_answer_410_with_the_earliest_offset(
    session: aiohttp.ClientSession, base: str, cluster: Cluster
) -> None:
    url = stream_url(base)
    await create(session, url, "application/json")
    offs = await fill_json(session, url, 40)
    await sealed(cluster, url, 2)
    snap = offs[29]
    assert (await call(session, "PUT", f"{url}/snapshot/{snap}", b"{}")).status == 204
    for query in ("?offset=-1", "", f"?offset={offs[0]}", f"?offset={offs[28]}",
                  f"?offset={offs[0]}&live=long-poll", f"?offset={offs[5]}&live=sse", "?offset=-1&live=sse"):
        r = await call(session, "GET", url + query)
        assert r.status == 410, (query, r.status, r.body[:200])
        assert r.headers["Content-Type"].startswith("application/json")
        assert r.json()["earliest_offset"] == snap, query
    pages = await read_pages(session, url, snap)
    assert [m["i"] for p in pages for m in json.loads(p.body)] == list(range(30, 40))
    tail = await call(session, "GET", f"{url}?offset=now")
    assert tail.status == 200


async def test_retention_deletes_chunks_before_the_snapshot_and_the_superseded_blob(
    session: aiohttp.ClientSession, cluster: Cluster
) -> None:
    url = stream_url(cluster.reader.url)
    path = url.split("/v1/stream/", 1)[1]
    await create(session, url, "application/json")
    offs = await fill_json(session, url, 60)
    await sealed(cluster, url, 4)
    uid = cluster.store.descriptor(path)["uid"]  # type: ignore[index]
    ends = {key: head.header.end for key, head, _records in cluster.store.chunk_objects(uid)}
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[9]}", b"first")).status == 204
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[39]}", b"second")).status == 204
    earliest = int(offs[39].split("_")[1])
    doomed = [k for k, end in ends.items() if end <= earliest]
    kept = [k for k, end in ends.items() if end > earliest]
    assert doomed and kept

    def collected() -> bool:
        now = set(cluster.store.chunk_keys(uid))
        return not (now & set(doomed)) and set(kept) <= now and len(cluster.store.keys(f"snapshots/{uid[:2]}/{uid}/")) == 1

    await asyncio.to_thread(wait_for, collected, 15, "retention to delete chunks and the old snapshot")
    # What is retained still reads, from the store and from the ingester, to the tail.
    pages = await read_pages(session, url, offs[39])
    got = [m["i"] for p in pages for m in json.loads(p.body)]
    assert got == list(range(40, 60))


async def test_history_sealed_after_its_snapshot_or_read_by_a_fork_is_deleted_in_time(tmp_path: Path) -> None:
    """Retention deleted only chunks sealed when the snapshot was published: history still in
    the WAL then was sealed later and kept until another snapshot came, however long (found by
    QA); and history and snapshots a fork could read at the publish were kept after the fork went."""
    retention = 'ds3_objects_deleted_total{reason="retention"}'
    with Cluster(tmp_path, StoreView.local(tmp_path / "objects"), seal_bytes=SEAL, seal_age=1.5) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = f"{c.reader.url}/v1/stream/late-seal"
            await create(s, url, "text/plain")
            tail = await append(s, url, b"old history", "text/plain")
            assert (await call(s, "PUT", f"{url}/snapshot/{tail}", b"state")).status == 204
            uid = c.store.descriptor("late-seal")["uid"]  # type: ignore[index]
            assert c.store.chunk_keys(uid) == []  # the snapshot came before the seal (by age, 1.5 s)
            await asyncio.to_thread(wait_for, lambda: scrape(c.ingester.url)[retention] == 1, 15,
                                    "the chunk sealed after the publish deleted")
            assert c.store.chunk_keys(uid) == []

            # A fork reads the source when its snapshot is published: kept until the fork goes.
            src = f"{c.reader.url}/v1/stream/forked-src"
            await create(s, src, "text/plain")
            at = await append(s, src, b"before", "text/plain")
            suid = c.store.descriptor("forked-src")["uid"]  # type: ignore[index]
            await asyncio.to_thread(wait_for, lambda: len(c.store.chunk_keys(suid)) == 1, 15, "the source sealed")
            fork = f"{c.reader.url}/v1/stream/forked-copy"
            await create(s, fork, "text/plain", **{"Stream-Forked-From": "/v1/stream/forked-src"})
            assert (await call(s, "PUT", f"{src}/snapshot/{at}", b"state 1")).status == 204
            assert (await call(s, "PUT", f"{src}/snapshot/{at}", b"state 2")).status == 204  # supersedes the first
            blobs = f"snapshots/{suid[:2]}/{suid}/"
            await asyncio.sleep(1.0)
            assert len(c.store.chunk_keys(suid)) == 1 and len(c.store.keys(blobs)) == 2  # the fork may read them
            assert scrape(c.ingester.url)[retention] == 1
            assert (await call(s, "DELETE", fork)).status == 204
            await asyncio.to_thread(
                wait_for, lambda: not c.store.chunk_keys(suid) and len(c.store.keys(blobs)) == 1
                and scrape(c.ingester.url)[retention] == 3, 15, "the source's chunk and first snapshot deleted")
            assert (await call(s, "GET", f"{src}/snapshot/{at}")).body == b"state 2"


# ---------------------------------------------------------------- delete
async def test_delete_snapshot_rules(session: aiohttp.ClientSession, base: str) -> None:
    url = stream_url(base)
    await create(session, url, "application/json")
    offs = await fill_json(session, url, 3)
    assert (await call(session, "DELETE", f"{url}/snapshot/{offs[1]}")).status == 404  # none yet
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[0]}", b"{}")).status == 204
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[1]}", b"{}")).status == 204
    assert (await call(session, "DELETE", f"{url}/snapshot/{offs[1]}")).status == 409  # the latest
    assert (await call(session, "DELETE", f"{url}/snapshot/{offs[0]}")).status == 404  # superseded
    assert (await call(session, "DELETE", f"{url}/snapshot/garbage")).status == 400
    assert (await call(session, "DELETE", f"{stream_url(base)}/snapshot/{offs[0]}")).status == 404
    assert (await call(session, "GET", f"{url}/snapshot/{offs[1]}")).status == 200  # still there


# ---------------------------------------------------------------- bootstrap
async def test_bootstrap_without_a_snapshot(session: aiohttp.ClientSession, base: str) -> None:
    url = stream_url(base)
    await create(session, url, "application/json")
    await append(session, url, b'[{"a":1},{"b":[1,2]}]', "application/json")
    tail = await append(session, url, b'"three"', "application/json")
    r, parts = await bootstrap(session, url)
    assert r.headers["Stream-Snapshot-Offset"] == "-1"
    assert r.headers["Stream-Next-Offset"] == tail
    assert r.headers["Stream-Up-To-Date"] == "true"
    assert r.headers["Cache-Control"] == "no-store"
    assert r.headers["Content-Type"].startswith("multipart/mixed; boundary=")
    assert parts[0].get_content_type() == "application/octet-stream" and payload(parts[0]) == b""
    assert [p.get_content_type() for p in parts[1:]] == ["application/json"] * 3
    assert [payload(p) for p in parts[1:]] == [b'{"a":1}', b'{"b":[1,2]}', b'"three"']


async def test_bootstrap_of_binary_messages_keeps_their_bytes(session: aiohttp.ClientSession, base: str) -> None:
    url = stream_url(base)
    await create(session, url, "application/octet-stream")
    bodies = [bytes(range(256)), b"\r\n--ds3-\r\n\r\n", b"\x00", b"line one\r\nline two\r\n"]
    for b in bodies:
        await append(session, url, b, "application/octet-stream")
    _r, parts = await bootstrap(session, url)
    assert [payload(p) for p in parts[1:]] == bodies
    assert all(p.get_content_type() == "application/octet-stream" for p in parts[1:])


async def test_bootstrap_rejects_live_and_unknown_streams(session: aiohttp.ClientSession, base: str) -> None:
    url = stream_url(base)
    await create(session, url, "text/plain")
    for live in ("sse", "long-poll"):
        r = await call(session, "GET", f"{url}/bootstrap?live={live}")
        assert r.status == 400, live
    assert (await call(session, "GET", f"{stream_url(base)}/bootstrap")).status == 404
    assert (await call(session, "POST", f"{url}/bootstrap", b"x", {"Content-Type": "text/plain"})).status == 405
    assert (await call(session, "PUT", f"{url}/snapshot", b"x")).status == 405


async def test_bootstrap_of_a_closed_stream_says_closed(session: aiohttp.ClientSession, base: str) -> None:
    url = stream_url(base)
    await create(session, url, "text/plain")
    await append(session, url, b"only", "text/plain")
    async with session.post(url, headers={"Stream-Closed": "true"}) as resp:
        assert resp.status == 204
    r, parts = await bootstrap(session, url)
    assert r.headers.get("Stream-Closed") == "true"
    assert [payload(p) for p in parts[1:]] == [b"only"]


async def test_bootstrap_spans_sealed_chunks_and_the_unsealed_tail(
    session: aiohttp.ClientSession, cluster: Cluster
) -> None:
    """Through the reader, sealed messages come from S3 and the rest from the ingester; the
    parts are the same, in the same order, as the ingester's own bootstrap."""
    url = stream_url(cluster.reader.url)
    await create(session, url, "application/json")
    offs = await fill_json(session, url, 50)
    await sealed(cluster, url, 3)
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[4]}", b'{"n":5}', {"Content-Type": "application/json"})).status == 204
    more = await fill_json(session, url, 3, start=50)  # unsealed for now (seal age 0.3 s)
    via_reader, parts = await bootstrap(session, url)
    direct, direct_parts = await bootstrap(session, url.replace(cluster.reader.url, cluster.ingester.url))
    got = [json.loads(payload(p))["i"] for p in parts[1:]]
    assert got == list(range(5, 53))
    assert [payload(p) for p in parts] == [payload(p) for p in direct_parts]
    assert payload(parts[0]) == b'{"n":5}' and parts[0].get_content_type() == "application/json"
    assert via_reader.headers["Stream-Next-Offset"] == more[-1] == direct.headers["Stream-Next-Offset"]


async def test_client_gets_410_bootstraps_and_tails_without_loss_or_repeat(
    session: aiohttp.ClientSession, cluster: Cluster
) -> None:
    """The client flow of §3.4: a reader that fell behind the retention point rebuilds from
    /bootstrap and continues tailing from its Stream-Next-Offset while writers go on."""
    url = stream_url(cluster.reader.url)
    await create(session, url, "application/json")
    offs = await fill_json(session, url, 30)
    await sealed(cluster, url, 1)
    state = {"count": 20}  # the state the snapshot folds: messages 0..19
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[19]}", json.dumps(state).encode(),
                       {"Content-Type": "application/json"})).status == 204

    stale = await call(session, "GET", f"{url}?offset={offs[3]}")
    assert stale.status == 410
    assert stale.json()["earliest_offset"] == offs[19]

    writer_done = asyncio.Event()

    async def writer() -> None:
        for i in range(30, 60):
            await append(session, url, json.dumps(message(i)).encode(), "application/json")
            await asyncio.sleep(0.01)
        writer_done.set()

    task = asyncio.create_task(writer())
    r, parts = await bootstrap(session, url)
    assert json.loads(payload(parts[0])) == state
    seen = [json.loads(payload(p))["i"] for p in parts[1:]]
    offset = r.headers["Stream-Next-Offset"]
    while True:  # tail with long-poll until the writer is done and we have caught up
        async with session.get(url, params={"offset": offset, "live": "long-poll"}) as resp:
            assert resp.status in (200, 204), await resp.text()
            if resp.status == 200:
                seen += [m["i"] for m in json.loads(await resp.read())]
            offset = resp.headers["Stream-Next-Offset"]
            if writer_done.is_set() and resp.headers.get("Stream-Up-To-Date") == "true" and seen[-1] == 59:
                break
    await task
    assert seen == list(range(20, 60))


async def test_buckets_have_snapshots_and_bootstrap(session: aiohttp.ClientSession, base: str) -> None:
    bucket = f"snapbucket{next(_names)}"
    async with session.put(f"{base}/v1/buckets/{bucket}") as r:
        assert r.status == 201
    url = f"{base}/v1/buckets/{bucket}/events"
    await create(session, url, "application/json")
    offs = await fill_json(session, url, 4)
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[1]}", b"[]")).status == 204
    assert (await call(session, "HEAD", url)).headers["Stream-Snapshot-Offset"] == offs[1]
    latest = await call(session, "GET", f"{url}/snapshot")
    assert latest.status == 307 and latest.headers["Location"] == f"/v1/buckets/{bucket}/events/snapshot/{offs[1]}"
    assert (await call(session, "GET", f"{url}?offset=-1")).status == 410
    r, parts = await bootstrap(session, url)
    assert [json.loads(payload(p))["i"] for p in parts[1:]] == [2, 3]
    assert (await call(session, "GET", f"{base}/v1/buckets/{bucket}/nope/bootstrap")).status == 404


async def test_fork_inherits_the_snapshot_and_rejects_offsets_before_it(
    session: aiohttp.ClientSession, base: str
) -> None:
    url = stream_url(base)
    source_path = url.split(base, 1)[1]
    await create(session, url, "application/json")
    offs = await fill_json(session, url, 6)
    assert (await call(session, "PUT", f"{url}/snapshot/{offs[2]}", b'{"s":3}')).status == 204
    early = await call(session, "PUT", stream_url(base, "fork"), None, {
        "Content-Type": "application/json", "Stream-Forked-From": source_path, "Stream-Fork-Offset": offs[0]})
    assert early.status == 410 and early.json()["earliest_offset"] == offs[2]
    fork = stream_url(base, "fork")
    made = await call(session, "PUT", fork, None, {
        "Content-Type": "application/json", "Stream-Forked-From": source_path, "Stream-Fork-Offset": offs[4]})
    assert made.status == 201, made.body
    await append(session, fork, json.dumps(message(100)).encode(), "application/json")
    assert (await call(session, "HEAD", fork)).headers["Stream-Snapshot-Offset"] == offs[2]
    assert (await call(session, "GET", f"{fork}?offset=-1")).status == 410
    _r, parts = await bootstrap(session, fork)
    assert payload(parts[0]) == b'{"s":3}'
    assert [json.loads(payload(p))["i"] for p in parts[1:]] == [3, 4, 100]


async def test_snapshot_and_retention_survive_an_ingester_kill(
    s3_server: MotoS3, s3_bucket: str, tmp_path: Path
) -> None:
    with Cluster(tmp_path, StoreView.s3_store(s3_server, s3_bucket), seal_bytes=SEAL, seal_age=0.3) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            url = stream_url(c.reader.url)
            await create(session, url, "application/json")
            offs = await fill_json(session, url, 30)
            await sealed(c, url, 2)
            assert (await call(session, "PUT", f"{url}/snapshot/{offs[24]}", b"kept")).status == 204
            c.ingester.kill()
            c.ingester.start()
            c.reader.stop()
            c.reader.start()
            assert (await call(session, "HEAD", url)).headers["Stream-Snapshot-Offset"] == offs[24]
            assert (await call(session, "GET", f"{url}?offset=-1")).status == 410
            _r, parts = await bootstrap(session, url)
            assert payload(parts[0]) == b"kept"
            assert [json.loads(payload(p))["i"] for p in parts[1:]] == list(range(25, 30))


async def test_appends_are_not_blocked_while_a_snapshot_uploads(
    gated_s3: tuple[StoreView, TcpGate], tmp_path: Path
) -> None:
    store, gate = gated_s3
    with Cluster(tmp_path, store, seal_bytes=64 * 1024, ingester_endpoint=gate.url) as c:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            url = stream_url(c.ingester.url)
            await create(session, url, "application/json")
            offs = await fill_json(session, url, 3)
            gate.delay = 0.4  # each 64 KiB towards S3 waits: the 1 MiB upload takes seconds
            publish = asyncio.create_task(call(session, "PUT", f"{url}/snapshot/{offs[2]}", b"s" * (1024 * 1024)))
            await asyncio.sleep(0.3)
            acked = await fill_json(session, url, 5, start=3)  # during the upload
            assert not publish.done(), "the upload finished too soon to show anything"
            assert len(acked) == 5
            assert (await publish).status == 204
            gate.delay = 0
            _r, parts = await bootstrap(session, url)
            assert len(payload(parts[0])) == 1024 * 1024
            assert [json.loads(payload(p))["i"] for p in parts[1:]] == [3, 4, 5, 6, 7]
