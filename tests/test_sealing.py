"""Sealing chunks into the object store, end to end with real processes (issue 3, design §3-§5):

- a client paging from -1 while appends and seals continue reads every byte exactly once;
- an ingester SIGKILLed mid-upload and restarted loses nothing and leaves no partial or
  duplicate object; the backlog drains by itself;
- the object store going away under load: appends keep being acknowledged from the WAL (up to
  --wal-max-bytes, then 503 + Retry-After), and when the store is back the backlog drains;
- deleting a stream removes its objects, and a re-created path never serves old data;
- forks reference their source's sealed chunks instead of copying them.

"The store is down" is a TcpGate between the ingester and moto (tests/tcpgate.py): stopping
moto's threaded server would keep serving its open keep-alive connections. Readers talk to
moto directly. Appends go straight to the ingester where a test kills it (like test_crash.py),
reads go through the reader.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shared import offsets
from tests.cluster import (
    TIMEOUT,
    Cluster,
    StoreView,
    append,
    chunk_ends,
    create,
    get_page,
    position,
    read_pages,
    reader_metrics,
    sealed_end,
    wait_for,
)
from tests.tcpgate import TcpGate

OCTET = "application/octet-stream"
JSON = "application/json"
IMMUTABLE = "public, max-age=31536000, immutable"
SEALED = "ds3_reader_sealed_responses_total"
UPSTREAM = "ds3_reader_ingester_requests_total"
TAIL_CHECKS = "ds3_reader_tail_checks_total"  # asked at a last sealed page: does it end at the tail?
LINE = re.compile(rb"w(\d\d)-(\d{6})\.*")
SHORT = aiohttp.ClientTimeout(total=5)


def _store(request: pytest.FixtureRequest, tmp_path: Path, where: str) -> StoreView:
    if where == "s3":
        return StoreView.s3_store(request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"))
    return StoreView.local(tmp_path / "objects")


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreView:
    return _store(request, tmp_path, request.param)


# ---------------------------------------------------------------- writers that remember what was acked
@dataclass
class Writer:
    wid: int
    path: str
    json: bool
    pad: int = 40
    next_n: int = 0
    acked: list[int] = field(default_factory=list)
    uncertain: set[int] = field(default_factory=set)  # no answer: may or may not be persisted
    rejected: list[int] = field(default_factory=list)  # 503: must not be persisted
    retry_after: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)

    def body(self, n: int) -> bytes:
        if self.json:
            return json.dumps([{"w": self.wid, "n": n, "p": "." * self.pad}]).encode()
        return b"w%02d-%06d%s\n" % (self.wid, n, b"." * self.pad)

    @property
    def content_type(self) -> str:
        return JSON if self.json else OCTET


async def run_writer(
    session: aiohttp.ClientSession, base: str, w: Writer, stop: asyncio.Event, *, pause: float = 0.0,
    dying: asyncio.Event | None = None,
) -> None:
    """Append until `stop`; one request in flight. A request that gets no answer ends the
    writer (expected only once `dying` is set: the test is killing the ingester)."""
    url = f"{base}/v1/stream/{w.path}"
    while not stop.is_set():
        n = w.next_n
        try:
            async with session.post(url, data=w.body(n), headers={"Content-Type": w.content_type}) as r:
                await r.read()
                status, retry_after = r.status, r.headers.get("Retry-After")
        except (aiohttp.ClientError, TimeoutError) as e:
            w.uncertain.add(n)
            w.next_n = n + 1
            if dying is None or not dying.is_set():
                w.errors.append(f"w{w.wid:02d} #{n}: no answer while the ingester was up: {e!r}")
            return
        w.next_n = n + 1
        if status in (200, 204):
            w.acked.append(n)
        elif status == 503:
            w.rejected.append(n)
            w.retry_after.add(retry_after or "")
        else:
            w.errors.append(f"w{w.wid:02d} #{n}: HTTP {status}")
            return
        if pause:
            await asyncio.sleep(pause)


def numbers_in(data: bytes | list[Any], w: Writer) -> list[int]:
    """w's message numbers in the order the stream holds them."""
    if isinstance(data, list):
        return [m["n"] for m in data if m["w"] == w.wid]
    out = []
    for line in data.split(b"\n")[:-1]:
        m = LINE.fullmatch(line)
        assert m is not None, f"garbled line {line[:60]!r}"
        if int(m.group(1)) == w.wid:
            out.append(int(m.group(2)))
    return out


def check_exactly_once(data: bytes | list[Any], writers: list[Writer]) -> list[str]:
    """Every acked append present once, in ack order; uncertain ones at most once; nothing else."""
    errs = []
    if isinstance(data, bytes) and data and not data.endswith(b"\n"):
        errs.append(f"torn last line {data[-40:]!r}")
    for w in writers:
        present = numbers_in(data, w)
        counts = Counter(present)
        if dups := sorted(n for n, k in counts.items() if k > 1):
            errs.append(f"w{w.wid:02d}: duplicated {dups[:10]}")
        if lost := [n for n in w.acked if n not in counts]:
            errs.append(f"w{w.wid:02d}: lost {len(lost)} acknowledged appends {lost[:10]}")
        if phantom := sorted(set(present) - set(w.acked) - w.uncertain):
            errs.append(f"w{w.wid:02d}: appends never acknowledged (503 or never sent) present: {phantom[:10]}")
        acked = set(w.acked)
        if [n for n in present if n in acked] != w.acked and not errs:
            errs.append(f"w{w.wid:02d}: acknowledged appends out of order")
    return errs


async def read_stream(session: aiohttp.ClientSession, url: str, is_json: bool) -> bytes | list[Any]:
    pages = await read_pages(session, url)
    if is_json:
        return [m for p in pages for m in json.loads(p.body)]
    return b"".join(p.body for p in pages)


async def tail_position(session: aiohttp.ClientSession, url: str) -> int:
    async with session.head(url) as r:
        assert r.status == 200, f"HEAD {url}: {r.status}"
        return position(r.headers["Stream-Next-Offset"])


def check_chunk_objects(store: StoreView, uid: str, path: str, data: bytes | list[Any]) -> list[str]:
    """Every chunk object of the stream decodes and names its own key; the objects are a
    gap-free, overlap-free run from chunk 0 whose content is the start of the stream as read
    through the reader (bytes, or JSON messages)."""
    errs = []
    expected_pos = 0
    messages: list[Any] = []
    objects = store.chunk_objects(uid)  # a partial object fails to decode here
    first = objects[0][1].header.chunk if objects else 0  # random per stream; then +1 per chunk
    for i, (key, head, records) in enumerate(objects):
        h = head.header
        if int(key.rsplit("/", 1)[1]) != h.chunk or h.chunk != first + i:
            errs.append(f"{path}: object {key} holds chunk {h.chunk}, expected {first + i}")
        if h.path != path:
            errs.append(f"{path}: chunk {h.chunk} names path {h.path!r}")
        if h.start != expected_pos:
            errs.append(f"{path}: chunk {h.chunk} starts at {h.start}, the previous ended at {expected_pos}")
        expected_pos = h.end
        body = b"".join(r.data for r in records)
        if len(body) != h.end - h.start:
            errs.append(f"{path}: chunk {h.chunk} holds {len(body)} bytes for [{h.start}, {h.end})")
        if isinstance(data, bytes):
            if data[h.start : h.end] != body:
                errs.append(f"{path}: chunk {h.chunk} [{h.start}, {h.end}) differs from the stream's bytes")
        else:
            messages += [json.loads(r.data.rstrip(b",")) for r in records]
    if isinstance(data, list) and data[: len(messages)] != messages:
        errs.append(f"{path}: the chunks' {len(messages)} messages are not the stream's first ones")
    return errs


# ---------------------------------------------------------------- 2. reads across seals happening mid-read
@pytest.mark.slow
@pytest.mark.parametrize("where,kind", [("file", "bytes"), ("file", "json"), ("s3", "bytes")])
async def test_paging_reader_sees_every_byte_once_across_seals(
    tmp_path: Path, request: pytest.FixtureRequest, where: str, kind: str
) -> None:
    store = _store(request, tmp_path, where)
    is_json = kind == "json"
    ctype = JSON if is_json else OCTET
    rng = random.Random(2)
    with Cluster(tmp_path, store, seal_bytes=1024, seal_age=0.2) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            await create(s, f"{c.ingester.url}/v1/stream/mid", ctype)
            url = f"{c.reader.url}/v1/stream/mid"
            sent: list[Any] = []
            sent_bytes: list[bytes] = []
            done = asyncio.Event()
            final: list[str] = []

            async def writer() -> None:
                for i in range(80):
                    if is_json:
                        msgs = [{"i": i, "k": k, "pad": "x" * rng.randint(0, 120)} for k in range(rng.randint(1, 3))]
                        sent.extend(msgs)
                        body = json.dumps(msgs).encode()
                    else:
                        body = b"%05d:" % i + bytes(rng.randrange(65, 91) for _ in range(rng.randint(1, 200)))
                        sent_bytes.append(body)
                    tail = await append(s, f"{c.ingester.url}/v1/stream/mid", body, ctype)
                    await asyncio.sleep(rng.choice((0, 0.005, 0.02)))
                final.append(tail)
                done.set()

            w = asyncio.create_task(writer())
            got: list[Any] = []
            got_bytes: list[bytes] = []
            offset, last_pos, polls = "-1", -1, 0
            sealed_pages = 0
            pauses = random.Random(22)
            while not (done.is_set() and offset == final[0]):
                polls += 1
                assert polls < 5000, "the reader did not catch up with the writer"
                caught_up = offset != "-1" and not done.is_set() and polls % 2 == 0
                p = await get_page(s, url, offset, params={"live": "long-poll"} if caught_up else None)
                assert p.status in (200, 204), (offset, p.status, p.body[:200])
                nxt = p.next_offset
                assert position(nxt) >= max(last_pos, 0) and nxt >= offset, f"offset went back: {offset} -> {nxt}"
                if p.status == 200:
                    if p.body not in (b"", b"[]"):
                        assert position(nxt) > last_pos, f"data without progress at {offset}"
                    if p.headers.get("Cache-Control") == IMMUTABLE:
                        sealed_pages += 1
                    if is_json:
                        page = json.loads(p.body)  # every response is a whole JSON array
                        assert isinstance(page, list)
                        got.extend(page)
                    else:
                        got_bytes.append(p.body)
                last_pos, offset = position(nxt), nxt
                # now and then fall behind, so that what is left to read gets sealed meanwhile;
                # once for longer than the reader remembers chunks missing from the store
                # (--descriptor-ttl, 1 s), so that a page certainly comes from a sealed chunk
                await asyncio.sleep(2.0 if polls == 3 else pauses.choice((0, 0, 0, 0, 0, 0.05, 0.25)))
            await w
            if is_json:
                assert got == sent
            else:
                assert b"".join(got_bytes) == b"".join(sent_bytes)
            m = reader_metrics(c.reader.url)
            assert sealed_pages > 0 and m[SEALED] > 0, "no read was served from a sealed chunk"
            assert m[UPSTREAM] > 0
            # Once everything is sealed, the same history reads back identically from the store.
            uid = store.uid("mid")
            total = position(final[0])
            wait_for(lambda: sealed_end(store, uid) == total, 15, "the whole stream sealed")
            again = await read_stream(s, url, is_json)
            assert again == (sent if is_json else b"".join(sent_bytes))


# ---------------------------------------------------------------- 4. ingester killed mid-upload
@pytest.mark.slow
@pytest.mark.parametrize("how", ["s3-slow-uploads", "file-heavy-sealing"])
async def test_ingester_killed_mid_upload_loses_nothing(
    tmp_path: Path, how: str, request: pytest.FixtureRequest
) -> None:
    gate: TcpGate | None = None
    if how.startswith("s3"):
        store, gate = request.getfixturevalue("gated_s3")
        gate.delay = 0.15  # every piece towards S3 waits: uploads pile up in flight
        endpoint: str | None = gate.url
    else:
        store, endpoint = StoreView.local(tmp_path / "objects"), None
    writers = [Writer(i, f"k{i % 3}", json=(i % 3 == 2), pad=30 + 20 * (i % 4)) for i in range(9)]
    paths = sorted({w.path for w in writers})
    c = Cluster(tmp_path, store, seal_bytes=4096, seal_age=0.5, ingester_endpoint=endpoint,
                ingester_args=["--uploads", "2"] if gate else [])
    with c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            for p in paths:
                await create(s, f"{c.ingester.url}/v1/stream/{p}", JSON if p == "k2" else OCTET)
            stop, dying = asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(run_writer(s, c.ingester.url, w, stop, dying=dying)) for w in writers]
            await asyncio.sleep(0.8)
            chunks_before_kill = len(store.chunk_keys())
            acked_bytes = {p: sum(len(w.body(0)) * len(w.acked) for w in writers if w.path == p) for p in paths}
            dying.set()
            await asyncio.to_thread(c.ingester.kill)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 15)
            assert not [e for w in writers for e in w.errors]
            assert sum(len(w.acked) for w in writers) > 100
            rolled = sum(n // 4096 for n in acked_bytes.values())  # at least this many chunks rolled
            if gate is not None:
                assert chunks_before_kill < rolled, "no upload backlog at the kill: uploads were not slow"
            # Whatever is visible right after the kill is whole.
            for uid in {k.split("/")[2] for k in store.chunk_keys()}:
                store.decoded_chunks(uid)

            if gate is not None:
                gate.delay = 0.0
            c.ingester.start()
            # Readers find a stream through its descriptor: one the kill kept from being
            # published must still be published after the restart.
            uids = {p: wait_for(lambda p=p: store.descriptor(p), 10,
                                f"{p}'s descriptor in the store after the restart")["uid"] for p in paths}
            for p in paths:  # chunks + the WAL's tail are the stream, also before the drain
                data = await read_stream(s, f"{c.reader.url}/v1/stream/{p}", p == "k2")
                errs = check_exactly_once(data, [w for w in writers if w.path == p])
                errs += check_chunk_objects(store, uids[p], p, data)
                assert not errs, "\n".join(errs[:30])
            for p in paths:
                tail = await tail_position(s, f"{c.ingester.url}/v1/stream/{p}")
                wait_for(lambda p=p, tail=tail: sealed_end(store, uids[p]) == tail, 30,
                         f"{p}'s backlog drained into the store")
            before = reader_metrics(c.reader.url)
            for p in paths:
                data = await read_stream(s, f"{c.reader.url}/v1/stream/{p}", p == "k2")
                errs = [f"{p}: {e}" for e in check_exactly_once(data, [w for w in writers if w.path == p])]
                errs += check_chunk_objects(store, uids[p], p, data)
                n_sealed = sum(len(r) for _, r in store.decoded_chunks(uids[p]))
                if isinstance(data, list):
                    assert n_sealed == len(data), f"{p}: {n_sealed} sealed messages of {len(data)}"
                assert not errs, "\n".join(errs[:30])
            after = reader_metrics(c.reader.url)
            # drained: history comes from the store; the ingester is asked, per stream, whether the
            # last sealed page is the tail and, unless it said so in time, for the tail page
            checks = after[TAIL_CHECKS] - before[TAIL_CHECKS]
            assert checks <= len(paths)
            assert after[UPSTREAM] - before[UPSTREAM] - checks <= len(paths)
            chunk_uids = {k.split("/")[2] for k in store.chunk_keys()}
            assert chunk_uids == set(uids.values()), "chunk objects of streams that do not exist"
            print(f"{how}: {sum(len(w.acked) for w in writers)} acks, "
                  f"{sum(len(w.uncertain) for w in writers)} unanswered at the kill, "
                  f"{chunks_before_kill} chunks before the kill, {len(store.chunk_keys())} after the drain")


# ---------------------------------------------------------------- 5. the object store down under load
@pytest.mark.slow
async def test_store_down_under_load_then_back(gated_s3: tuple[StoreView, TcpGate], tmp_path: Path) -> None:
    store, gate = gated_s3
    writers = [Writer(i, f"s{i % 2}", json=False, pad=60) for i in range(4)]
    paths = sorted({w.path for w in writers})
    with Cluster(tmp_path, store, seal_bytes=4096, seal_age=0.3, ingester_endpoint=gate.url) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            for p in paths:
                await create(s, f"{c.ingester.url}/v1/stream/{p}", OCTET)
            uids = {p: wait_for(lambda p=p: store.descriptor(p), 10, "descriptor")["uid"]
                    for p in paths}
            stop = asyncio.Event()
            tasks = [asyncio.create_task(run_writer(s, c.ingester.url, w, stop, pause=0.01)) for w in writers]
            await asyncio.sleep(0.8)
            assert store.chunk_keys(), "nothing sealed before the store went down"
            gate.down()
            acks_at_down = sum(len(w.acked) for w in writers)
            await asyncio.sleep(0.3)  # uploads that were already through may still land
            keys_down = store.chunk_keys()
            await asyncio.sleep(1.2)
            assert store.chunk_keys() == keys_down, "objects appeared while the store was unreachable"
            acks_while_down = sum(len(w.acked) for w in writers) - acks_at_down
            assert acks_while_down > 50, f"only {acks_while_down} appends acknowledged while the store was down"
            assert not [e for w in writers for e in w.errors], [e for w in writers for e in w.errors]
            # Reads of what only the WAL holds still work through the reader meanwhile.
            acked_now = {w.wid: list(w.acked) for w in writers if w.path == "s0"}
            mid = await read_stream(s, f"{c.reader.url}/v1/stream/s0", False)
            for wid, acked in acked_now.items():
                present = numbers_in(mid, writers[wid])
                assert present[: len(acked)] == acked, f"w{wid:02d}: acknowledged appends unreadable while down"
            gate.up()
            t_up = time.monotonic()
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 15)
            assert not [e for w in writers for e in w.errors]
            assert not any(w.rejected for w in writers), "503 with the default --wal-max-bytes"
            for p in paths:
                tail = await tail_position(s, f"{c.ingester.url}/v1/stream/{p}")
                wait_for(lambda p=p, tail=tail: sealed_end(store, uids[p]) == tail, 30,
                         f"{p}'s backlog drained after the store came back")
            drained_in = time.monotonic() - t_up
            assert len(store.chunk_keys()) > len(keys_down)
            # The reader remembers for --descriptor-ttl (1 s) that the chunks it looked for while
            # the store was down were missing, and passes reads there to the ingester meanwhile.
            await asyncio.sleep(1.1)
            before = reader_metrics(c.reader.url)
            errs: list[str] = []
            for p in paths:
                url = f"{c.reader.url}/v1/stream/{p}"
                pages = await read_pages(s, url)
                data = b"".join(pg.body for pg in pages)
                errs += [f"{p}: {e}" for e in check_exactly_once(data, [w for w in writers if w.path == p])]
                errs += check_chunk_objects(store, uids[p], p, data)
            after = reader_metrics(c.reader.url)
            assert not errs, "\n".join(errs[:30])
            # The WAL gave everything up: only the tail page of each stream asks the ingester (and
            # whether the last sealed page is the tail).
            checks = after[TAIL_CHECKS] - before[TAIL_CHECKS]
            assert checks <= len(paths)
            assert after[UPSTREAM] - before[UPSTREAM] - checks <= len(paths)
            print(f"{sum(len(w.acked) for w in writers)} acks, {acks_while_down} while the store was down; "
                  f"drained {drained_in:.1f}s after it came back")


@pytest.mark.slow
async def test_full_wal_answers_503_until_the_store_is_back(
    gated_s3: tuple[StoreView, TcpGate], tmp_path: Path
) -> None:
    store, gate = gated_s3
    seal = 2048
    # The limit counts LMDB pages (branch pages and half-full leaves included), so it is set well
    # above what the test's single writer keeps unsealed while the store is up.
    with Cluster(tmp_path, store, seal_bytes=seal, seal_age=0.3, ingester_endpoint=gate.url,
                 ingester_args=["--wal-max-bytes", str(24 * seal)]) as c:
        async with aiohttp.ClientSession(timeout=SHORT) as s:
            url = f"{c.reader.url}/v1/stream/full"  # writes through the reader: one URL serves all
            await create(s, url, OCTET)
            w = Writer(0, "full", json=False, pad=500)
            for n in range(10):  # while the store is up, appends flow
                w.next_n = n
                await append(s, url, w.body(n), OCTET)
                w.acked.append(n)
            w.next_n = 10
            gate.down()
            for _ in range(300):
                n = w.next_n
                w.next_n += 1
                async with s.post(url, data=w.body(n), headers={"Content-Type": OCTET}) as r:
                    await r.read()
                    if r.status == 503:
                        w.rejected.append(n)
                        w.retry_after.add(r.headers.get("Retry-After", ""))
                        break
                    assert r.status == 204, r.status
                    w.acked.append(n)
            assert w.rejected, "the WAL never filled up"
            assert all(ra.isdigit() and int(ra) >= 1 for ra in w.retry_after), w.retry_after
            acked_down = len(w.acked) - 10
            assert acked_down >= 5, "appends were refused as soon as the store went down"
            # Still full: another append gets 503 too; reads keep working.
            n = w.next_n
            w.next_n += 1
            async with s.post(url, data=w.body(n), headers={"Content-Type": OCTET}) as r:
                assert r.status == 503 and r.headers.get("Retry-After", "").isdigit()
                w.rejected.append(n)
            assert not check_exactly_once(await read_stream(s, url, False), [w])

            gate.up()
            t_up = time.monotonic()
            deadline = t_up + 30
            await _append_until_accepted(s, url, w, deadline, "appends still refused 30 s after the store came back")
            recovered = time.monotonic() - t_up
            # The limit counts LMDB pages, and while the uploader drains the backlog a page may
            # come and go (half-full leaves after deletes, the journal's page): a refusal then is
            # still a clean 503 with Retry-After, the append stored nothing, and the client's retry
            # goes through once the backlog is sealed.
            flaps = 0
            for _ in range(20):
                retry_after = await _append_until_accepted(
                    s, url, w, deadline, "appends refused again for good after the store came back")
                assert all(ra.isdigit() for ra in retry_after), retry_after
                flaps += len(retry_after)
            data = await read_stream(s, url, False)
            assert not check_exactly_once(data, [w]), check_exactly_once(data, [w])
            print(f"{acked_down} appends acknowledged while the store was down before the first 503; "
                  f"appends accepted again {recovered:.1f}s after it came back ({flaps} refused while it drained)")


async def _append_until_accepted(
    s: aiohttp.ClientSession, url: str, w: Writer, deadline: float, why: str
) -> list[str]:
    """Append `w`'s next lines until one is acknowledged, retrying 503s every 0.2 s until
    `deadline`; the Retry-After of each refusal."""
    refused: list[str] = []
    while True:
        n = w.next_n
        w.next_n += 1
        async with s.post(url, data=w.body(n), headers={"Content-Type": OCTET}) as r:
            await r.read()
            if r.status == 204:
                w.acked.append(n)
                return refused
            assert r.status == 503, r.status
            w.rejected.append(n)
            refused.append(r.headers.get("Retry-After", ""))
        assert time.monotonic() < deadline, why
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------- 7. delete
async def test_delete_removes_objects_and_a_recreated_path_never_serves_old_data(
    tmp_path: Path, store: StoreView
) -> None:
    old = [b"OLD%04d" % i + b"o" * 200 for i in range(25)]
    new = [b"NEW%04d" % i + b"n" * 150 for i in range(20)]
    with Cluster(tmp_path, store, seal_bytes=1024) as c:
        async with aiohttp.ClientSession(timeout=SHORT) as s:
            ing, url = f"{c.ingester.url}/v1/stream/d", f"{c.reader.url}/v1/stream/d"
            await create(s, ing, OCTET)
            for b in old:
                await append(s, ing, b, OCTET)
            ends = chunk_ends([len(b) for b in old], 1024)
            uid = wait_for(lambda: store.descriptor("d"), 10, "descriptor")["uid"]
            wait_for(lambda: sealed_end(store, uid) == ends[-1], 15, "old chunks sealed")
            pages = await read_pages(s, url)  # warm the reader's descriptor and chunk caches
            assert b"".join(p.body for p in pages) == b"".join(old)
            old_offsets = [p.offset for p in pages[1:]]

            async with s.delete(url) as r:
                assert r.status == 204
            gone = await get_page(s, url, "-1")
            assert gone.status == 404, (gone.status, gone.body[:100])
            for off in old_offsets[:3]:
                assert (await get_page(s, url, off)).status == 404
            wait_for(lambda: not store.chunk_keys(uid), 15, "the deleted stream's chunk objects removed")
            wait_for(lambda: store.descriptor("d") is None, 15, "the deleted stream's descriptor removed")

            # The same path again, written through the reader.
            await create(s, url, OCTET)
            for b in new:
                await append(s, url, b, OCTET)
            new_ends = chunk_ends([len(b) for b in new], 1024)
            uid2 = wait_for(lambda: (store.descriptor("d") or {}).get("uid"), 10, "new descriptor")
            assert uid2 != uid
            wait_for(lambda: sealed_end(store, uid2) == new_ends[-1], 15, "new chunks sealed")
            data = b"".join(p.body for p in await read_pages(s, url))
            assert data == b"".join(new)
            for off in old_offsets:  # offsets issued for the old stream: never old bytes
                p = await get_page(s, url, off)
                assert b"OLD" not in p.body, (off, p.status, p.body[:60])
                if p.status == 200 and position(off) <= len(data):
                    assert p.body == data[position(off) : position(p.next_offset)]
            # A fresh reader (cold caches) agrees.
            from tests.procs import reader as reader_proc

            other = reader_proc(tmp_path / "reader2", c.ingester.url, store.url, *store.server_args()[2:])
            other.start()
            try:
                data2 = b"".join(p.body for p in await read_pages(s, f"{other.url}/v1/stream/d"))
            finally:
                other.stop()
            assert data2 == b"".join(new)


async def test_a_reader_with_a_warm_cache_never_serves_a_recreated_paths_old_data(tmp_path: Path) -> None:
    """Two readers: B has the old stream's descriptor cached when A deletes and re-creates the path."""
    store = StoreView.local(tmp_path / "objects")
    old = [b"OLD%04d" % i + b"o" * 200 for i in range(25)]
    with Cluster(tmp_path, store, seal_bytes=1024, reader_args=["--descriptor-ttl", "5"]) as c:
        from tests.procs import reader as reader_proc

        b_proc = reader_proc(tmp_path / "reader-b", c.ingester.url, store.url, *store.server_args()[2:],
                             "--descriptor-ttl", "5")
        b_proc.start()
        try:
            async with aiohttp.ClientSession(timeout=SHORT) as s:
                ing = f"{c.ingester.url}/v1/stream/r"
                await create(s, ing, OCTET)
                for b in old:
                    await append(s, ing, b, OCTET)
                ends = chunk_ends([len(b) for b in old], 1024)
                uid = wait_for(lambda: store.descriptor("r"), 10, "descriptor")["uid"]
                wait_for(lambda: sealed_end(store, uid) == ends[-1], 15, "old chunks sealed")
                b_url = f"{b_proc.url}/v1/stream/r"
                assert b"".join(p.body for p in await read_pages(s, b_url)) == b"".join(old)
                async with s.delete(f"{c.reader.url}/v1/stream/r") as r:
                    assert r.status == 204
                await create(s, f"{c.reader.url}/v1/stream/r", OCTET)
                await append(s, f"{c.reader.url}/v1/stream/r", b"fresh", OCTET)
                p = await get_page(s, b_url, "-1")
                assert b"OLD" not in p.body, f"reader B served the deleted stream's bytes: HTTP {p.status}"
                assert p.status == 200 and p.body == b"fresh"
        finally:
            b_proc.stop()


# ---------------------------------------------------------------- 8. forks
async def test_forks_reference_their_sources_sealed_chunks(tmp_path: Path, store: StoreView) -> None:
    src_bodies = [b"S%03d" % i + b"s" * 180 for i in range(30)]
    own = [b"F%03d" % i + b"f" * 150 for i in range(12)]
    with Cluster(tmp_path, store, seal_bytes=1024) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            ing = f"{c.ingester.url}/v1/stream/"
            await create(s, ing + "src", OCTET)
            for b in src_bodies:
                await append(s, ing + "src", b, OCTET)
            src = b"".join(src_bodies)
            ends = chunk_ends([len(b) for b in src_bodies], 1024)
            src_uid = wait_for(lambda: store.descriptor("src"), 10, "descriptor")["uid"]
            wait_for(lambda: sealed_end(store, src_uid) == ends[-1], 15, "source sealed")
            src_keys = store.chunk_keys(src_uid)
            first = store.decoded_chunks(src_uid)[0][0].header.chunk
            # Fork inside chunk 2 (not on a boundary), through the reader.
            k = 2
            fork_pos = (ends[k - 1] + ends[k]) // 2
            url = f"{c.reader.url}/v1/stream/"
            async with s.put(url + "fork", headers={
                "Content-Type": OCTET, "Stream-Forked-From": "/v1/stream/src",
                "Stream-Fork-Offset": offsets.encode(first + k, fork_pos),
            }) as r:
                assert r.status == 201, (r.status, await r.text())
            for b in own:
                await append(s, url + "fork", b, OCTET)
            fork_uid = wait_for(lambda: (store.descriptor("fork") or {}).get("uid"), 10, "fork descriptor")
            own_ends = chunk_ends([len(b) for b in own], 1024, start=fork_pos)
            wait_for(lambda: sealed_end(store, fork_uid) == own_ends[-1], 15, "the fork's own chunks sealed")

            heads = [h.header for h, _ in store.decoded_chunks(fork_uid)]
            assert heads[0].start == fork_pos, "the fork's first chunk object does not start at the fork point"
            assert all(h.chunk > first + k for h in heads), "fork chunk ids must sort after the inherited ones"
            assert store.chunk_keys(src_uid) == src_keys, "the source's chunks changed"
            copied = sum(h.end - h.start for h in heads if h.start < fork_pos)
            assert copied == 0, f"{copied} inherited bytes copied into the fork's objects"

            expected = src[:fork_pos] + b"".join(own)
            before = reader_metrics(c.reader.url)
            pages, offset = [], "-1"
            while not pages or position(pages[-1].next_offset) < own_ends[-1]:
                p = await get_page(s, url + "fork", offset)
                assert p.status == 200, (offset, p.status, p.body[:100])
                if offset != "-1":  # the start URL is not immutable (a re-created path keeps it)
                    assert p.headers["Cache-Control"] == IMMUTABLE, f"page at {offset} not served sealed"
                pages.append(p)
                offset = p.next_offset
            assert b"".join(p.body for p in pages) == expected[: own_ends[-1]]
            boundary = [position(p.next_offset) for p in pages]
            # (a page reaching the fork point goes on into the fork's own first chunk)
            assert fork_pos not in boundary, f"a page ends at the fork point {fork_pos}: {boundary}"
            assert boundary[:k + 1] == [*ends[:k], own_ends[0]]
            after = reader_metrics(c.reader.url)
            # (but for whether the last sealed page is the tail: that is the ingester's to say)
            assert after[TAIL_CHECKS] - before[TAIL_CHECKS] <= 1
            assert after[UPSTREAM] - before[UPSTREAM] == after[TAIL_CHECKS] - before[TAIL_CHECKS], \
                "reading sealed fork history asked the ingester"
            # Inside the inherited part, just before the fork point, and the tail.
            p = await get_page(s, url + "fork", offsets.encode(first + k, fork_pos - 10))
            assert p.status == 200 and p.body == expected[fork_pos - 10 : own_ends[0]]
            assert position(p.next_offset) == own_ends[0]
            whole = b"".join(p.body for p in await read_pages(s, url + "fork"))
            assert whole == expected
            assert b"".join(p.body for p in await read_pages(s, url + "src")) == src
            # A second fork exactly at a chunk boundary of the source.
            async with s.put(url + "fork2", headers={
                "Content-Type": OCTET, "Stream-Forked-From": "/v1/stream/src",
                "Stream-Fork-Offset": offsets.encode(first + 1, ends[1]),
            }) as r:
                assert r.status == 201, (r.status, await r.text())
            await append(s, url + "fork2", b"-two", OCTET)
            assert b"".join(p.body for p in await read_pages(s, url + "fork2")) == src[: ends[1]] + b"-two"
            fork2_uid = wait_for(lambda: (store.descriptor("fork2") or {}).get("uid"), 10, "fork2 descriptor")
            assert not store.chunk_keys(fork2_uid)
