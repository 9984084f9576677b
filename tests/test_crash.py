"""Crash safety of the ingester: a SIGKILL at any moment loses no acknowledged append and creates no
duplicate, also for an idempotent producer that retries its in-flight request after the restart.

One ingester, one data dir, ROUNDS kill/restart cycles. Each round 16 concurrent writers (one aiohttp
session, one request in flight per writer) append self-identifying lines (`w07-000123\\n`) to four
own streams and one shared stream: half plain appends, half idempotent producers (Producer-Id /
Epoch / Seq). At a random moment mid-load the server's process group gets SIGKILL. After the restart:

  (a) every acknowledged append is present exactly once, in ack order per writer;
  (b) no line appears twice in any stream;
  (c) each producer retries its unanswered request with the same (id, epoch, seq): 200 if it had not
      been persisted, 204 if it had; either way the line is then present exactly once;
  (d) unanswered plain appends may or may not be present, never twice, and nothing that was never
      sent appears;
  (e) HEAD's Stream-Next-Offset equals the offset the catch-up read of all bytes ended at (for ds3
      also: its position part equals the number of bytes read), and the bytes read after a round
      start with the bytes read after the previous one (nothing already readable changes or goes).

Set DS3_CRASH_REFERENCE=<dir holding reference-server.mjs and its node_modules> (e.g. a copy of
shared/conformance after `npm install`) to run the same test against the Node reference server in
file-backed mode; DS3_CRASH_ROUNDS and DS3_CRASH_SEED override the round count and the random seed.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import aiohttp
import pytest

from tests.procs import Proc, free_port, ingester, reader

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("DS3_CRASH_ROUNDS", "8"))
LOAD_S = (0.1, 2.0)  # the kill comes at a uniformly random moment in this window after load starts
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=10)
CONTENT_TYPES = {
    "shared": "text/plain",
    "s0": "application/octet-stream",
    "s1": "text/plain",
    "s2": "application/octet-stream",
    "s3": "text/plain",
}
# (stream, idempotent producer?) per writer: the shared stream gets 3 plain + 3 producers, every own
# stream at least one of each.
WRITERS = [("shared", i % 2 == 1) for i in range(6)] + [
    ("s0", False), ("s0", True), ("s1", False), ("s1", True), ("s2", False),
    ("s2", True), ("s3", False), ("s3", True), ("s0", False), ("s1", True),
]
LINE = re.compile(rb"w(\d\d)-(\d{6})")
TAIL_POSITION = re.compile(r"\d+_(\d+)")  # ds3's offset shape: <chunk>_<byte position> (design.md §4)


class Server(Protocol):
    @property
    def url(self) -> str: ...

    def start(self, timeout: float = 20.0) -> object: ...

    def kill(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class ReferenceServer:
    """The Node reference server, file-backed, with the same start/kill/stop shape as procs.Proc."""

    home: Path
    data_dir: Path
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> ReferenceServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir.parent / f"reference-{self.port}.log", "ab")  # noqa: SIM115
        env = {**os.environ, "DS_DATA_DIR": str(self.data_dir), "DS_LONG_POLL_MS": "2000"}
        self.popen = subprocess.Popen(
            ["node", str(self.home / "reference-server.mjs"), str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, "reference server exited early"
            try:
                urllib.request.urlopen(f"{self.url}/__probe", timeout=1).close()
                return self
            except urllib.error.HTTPError:  # any HTTP answer means it is up
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"reference server not ready in {timeout}s")

    def kill(self) -> None:
        if self.popen and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Writer:
    wid: int
    stream: str
    producer: bool
    next_n: int = 0  # plain: next message number; producer: next Producer-Seq (== message number)
    acked: list[int] = field(default_factory=list)  # message numbers in the order they were acked
    uncertain: set[int] = field(default_factory=set)  # plain appends that got no answer
    pending: int | None = None  # producer: the seq whose request got no answer (retried after restart)
    retried: dict[int, int] = field(default_factory=dict)  # producer: seq -> HTTP status of its retry
    inflight: int | None = None

    def body(self, n: int) -> bytes:
        return b"w%02d-%06d\n" % (self.wid, n)

    def headers(self, n: int) -> dict[str, str]:
        h = {"Content-Type": CONTENT_TYPES[self.stream]}
        if self.producer:
            h |= {"Producer-Id": f"crash-w{self.wid:02d}", "Producer-Epoch": "0", "Producer-Seq": str(n)}
        return h


@dataclass
class Run:
    base: str
    writers: list[Writer]
    killing: bool = False
    errors: list[str] = field(default_factory=list)
    retry_status: Counter[int] = field(default_factory=Counter)
    contents: dict[str, bytes] = field(default_factory=lambda: dict.fromkeys(CONTENT_TYPES, b""))

    def url(self, stream: str) -> str:
        return f"{self.base}/v1/stream/crash-{quote(stream)}"


async def _writer(run: Run, session: aiohttp.ClientSession, w: Writer, stop: asyncio.Event) -> None:
    """Append until stopped or until the server dies under a request (one request in flight)."""
    url = run.url(w.stream)
    while not stop.is_set():
        n = w.next_n
        w.inflight = n
        try:
            async with session.post(url, data=w.body(n), headers=w.headers(n)) as r:
                await r.read()
                status, echoed = r.status, (r.headers.get("Producer-Epoch"), r.headers.get("Producer-Seq"))
            if status == 503 and run.killing:  # a reader in front: the ingester died under it
                raise aiohttp.ClientError("503 from the reader: its ingester is gone")
        except (aiohttp.ClientError, TimeoutError) as e:
            # No answer: the server may or may not have persisted this append.
            if w.producer:
                w.pending = n
            else:
                w.uncertain.add(n)
                w.next_n = n + 1
            if not run.killing:
                run.errors.append(f"w{w.wid:02d} #{n}: request failed while the server was up: {e!r}")
            return
        finally:
            w.inflight = None
        ok = status == 200 if w.producer else status in (200, 204)
        if not ok:
            run.errors.append(f"w{w.wid:02d} #{n} ({'producer' if w.producer else 'plain'}): HTTP {status}")
            return
        if w.producer and echoed != ("0", str(n)):
            run.errors.append(f"w{w.wid:02d} #{n}: 200 with Producer-Epoch/-Seq {echoed}, want ('0', '{n}')")
        w.acked.append(n)
        w.next_n = n + 1


async def _load_then_kill(run: Run, server: Server, rng: random.Random) -> tuple[int, int]:
    """Run all writers, SIGKILL the server mid-load; returns (acks this round, requests in flight)."""
    acked_before = sum(len(w.acked) for w in run.writers)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        tasks = [asyncio.create_task(_writer(run, session, w, stop)) for w in run.writers]
        await asyncio.sleep(rng.uniform(*LOAD_S))
        in_flight = sum(w.inflight is not None for w in run.writers)
        run.killing = True
        await asyncio.to_thread(server.kill)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    run.killing = False
    return sum(len(w.acked) for w in run.writers) - acked_before, in_flight


async def _read_all(session: aiohttp.ClientSession, url: str) -> tuple[bytes, str]:
    """Catch-up read from the start until Stream-Up-To-Date; returns (bytes, final next offset)."""
    offset, chunks = "-1", []
    for _ in range(100_000):
        async with session.get(url, params={"offset": offset}) as r:
            assert r.status == 200, f"GET {url}?offset={offset}: HTTP {r.status}"
            body = await r.read()
            nxt = r.headers["Stream-Next-Offset"]
            up_to_date = r.headers.get("Stream-Up-To-Date", "").lower() == "true"
        chunks.append(body)
        if up_to_date:
            return b"".join(chunks), nxt
        assert body and nxt != offset, f"catch-up read of {url} makes no progress at offset {offset}"
        offset = nxt
    raise AssertionError(f"catch-up read of {url} did not reach the tail")


def _check_stream(run: Run, stream: str, data: bytes, byte_positions: bool, tail: str) -> list[str]:
    """The content checks (a), (b), (d), (e) for one stream; returns the violations found."""
    errs: list[str] = []
    previous = run.contents[stream]
    if not data.startswith(previous):
        errs.append(f"{stream}: content read earlier changed or vanished ({len(previous)} -> {len(data)} B)")
    if byte_positions:
        pos = TAIL_POSITION.fullmatch(tail)
        if pos is None or int(pos.group(1)) != len(data):
            errs.append(f"{stream}: tail offset {tail} does not name position {len(data)}, the bytes read (e)")
    if data and not data.endswith(b"\n"):
        errs.append(f"{stream}: ends in a torn line {data[-30:]!r}")
    seen: dict[int, list[int]] = {}
    for line in data.split(b"\n")[:-1] if data else []:
        m = LINE.fullmatch(line)
        if m is None:
            errs.append(f"{stream}: garbled line {line[:40]!r}")
            continue
        seen.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    mine = {w.wid: w for w in run.writers if w.stream == stream}
    for wid in seen.keys() - mine.keys():
        errs.append(f"{stream}: lines of writer w{wid:02d}, which never wrote here")
    for w in mine.values():
        present = seen.get(w.wid, [])
        present_set, acked_set = set(present), set(w.acked)
        dups = sorted(n for n, c in Counter(present).items() if c > 1)
        for n in dups[:5]:
            how = (f"producer seq {n}, retried after the restart -> HTTP {w.retried[n]}" if n in w.retried
                   else "acknowledged" if n in acked_set else "unanswered")
            errs.append(f"{stream}: w{w.wid:02d}-{n:06d} present {present.count(n)} times (b) ({how})")
        lost = [n for n in w.acked if n not in present_set]
        if lost:
            errs.append(f"{stream}: w{w.wid:02d} lost {len(lost)} acknowledged append(s) (a): {lost[:10]}")
        in_stream_order = [n for n in present if n in acked_set]
        if not lost and not dups and in_stream_order != w.acked:
            errs.append(f"{stream}: w{w.wid:02d} acknowledged appends out of ack order (a)")
        phantom = present_set - acked_set - w.uncertain
        if phantom:
            errs.append(f"{stream}: w{w.wid:02d} has appends that were never sent or got an error: "
                        f"{sorted(phantom)[:10]}")
    return errs


async def _verify_after_restart(run: Run, byte_positions: bool) -> list[str]:
    errs: list[str] = []
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        # (c) every producer retries its unanswered request with the same (id, epoch, seq)
        for w in run.writers:
            if w.pending is None:
                continue
            n = w.pending
            async with session.post(run.url(w.stream), data=w.body(n), headers=w.headers(n)) as r:
                await r.read()
                status, echoed = r.status, (r.headers.get("Producer-Epoch"), r.headers.get("Producer-Seq"))
            run.retry_status[status] += 1
            w.retried[n] = status
            if status not in (200, 204):
                errs.append(f"w{w.wid:02d}: retry of seq {n} after restart answered HTTP {status} (c)")
                continue
            if echoed != ("0", str(n)):
                errs.append(f"w{w.wid:02d}: retry of seq {n} answered {status} with Producer-Epoch/-Seq "
                            f"{echoed}, want ('0', '{n}') (c)")
            w.acked.append(n)
            w.pending, w.next_n = None, n + 1
        for stream in CONTENT_TYPES:
            url = run.url(stream)
            data, tail = await _read_all(session, url)
            async with session.head(url) as r:
                head_tail = r.headers.get("Stream-Next-Offset")
            if head_tail != tail:
                errs.append(f"{stream}: HEAD Stream-Next-Offset {head_tail} != end of catch-up read {tail} (e)")
            async with session.get(url, params={"offset": tail}) as r:
                rest = await r.read()
            if r.status != 200 or rest:
                errs.append(f"{stream}: read at the tail {tail}: HTTP {r.status}, {len(rest)} bytes (e)")
            errs += _check_stream(run, stream, data, byte_positions, tail)
            run.contents[stream] = data
    return errs


async def _create_streams(run: Run) -> None:
    async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
        for stream, ctype in CONTENT_TYPES.items():
            async with session.put(run.url(stream), headers={"Content-Type": ctype}) as r:
                assert r.status == 201, f"PUT {stream}: HTTP {r.status}"


def _server(tmp_path: Path) -> tuple[Server, bool]:
    """(the server under test, whether its offsets carry byte positions)."""
    ref = os.environ.get("DS3_CRASH_REFERENCE")
    if ref:
        return ReferenceServer(home=Path(ref), data_dir=tmp_path / "data"), False
    return ingester(tmp_path / "data", "--long-poll-timeout", "2"), True


@dataclass
class ReaderTier:
    """An ingester with a reader in front (what users are given): the writers talk to the
    reader, whose appends go down its pipe to the ingester (reader/upstream.py); kill()
    SIGKILLs the ingester alone, and the reader finds it again when it comes back."""

    ingester: Proc
    reader: Proc

    @property
    def url(self) -> str:
        return self.reader.url

    def start(self, timeout: float = 20.0) -> ReaderTier:
        self.ingester.start(timeout)
        if self.reader.popen is None or self.reader.popen.poll() is not None:
            self.reader.start(timeout)
        return self

    def kill(self) -> None:
        self.ingester.kill()

    def stop(self) -> None:
        self.reader.stop()
        self.ingester.stop()


def test_sigkill_loses_no_ack_and_duplicates_nothing(tmp_path: Path) -> None:
    server, byte_positions = _server(tmp_path)
    _crash_rounds(server, byte_positions, ROUNDS)


def test_sigkill_of_the_ingester_behind_a_reader_loses_no_ack(tmp_path: Path) -> None:
    """The same through a reader: appends pipelined down one upstream connection, the ingester
    killed with several of them in flight on it."""
    store = f"file://{tmp_path / 'objects'}"
    ing = ingester(tmp_path / "data", "--long-poll-timeout", "2", "--store", store, "--write-rate", "0")
    tier = ReaderTier(ing, reader(tmp_path / "reader", ing.url, store, "--write-rate", "0"))
    _crash_rounds(tier, True, max(2, ROUNDS // 2))


@pytest.mark.parametrize("durability", ["local", "store"])
def test_sigkill_while_sealing_behind_a_reader_loses_no_ack(tmp_path: Path, durability: str) -> None:
    """The same while every stream seals all the time (16 KiB chunks, or 0.3 s old): kills land
    mid-seal, mid-upload and between the bounded steps that drop a sealed chunk's records from
    the WAL (about 1,500 records a chunk: two steps), and the reads after each restart cross
    from sealed chunks served from the store to the WAL's tail. In `store` durability an append
    is acknowledged once its commit's log segment is in the store too, so kills also land
    between a segment's PUT and its commit."""
    store = f"file://{tmp_path / 'objects'}"
    seal = ("--seal-bytes", "16384", "--seal-age", "0.3", "--durability", durability)
    ing = ingester(tmp_path / "data", "--long-poll-timeout", "2", "--store", store, "--write-rate", "0", *seal)
    tier = ReaderTier(ing, reader(tmp_path / "reader", ing.url, store, "--write-rate", "0"))
    _crash_rounds(tier, True, max(2, ROUNDS // 2))
    sealed = [p for p in (tmp_path / "objects" / "chunks").rglob("*") if p.is_file() and p.name.isdigit()]
    print(f"{len(sealed)} chunk objects sealed")
    assert len(sealed) >= 2 * len(CONTENT_TYPES), f"only {len(sealed)} chunks sealed: the kills met no seal"


def _crash_rounds(server: Server, byte_positions: bool, rounds: int) -> None:
    seed = int(os.environ.get("DS3_CRASH_SEED", str(time.time_ns() % 1_000_000)))
    rng = random.Random(seed)
    writers = [Writer(wid=i, stream=s, producer=p) for i, (s, p) in enumerate(WRITERS)]
    t0 = time.monotonic()
    try:
        server.start()
        run = Run(base=server.url, writers=writers)
        asyncio.run(_create_streams(run))
        for rnd in range(1, rounds + 1):
            acks, in_flight = asyncio.run(_load_then_kill(run, server, rng))
            assert not run.errors, f"seed {seed}, round {rnd}, during load:\n  " + "\n  ".join(run.errors)
            assert acks > 0, f"round {rnd}: no append was acknowledged before the kill"
            server.start()
            errs = asyncio.run(_verify_after_restart(run, byte_positions))
            assert not errs, (
                f"seed {seed}, round {rnd} ({in_flight} request(s) in flight at the kill, "
                f"producer retries {dict(run.retry_status)}):\n  " + "\n  ".join(errs[:30])
            )
            print(f"round {rnd}: {acks} acks, {in_flight} in flight at the kill, "
                  f"retries so far {dict(run.retry_status)}, {time.monotonic() - t0:.1f}s")
    finally:
        server.stop()
    total = sum(len(w.acked) for w in writers)
    assert total >= 50 * rounds, f"only {total} appends acknowledged in {rounds} rounds"
    unanswered = sum(len(w.uncertain) for w in writers)
    kept = sum(w.body(n) in run.contents[w.stream] for w in writers for n in w.uncertain)
    print(f"seed {seed}: {rounds} rounds, {total} acknowledged appends, {unanswered} unanswered "
          f"plain appends ({kept} of them persisted), producer retries {dict(run.retry_status)} "
          f"(200 = not persisted, 204 = deduplicated), {time.monotonic() - t0:.1f}s")
