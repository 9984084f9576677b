"""The group committer when LMDB fails: a commit that does not happen changes nothing, not
even what the event loop does after a commit (no objects deleted for a delete that failed)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import aiohttp
import lmdb
import pytest

from ingester.writes import AppendRequest, SealPolicy
from shared.config import MiB
from shared.errors import Unavailable
from tests.procs import ingester
from tests.wal_harness import Clock, FailingCommits, Harness


async def test_a_delete_whose_commit_fails_deletes_no_objects(tmp_path: Path, clock: Clock) -> None:
    """Before: the batch's news (here: the deleted stream's objects to remove) reached
    on_durable although the commit failed, and the GC loop deleted the sealed chunks of a
    stream that still exists."""
    h = Harness(tmp_path / "wal", clock, loop=asyncio.get_running_loop(), seal=SealPolicy(1024, 60.0, 64 * MiB))
    try:
        h.create("s")
        h.append("s", b"kept")
        meta = h.meta("s")
        assert meta is not None
        real = h.wal.env
        h.wal.env = FailingCommits(real)  # type: ignore[assignment]
        with pytest.raises(Unavailable, match="the data dir's disk may be full or failing"):  # (it said only "failed")
            await h.committer.submit(lambda txn: h.store.delete(txn, "s"))
        h.wal.env = real
        await h.committer.submit(lambda txn: h.store.append(txn, AppendRequest("s", "text/plain", b"+more", None)))  # a commit that works
        removed = [r for news in h.durable for r in news.removed]
        assert removed == [], "objects queued for deletion by a delete that was never committed"
        after = h.meta("s")
        assert after is not None and after.uid == meta.uid
        assert h.contents("s") == b"kept+more"
        await h.committer.submit(lambda txn: h.store.delete(txn, "s"))  # and a real delete still works
        assert [r for news in h.durable for r in news.removed] == [(meta.uid, "s")]
    finally:
        h.close()


async def test_a_full_map_refuses_writes_cleanly_and_loses_nothing(tmp_path: Path) -> None:
    """A real ingester on the smallest map (16 MiB, no object store: the WAL keeps it all),
    filled by appends. Before: MapFullError inside an operation aborted the batch with a
    traceback per operation, reran it once per operation, and the answer said "internal
    error" (the setting to raise was never named). Now each refused write is a 503 with
    Retry-After naming --wal-map-size, the log says so once, and every acknowledged append
    is stored."""
    p = ingester(tmp_path / "data", "--wal-map-size", str(16 * MiB), "--write-rate", "0", "--log-level", "info")
    p.start()
    try:
        url = p.url + "/v1/stream/full"
        text = {"Content-Type": "application/octet-stream"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.put(url, headers=text) as r:
                assert r.status == 201
            kept: list[bytes] = []
            refused: list[tuple[int, str, str]] = []

            async def append(body: bytes) -> None:
                async with s.post(url, data=body, headers=text) as r:
                    if r.status in (200, 204):
                        kept.append(body)
                    else:
                        refused.append((r.status, r.headers.get("Retry-After", ""), await r.text()))

            n = 0
            while not refused and n < 400:  # sequential appends until the map is full
                await append(bytes([65 + n % 26]) * 100_000 + n.to_bytes(4, "big"))
                n += 1
            assert refused, "16 MiB of map took 40 MB of appends"
            sequential = b"".join(kept)
            # a burst of concurrent writes into a full map: each answered cleanly
            await asyncio.gather(*(append(bytes([97 + i]) * 100_000) for i in range(20)))
            assert len(refused) >= 10
            for status, retry_after, message in refused:
                assert status == 503 and retry_after.isdigit(), (status, retry_after, message)
                assert "--wal-map-size" in message and "DS3_WAL_MAP_SIZE" in message, message
            stored, offset = b"", "-1"
            while True:  # every page of it
                async with s.get(url, params={"offset": offset}) as r:
                    assert r.status == 200
                    stored += await r.read()
                    offset = r.headers["Stream-Next-Offset"]
                    if r.headers.get("Stream-Up-To-Date") == "true":
                        break
            assert stored.startswith(sequential)
            assert len(stored) == sum(len(b) for b in kept), "acknowledged appends missing, or refused ones stored"
            assert all(b in stored for b in kept)
        log = p.log_path.read_text(errors="replace")
        assert log.count("--wal-map-size") == 1, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        p.stop()


async def test_outcomes_of_a_batch_that_ran_again_arrive_in_submission_order(tmp_path: Path, clock: Clock) -> None:
    """One operation of a batch fails unexpectedly: the batch runs again without it. Its
    refusal was delivered before the others' answers; a connection answering pipelined
    appends from these callbacks would answer out of order."""
    h = Harness(tmp_path / "wal", clock, loop=asyncio.get_running_loop())
    try:
        h.create("s")
        started, release = threading.Event(), threading.Event()

        def block(txn: lmdb.Transaction) -> None:
            started.set()
            release.wait(10)

        def broken(txn: lmdb.Transaction) -> None:
            raise RuntimeError("a bug in an operation")

        got: list[tuple[int, bool]] = []
        blocked = h.committer.submit(block)
        await asyncio.to_thread(started.wait, 10)
        for i in range(6):  # all queued behind the blocker: one batch
            op = broken if i == 3 else (lambda txn: h.store.append(txn, AppendRequest("s", "text/plain", b"x", None)))
            h.committer.submit_callback(op, lambda value, ok, i=i: got.append((i, ok)))
        last = h.committer.submit(lambda txn: None)
        release.set()
        await blocked
        await last
        assert got == [(0, True), (1, True), (2, True), (3, False), (4, True), (5, True)]
        assert h.contents("s") == b"xxxxx"
    finally:
        h.close()


def test_a_refusal_raised_again_and_again_does_not_grow(tmp_path: Path) -> None:
    """A fenced writer refuses every operation with one exception object: each raise added
    its frames to that object's traceback, so the retry loops' logged tracebacks (a fork-pin
    release every 5 s) grew without bound (found by QA: 22 to 107 lines in 30 s)."""
    h = Harness(tmp_path / "wal", Clock())
    try:
        h.committer.refusal = Unavailable("this ingester does not own its store prefix now", 1)
        depths = []
        for _ in range(5):
            try:
                h.committer.submit(lambda txn: None)
            except Unavailable as e:
                tb, depth = e.__traceback__, 0
                while tb is not None:
                    depth, tb = depth + 1, tb.tb_next
                depths.append(depth)
        assert len(set(depths)) == 1, depths
    finally:
        h.close()
