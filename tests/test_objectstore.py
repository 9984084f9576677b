"""One contract for every ObjectStore: each test runs against the local directory store and
against S3 (moto's server), then a few tests cover what only one of them has."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from shared.config import ConfigError
from shared.errors import ObjectNotFound, ObjectStoreUnavailable, PreconditionFailed, Unavailable
from shared.objectstore import LocalStore, ObjectStore, open_store
from shared.objectstore import local as local_module
from shared.objectstore import s3 as s3_module
from shared.objectstore.base import TEMP_PREFIX, StoreCounters
from shared.objectstore.local import LOCK_NAME
from shared.objectstore.s3 import S3Options, S3Store
from shared.objectstore.scoped import ScopedStore, ingester_scope
from tests import store_racer
from tests.s3server import MotoS3

MiB = 1024 * 1024
# Small list pages so a few hundred keys span several of them: 1001 keys at S3's real page
# size (1000) take moto over 10 s to create.
S3_PAGE = 50


@pytest.fixture(params=["local", "local-named-temp", "s3", "scoped"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ObjectStore]:
    if request.param == "scoped":  # one cluster member's namespace in a shared local store
        inner = open_store((tmp_path / "objects").as_uri())
        async with inner:
            # neighbours on both sides of the scope, which nothing in it may see or touch
            for key in ("_ds3/ingesters/a/log/x", "_ds3/ingesters/c/log/x", "chunks/outside"):
                await inner.put(key, b"neighbour")
            inner.counters = StoreCounters()  # the contract's counts start from here
            yield ScopedStore(inner, ingester_scope("b"))
            assert [i.key async for i in inner.list()][:1] == ["_ds3/ingesters/a/log/x"]
            assert await inner.get("_ds3/ingesters/c/log/x") == b"neighbour"
        return
    if request.param.startswith("local"):
        s: ObjectStore = open_store((tmp_path / "objects").as_uri())
        if request.param == "local-named-temp":  # where O_TMPFILE or /proc is missing
            assert isinstance(s, LocalStore)
            s._unnamed = False
    else:
        bucket: str = request.getfixturevalue("s3_bucket")
        server: MotoS3 = request.getfixturevalue("s3_server")
        s = open_store(f"s3://{bucket}/some/prefix", s3_endpoint=server.endpoint,
                       s3_options=S3Options(list_page_size=S3_PAGE))
    async with s:
        yield s


def payload(n: int, seed: int = 0) -> bytes:
    """n bytes that differ at every offset (a shifted slice would not compare equal)."""
    block = bytes((i * 31 + seed) % 251 for i in range(251))
    return (block * (n // 251 + 1))[:n]


async def keys_of(store: ObjectStore, prefix: str = "", start_after: str | None = None,
                  limit: int | None = None) -> list[str]:
    return [i.key async for i in store.list(prefix, start_after, limit)]


async def put_many(store: ObjectStore, keys: list[str], data: bytes = b"x") -> None:
    sem = asyncio.Semaphore(16)

    async def one(k: str) -> None:
        async with sem:
            await store.put(k, data)

    await asyncio.gather(*(one(k) for k in keys))


# ---------------------------------------------------------------- put / get / head
async def test_put_get_round_trip_and_counters(store: ObjectStore) -> None:
    data = payload(10_000)
    await store.put("chunks/ab/abc/0000000000000001", data, content_type="application/octet-stream")
    assert await store.get("chunks/ab/abc/0000000000000001") == data
    await store.put("chunks/ab/abc/0000000000000001", b"replaced")  # plain put overwrites
    assert await store.get("chunks/ab/abc/0000000000000001") == b"replaced"
    c = store.counters
    assert (c.puts, c.gets, c.errors) == (2, 2, 0)
    assert c.bytes_out == len(data) + 8 and c.bytes_in == len(data) + 8


async def test_empty_object(store: ObjectStore) -> None:
    await store.put("empty", b"")
    assert await store.get("empty") == b""
    assert await store.get("empty", 0, 10) == b""
    assert b"".join([p async for p in store.stream("empty")]) == b""
    assert (await store.head("empty")).size == 0


RANGES = [
    (None, None), (0, 1), (0, 100), (5, None), (None, 7), (10, 10), (99, 100),
    (3, 1000),      # end past the object: clamped
    (100, None),    # start at the end: empty
    (150, 200),     # entirely past the end: empty
]


@pytest.mark.parametrize(("start", "end"), RANGES)
async def test_ranged_get_is_a_slice(store: ObjectStore, start: int | None, end: int | None) -> None:
    data = payload(100)
    await store.put("r", data)
    assert await store.get("r", start, end) == data[start:end]
    assert b"".join([p async for p in store.stream("r", start, end, chunk_size=7)]) == data[start:end]


@pytest.mark.parametrize(("start", "end"), [(-1, None), (5, 4), (None, -1)])
async def test_invalid_range(store: ObjectStore, start: int | None, end: int | None) -> None:
    await store.put("r", b"abc")
    with pytest.raises(ValueError):
        await store.get("r", start, end)


async def test_stream_multi_mib_in_pieces(store: ObjectStore) -> None:
    data = payload(3 * MiB + 17, seed=5)
    await store.put("big", data)
    pieces = [p async for p in store.stream("big", chunk_size=256 * 1024)]
    assert len(pieces) >= 4 and all(0 < len(p) <= 256 * 1024 for p in pieces)
    assert b"".join(pieces) == data == await store.get("big")
    ranged = [p async for p in store.stream("big", 1000, 2 * MiB + 5, chunk_size=64 * 1024)]
    assert len(ranged) > 1 and b"".join(ranged) == data[1000 : 2 * MiB + 5]


async def test_stream_stopped_early_releases_resources(store: ObjectStore) -> None:
    await store.put("big", payload(2 * MiB))
    for _ in range(5):
        it = store.stream("big", chunk_size=64 * 1024)
        assert len(await anext(it)) > 0
        await it.aclose()  # type: ignore[attr-defined]
    assert await store.get("big", 0, 3) == payload(3)


async def test_head(store: ObjectStore) -> None:
    await store.put("d/desc.json", b'{"a":1}', content_type="application/json")
    info = await store.head("d/desc.json")
    assert (info.key, info.size, info.content_type) == ("d/desc.json", 7, "application/json")
    assert info.etag and info.last_modified and abs(info.last_modified - time.time()) < 600
    await store.put("d/desc.json", b'{"a":22}', content_type="application/json")
    again = await store.head("d/desc.json")
    assert again.size == 8 and again.etag != info.etag


async def test_missing_key(store: ObjectStore) -> None:
    await store.put("present/x", b"1")
    for key in ("nope", "present/nope", "present"):  # "present" is only a prefix
        with pytest.raises(ObjectNotFound) as e:
            await store.get(key)
        assert e.value.key == key
        with pytest.raises(ObjectNotFound):
            await store.get(key, 0, 0)
        with pytest.raises(ObjectNotFound):
            await store.head(key)
        with pytest.raises(ObjectNotFound):
            async for _ in store.stream(key):
                pass
    assert store.counters.errors == 0  # a missing key is an answer, not a failure


# ---------------------------------------------------------------- delete
async def test_delete_is_idempotent(store: ObjectStore) -> None:
    await store.put("a/b/c", b"1")
    await store.put("a/b/d", b"2")
    await store.delete("a/b/c")
    await store.delete("a/b/c")
    await store.delete("never/existed")
    with pytest.raises(ObjectNotFound):
        await store.head("a/b/c")
    assert await keys_of(store) == ["a/b/d"]
    await store.delete("a/b/d")
    assert await keys_of(store) == []
    await store.put("a/b/c", b"3")  # the pruned directories come back
    assert await store.get("a/b/c") == b"3"


async def test_delete_prefix(store: ObjectStore) -> None:
    doomed = [f"chunks/ab/abc/{i:016d}" for i in range(2 * S3_PAGE + 3)]  # several list pages
    kept = ["chunks/ab/abcd/0", "chunks/ab/ab", "chunks/b/x", "desc/abc"]
    await put_many(store, doomed + kept)
    assert await store.delete_prefix("chunks/ab/abc/") == len(doomed)
    assert await keys_of(store) == sorted(kept)
    assert await store.delete_prefix("chunks/ab/abc/") == 0
    assert await store.delete_prefix("chunks/ab/abc") == 1  # a partial name matches "abcd/0"
    assert await keys_of(store) == ["chunks/ab/ab", "chunks/b/x", "desc/abc"]


# ---------------------------------------------------------------- list
# Sorted as S3 sorts (UTF-8 bytes): '-' < '.' < '/' < '0' < 'A' < '_' < 'a' < 'é'.
LIST_KEYS = ["a-b", "a.b", "a/b", "a/c/d", "a/c/e", "a0", "aA", "a_", "ab/z", "b", "é/1", "zz/y/x"]


async def test_list_sorted_with_prefix_start_after_limit(store: ObjectStore) -> None:
    await put_many(store, LIST_KEYS, b"12345")
    assert sorted(LIST_KEYS, key=str.encode) == sorted(LIST_KEYS)  # code points = UTF-8 order
    infos = [i async for i in store.list()]
    assert [i.key for i in infos] == sorted(LIST_KEYS)
    assert all(i.size == 5 and i.etag for i in infos)
    assert await keys_of(store, "a/") == ["a/b", "a/c/d", "a/c/e"]
    assert await keys_of(store, "a/c") == ["a/c/d", "a/c/e"]
    assert await keys_of(store, "a") == [k for k in sorted(LIST_KEYS) if k.startswith("a")]
    assert await keys_of(store, "nothing") == []
    assert await keys_of(store, start_after="a/c/d") == sorted(k for k in LIST_KEYS if k > "a/c/d")
    assert await keys_of(store, start_after="a/") == sorted(k for k in LIST_KEYS if k > "a/")
    assert await keys_of(store, start_after="é/1") == []  # "é" sorts after "zz"
    assert await keys_of(store, "a/", start_after="a/b") == ["a/c/d", "a/c/e"]
    assert await keys_of(store, limit=3) == sorted(LIST_KEYS)[:3]
    assert await keys_of(store, "a", start_after="a.b", limit=2) == ["a/b", "a/c/d"]
    assert await keys_of(store, limit=0) == []


async def test_list_paginates(store: ObjectStore) -> None:
    keys = [f"s/{d}/{i:05d}" for d in ("x", "y", "z") for i in range(60)]  # 180 keys, 4 S3 pages
    await put_many(store, keys)
    before = store.counters.lists
    assert await keys_of(store, "s/") == keys
    if isinstance(store, S3Store):
        assert store.counters.lists - before == 4
    # start_after and limit across page boundaries
    assert await keys_of(store, "s/", start_after=keys[45], limit=70) == keys[46:116]
    assert await keys_of(store, "s/y/", start_after="s/x/zzz") == keys[60:120]


# ---------------------------------------------------------------- conditional create
async def test_if_absent_keeps_the_first(store: ObjectStore) -> None:
    await store.put("once", b"first", if_absent=True)
    with pytest.raises(PreconditionFailed) as e:
        await store.put("once", b"second", if_absent=True)
    assert e.value.key == "once"
    assert await store.get("once") == b"first"
    assert store.counters.errors == 0


async def test_a_put_not_yet_durable_is_whole_and_visible_and_sync_takes_any_keys(store: ObjectStore) -> None:
    etag = await store.put("d/one", b"visible now", content_type="application/json", durable=False)
    assert await store.get("d/one") == b"visible now"
    info = await store.head("d/one")
    assert info.etag == etag and info.size == 11 and info.content_type == "application/json"
    await store.put("d/two", b"x", durable=False)
    await store.put("d/two", b"replaced", durable=False)
    await store.put("d/gone", b"x", durable=False)
    await store.delete("d/gone", durable=False)
    await store.sync(["d/one", "d/two", "d/gone", "d/never", "elsewhere/never"])  # (missing keys are fine)
    await store.sync([])
    assert await store.get("d/two") == b"replaced"
    assert await keys_of(store) == ["d/one", "d/two"]
    # a conditional write stays conditional (and durable) whatever it asks
    with pytest.raises(PreconditionFailed):
        await store.put("d/one", b"again", if_absent=True, durable=False)
    assert store.counters.errors == 0


async def test_if_absent_concurrent_single_winner(store: ObjectStore) -> None:
    n = 12

    async def attempt(i: int) -> int | None:
        try:
            await store.put("race", payload(50_000, seed=i), if_absent=True)
            return i
        except PreconditionFailed:
            return None

    results = await asyncio.gather(*(attempt(i) for i in range(n)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert await store.get("race") == payload(50_000, seed=winners[0])


async def test_etags_agree_and_are_the_md5(store: ObjectStore) -> None:
    data = payload(5000, seed=3)
    etag = await store.put("e/x", data, content_type="application/octet-stream")
    assert etag == hashlib.md5(data).hexdigest()  # S3's single-part ETag; the local store's too
    assert (await store.head("e/x")).etag == etag
    assert await store.get_with_etag("e/x") == (data, etag)
    assert [i.etag async for i in store.list("e/")] == [etag]
    assert await store.put("e/x", b"other") != etag
    assert await store.put("e/x", data) == etag  # same content, same ETag (as on S3)
    with pytest.raises(ObjectNotFound):
        await store.get_with_etag("e/missing")
    assert store.counters.errors == 0


async def test_if_absent_returns_the_etag(store: ObjectStore) -> None:
    etag = await store.put("once", b"first", if_absent=True)
    assert await store.get_with_etag("once") == (b"first", etag)


async def test_if_match_replaces_only_that_version(store: ObjectStore) -> None:
    e1 = await store.put("cas", b"v1")
    e2 = await store.put("cas", b"v2", if_match=e1, content_type="application/json")
    assert e2 != e1 and await store.get_with_etag("cas") == (b"v2", e2)
    assert (await store.head("cas")).content_type == "application/json"
    with pytest.raises(PreconditionFailed) as e:  # stale: someone else's write came first
        await store.put("cas", b"v3", if_match=e1)
    assert e.value.key == "cas" and "not version" in e.value.message
    assert await store.get_with_etag("cas") == (b"v2", e2)  # unchanged
    e3 = await store.put("cas", b"v3", if_match=f'"{e2}"')  # quoted as in HTTP: the same ETag
    assert await store.get_with_etag("cas") == (b"v3", e3)
    with pytest.raises(PreconditionFailed):  # a version of a missing object is never current
        await store.put("absent", b"x", if_match=e3)
    with pytest.raises(ObjectNotFound):
        await store.head("absent")
    await store.delete("cas")
    with pytest.raises(PreconditionFailed):
        await store.put("cas", b"v4", if_match=e3)
    assert store.counters.errors == 0
    with pytest.raises(ValueError):
        await store.put("cas", b"x", if_absent=True, if_match=e3)


async def test_if_match_concurrent_single_winner_each_round(store: ObjectStore) -> None:
    etag = await store.put("cas", b"start")
    for r in range(6):

        async def attempt(i: int, current: str = etag, r: int = r) -> tuple[int, str] | None:
            try:
                return i, await store.put("cas", f"round {r} by {i}".encode(), if_match=current)
            except PreconditionFailed:
                return None

        results = await asyncio.gather(*(attempt(i) for i in range(8)))
        winners = [w for w in results if w is not None]
        assert len(winners) == 1, results
        i, etag = winners[0]
        assert await store.get_with_etag("cas") == (f"round {r} by {i}".encode(), etag)


# ---------------------------------------------------------------- keys
BAD_KEYS = ["", "/abs", "../up", "a/../b", "a/..", "..", "./a", "a/./b", "a//b", "a/", "a\\b",
            "nul\x00", f"{TEMP_PREFIX}x", f"a/{TEMP_PREFIX}x"]


BAD_PREFIXES = ["/abs", "../", "a/../", "..", "a//"]


async def test_bad_keys_rejected(store: ObjectStore) -> None:
    for key in BAD_KEYS:
        with pytest.raises(ValueError):
            await store.put(key, b"x")
        with pytest.raises(ValueError):
            await store.get(key)
        with pytest.raises(ValueError):
            await store.head(key)
        with pytest.raises(ValueError):
            async for _ in store.stream(key):
                pass
        with pytest.raises(ValueError):
            await store.delete(key)
    for prefix in BAD_PREFIXES:
        with pytest.raises(ValueError):
            await keys_of(store, prefix)
        with pytest.raises(ValueError):
            await store.delete_prefix(prefix)
    assert await keys_of(store) == []


# ---------------------------------------------------------------- local store only
async def test_local_files_are_the_objects(tmp_path: Path) -> None:
    async with open_store(tmp_path.as_uri()) as store:
        await store.put("x/y", b"plain bytes", content_type="text/plain")
        assert (tmp_path / "x" / "y").read_bytes() == b"plain bytes"
        assert [p.name for p in (tmp_path / "x").iterdir()] == ["y"]  # no temp file left
        assert (await store.head("x/y")).content_type == "text/plain"
        await store.put("x/y", b"again")  # no content type now: none reported
        assert (await store.head("x/y")).content_type is None


async def test_local_fsyncs_are_deferred_to_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """durable=False skips the file's and the directory's fsyncs; sync() makes them, each
    directory once."""
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    async with open_store(tmp_path.as_uri()) as store:
        monkeypatch.setattr(os, "fsync", counting_fsync)
        await store.put("a/1", b"x", durable=False)
        await store.put("a/2", b"y", durable=False)
        assert synced == []
        await store.sync(["a/1", "a/2", "a/missing"])
        assert sorted(synced) == sorted([str(tmp_path / "a" / "1"), str(tmp_path / "a" / "2"), str(tmp_path / "a")])
        synced.clear()
        await store.put("a/3", b"z")  # durable: the temp file, then the directory
        assert len(synced) == 2 and synced[1] == str(tmp_path / "a")
        synced.clear()
        await store.delete("a/1", durable=False)
        assert synced == [] and not (tmp_path / "a" / "1").exists()
        await store.sync(["a/1"])
        assert synced == [str(tmp_path / "a")]  # the directory that held it
        synced.clear()
        await store.delete("a/2")
        assert synced == [str(tmp_path / "a")]


async def test_local_crash_before_rename_leaves_no_object(tmp_path: Path) -> None:
    async with open_store(tmp_path.as_uri()) as store:
        await store.put("s/0001", b"sealed")
        # What a crash between writing the temp file and renaming it leaves behind:
        (tmp_path / "s" / f"{TEMP_PREFIX}0002abc").write_bytes(b"half a chu")
        (tmp_path / f"{TEMP_PREFIX}zzz").write_bytes(b"")
        assert await keys_of(store) == ["s/0001"]
        assert await store.delete_prefix("s/") == 1
        with pytest.raises(ObjectNotFound):
            await store.head("s/0002abc")


async def test_local_failed_rename_keeps_old_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_store(tmp_path.as_uri()) as store:
        await store.put("k", b"old")

        def broken_replace(src: str, dst: str) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "replace", broken_replace)
        with pytest.raises(ObjectStoreUnavailable):
            await store.put("k", b"new")
        monkeypatch.undo()
        assert await store.get("k") == b"old"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]  # the temp file was removed
        assert store.counters.errors == 1


def test_local_conditional_writes_across_processes(tmp_path: Path) -> None:
    """4 processes on one root: each round exactly one if_match and one if_absent wins."""
    root, procs, rounds = tmp_path / "objects", 4, 15
    asyncio.run(_put_once(root, "cas", b"start"))
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and a loop
    barrier = ctx.Barrier(procs, timeout=60)
    results: Any = ctx.Queue()
    workers = [ctx.Process(target=store_racer.race, args=(str(root), i, rounds, barrier, results))
               for i in range(procs)]
    for w in workers:
        w.start()
    try:
        got = [results.get(timeout=120) for _ in range(2 * procs * rounds)]
    finally:
        for w in workers:
            w.join(timeout=30)
    assert all(w.exitcode == 0 for w in workers)
    for kind in ("if_match", "if_absent"):
        for r in range(rounds):
            won = [ident for k, rr, ident, ok in got if k == kind and rr == r and ok]
            assert len(won) == 1, (kind, r, won)
    last = next(ident for k, r, ident, ok in got if k == "if_match" and r == rounds - 1 and ok)
    assert (root / "cas").read_bytes() == f"round {rounds - 1} by {last}".encode()
    assert sorted(p.name for p in root.iterdir()) == [LOCK_NAME, "cas", "new"]  # no temp files left


async def _put_once(root: Path, key: str, data: bytes) -> None:
    async with LocalStore(root) as store:
        await store.put(key, data)


async def test_local_conditional_write_waits_a_bounded_time_for_a_stopped_lock_holder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process stopped (SIGSTOP) while it holds the store's write lock: another writer's
    if_match fails as the store being unavailable after LOCK_WAIT (the caller retries; a
    standby's takeover says why in its log) instead of hanging a worker thread for as long as
    the holder stays stopped; once the holder runs again and lets go, writes go through."""
    monkeypatch.setattr(local_module, "LOCK_WAIT", 0.5)
    async with LocalStore(tmp_path) as store:
        etag = await store.put("owner.json", b"1")
        holder = subprocess.Popen([sys.executable, "-c", (
            "import fcntl, os, signal, sys\n"
            f"fd = os.open({str(tmp_path / LOCK_NAME)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGSTOP)\n"  # frozen holding it, as a SIGSTOPped ingester
            "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            started = time.monotonic()
            with pytest.raises(ObjectStoreUnavailable, match="held by another process"):
                await asyncio.wait_for(store.put("owner.json", b"2", if_match=etag), 10)
            assert time.monotonic() - started < 5
            assert await store.get("owner.json") == b"1"  # nothing half-written
        finally:
            holder.send_signal(signal.SIGCONT)
            holder.communicate(timeout=10)  # (stdin closed: it exits, the kernel drops the flock)
        await store.put("owner.json", b"2", if_match=etag)
        assert await store.get("owner.json") == b"2"


async def test_local_lock_file_is_never_a_key(tmp_path: Path) -> None:
    async with open_store(tmp_path.as_uri()) as store:
        etag = await store.put("k", b"1")
        await store.put("k", b"2", if_match=etag)
        assert (tmp_path / LOCK_NAME).exists()
        assert await keys_of(store) == ["k"]
        with pytest.raises(ValueError):
            await store.get(LOCK_NAME)


async def test_local_etags_without_xattrs(tmp_path: Path) -> None:
    """Where the file system keeps no extended attributes the ETag is inode-mtime-size; each
    conditional write still makes every older ETag stale, even when written in one clock tick
    with the same size (an inode number can be reused)."""
    async with LocalStore(tmp_path) as store:
        store._xattrs = False
        etags = [await store.put("k", b"v0")]
        mtimes = [(tmp_path / "k").stat().st_mtime_ns]
        for i in range(1, 20):
            etags.append(await store.put("k", f"v{i % 10}".encode(), if_match=etags[-1]))
            mtimes.append((tmp_path / "k").stat().st_mtime_ns)
        assert len(set(etags)) == len(etags)
        assert mtimes == sorted(set(mtimes))  # strictly increasing
        assert (await store.head("k")).etag == etags[-1] == (await store.get_with_etag("k"))[1]
        for old in etags[:-1]:
            with pytest.raises(PreconditionFailed):
                await store.put("k", b"v9", if_match=old)
        assert await store.get("k") == b"v9"
        # mtimes keep increasing when the clock steps back (the current version stamped ahead)
        future = time.time_ns() + 10**10
        os.utime(tmp_path / "k", ns=(future, future))
        await store.put("k", b"v0", if_match=(await store.head("k")).etag)
        assert (tmp_path / "k").stat().st_mtime_ns > future


async def test_local_rejects_escape(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with open_store(root.as_uri()) as store:
        for key in ("../outside", "a/../../outside", "/etc/passwd"):
            with pytest.raises(ValueError):
                await store.put(key, b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


async def test_local_key_under_an_object(tmp_path: Path) -> None:
    """A file system cannot hold both "a" and "a/b" (S3 can): a clear error, not a crash."""
    async with open_store(tmp_path.as_uri()) as store:
        await store.put("a", b"1")
        with pytest.raises(Exception) as e:
            await store.put("a/b", b"2")
        assert "not a directory" in str(e.value)
        assert await keys_of(store) == ["a"]


# ---------------------------------------------------------------- S3 only
async def test_s3_prefixes_isolate_stores(s3_server: MotoS3, s3_bucket: str) -> None:
    one = open_store(f"s3://{s3_bucket}/one", s3_endpoint=s3_server.endpoint)
    two = open_store(f"s3://{s3_bucket}/two/", s3_endpoint=s3_server.endpoint)
    async with one, two:
        await one.put("k", b"1")
        await two.put("k", b"2")
        assert (await one.get("k"), await two.get("k")) == (b"1", b"2")
        assert await keys_of(one) == ["k"]
        assert await two.delete_prefix("") == 1
        assert await keys_of(one) == ["k"]
    objects = s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert [o["Key"] for o in objects] == ["one/k"]


@pytest.mark.usefixtures("aws_env")
async def test_s3_unreachable_is_unavailable() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = S3Options(connect_timeout=0.5, read_timeout=1, attempts=1)
    t0 = time.monotonic()
    async with open_store("s3://bucket/p", s3_endpoint=f"http://127.0.0.1:{port}", s3_options=opts,
                          region="us-east-1") as store:
        assert isinstance(store, S3Store)
        with pytest.raises(ObjectStoreUnavailable) as e:
            await store.get("k")
        assert isinstance(e.value, Unavailable) and e.value.retry_after >= 1  # maps to 503
        with pytest.raises(ObjectStoreUnavailable):
            await store.put("k", b"x", if_absent=True)
        with pytest.raises(ObjectStoreUnavailable):
            await keys_of(store)
        assert store.counters.errors == 3
    assert time.monotonic() - t0 < 5


class _ConflictingS3:
    """Answers put_object with 409 ConditionalRequestConflict `conflicts` times, then 200."""

    def __init__(self, conflicts: int) -> None:
        self.conflicts = conflicts
        self.calls = 0

    async def put_object(self, **req: Any) -> dict[str, Any]:
        self.calls += 1
        if self.calls <= self.conflicts:
            answer: Any = {"Error": {"Code": "ConditionalRequestConflict", "Message": "busy"},
                           "ResponseMetadata": {"HTTPStatusCode": 409}}
            raise ClientError(answer, "PutObject")
        return {"ETag": '"abc"'}


async def test_s3_conflicts_are_retried_then_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3_module, "_CONFLICT_RETRIES", 2)
    store = S3Store("bucket")
    store._s3 = _ConflictingS3(conflicts=2)  # type: ignore[assignment]
    assert await store.put("k", b"x", if_match="old") == "abc"  # the third try went through
    store._s3 = fake = _ConflictingS3(conflicts=99)  # type: ignore[assignment]
    with pytest.raises(PreconditionFailed) as e:
        await store.put("k", b"x" * (s3_module._PRESIGNED_PUT_MAX + 1), if_absent=True)  # botocore's path
    assert fake.calls == 3 and "concurrent" in e.value.message
    assert store.counters.errors == 0


class _FakeS3Puts:
    """An HTTP server answering PUTs as S3 would: `answers` (status, error code) in turn, then
    200 with an ETag; it keeps what each request carried."""

    def __init__(self, answers: list[tuple[int, str]]) -> None:
        self.answers = answers
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.url = ""
        self._runner: Any = None

    async def __aenter__(self) -> _FakeS3Puts:
        from aiohttp import web

        async def put(request: web.Request) -> web.Response:
            self.requests.append((str(request.rel_url), dict(request.headers), await request.read()))
            if self.answers:
                status, code = self.answers.pop(0)
                return web.Response(status=status, content_type="application/xml",
                                    text=f"<Error><Code>{code}</Code><Message>test</Message></Error>")
            return web.Response(status=200, headers={"ETag": '"e1"'})

        app = web.Application()
        app.router.add_put("/{tail:.*}", put)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


async def test_s3_small_puts_go_to_a_presigned_url_that_signs_the_condition(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small writes (log segments) take the presigned path: If-None-Match, the content type and
    the body's MD5 are signed (S3 refuses the request without them), 409 conflicts are retried
    and then lost, 5xx retried, 412 is PreconditionFailed."""
    from tests.s3server import aws_test_env

    monkeypatch.setattr(s3_module, "_CONFLICT_RETRIES", 2)
    with aws_test_env():
        async with _FakeS3Puts([(409, "ConditionalRequestConflict"), (503, "SlowDown")]) as fake:
            store = S3Store("bucket", "pre", endpoint=fake.url)
            try:
                assert await store.put("log/1.seg", b"segment", content_type="application/octet-stream",
                                       if_absent=True) == "e1"
                assert len(fake.requests) == 3  # the conflict and the 503 retried
                url, headers, body = fake.requests[-1]
                assert url.startswith("/bucket/pre/log/1.seg?") and body == b"segment"
                signed = url.split("X-Amz-SignedHeaders=")[1].split("&")[0].replace("%3B", ";").split(";")
                assert {"if-none-match", "content-md5", "content-type", "host"} <= set(signed)
                assert headers["If-None-Match"] == "*" and headers["Content-Type"] == "application/octet-stream"
                assert headers["Content-MD5"] == "/dMrkGFoHttSxVS9m78HEg=="  # base64(md5(b"segment"))
                fake.answers = [(412, "PreconditionFailed")]
                with pytest.raises(PreconditionFailed):
                    await store.put("log/1.seg", b"segment", if_absent=True)
                fake.answers = [(409, "ConditionalRequestConflict")] * 3
                with pytest.raises(PreconditionFailed) as e:
                    await store.put("log/2.seg", b"segment", if_absent=True)
                assert "concurrent" in e.value.message
                assert "Content-Type" not in fake.requests[-1][1]  # none given: none sent (as botocore)
                fake.answers = [(500, "InternalError")] * 3
                with pytest.raises(ObjectStoreUnavailable):
                    await store.put("log/3.seg", b"segment", if_absent=True)
                assert store.counters.errors == 1
            finally:
                await store.close()


async def test_s3_one_client_per_store(s3_server: MotoS3, s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}", s3_endpoint=s3_server.endpoint)
    assert isinstance(store, S3Store)
    await asyncio.gather(*(store.put(f"k{i}", b"x") for i in range(10)))
    client = store._s3
    assert client is not None
    await store.get("k1")
    assert store._s3 is client
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(RuntimeError):
        await store.get("k1")


# ---------------------------------------------------------------- URLs
@pytest.mark.parametrize(("url", "kind"), [
    ("file:///tmp/ds3-objects", LocalStore),
    ("file://localhost/tmp/ds3-objects/", LocalStore),
    ("s3://my-bucket", S3Store),
    ("s3://my-bucket/", S3Store),
    ("s3://my.bucket-1/some/prefix/", S3Store),
])
def test_open_store_urls(url: str, kind: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind is LocalStore:  # do not create directories outside tmp_path
        url = url.replace("/tmp/", f"{tmp_path}/")
    store = open_store(url)
    assert isinstance(store, kind) and store.url == url
    if isinstance(store, S3Store):
        assert store.prefix in ("", "some/prefix/")


@pytest.mark.parametrize("url", [
    "", "/just/a/path", "http://bucket/x", "s3://", "s3://Upper", "s3://ab", "s3://b_ad/x",
    "s3://bucket/a/../b", "s3://bucket/p?x=1", "file://host/path", "file:relative", "file:///",
])
def test_open_store_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        open_store(url)


@pytest.mark.parametrize(("start", "end"), [(0, 100), (10, 90), (50, 50), (90, 1000)])
async def test_map_range_is_the_local_file_or_none(store: ObjectStore, start: int, end: int) -> None:
    data = payload(100)
    await store.put("m", data)
    mapped = await store.map_range("m", start, end)
    if store.url.startswith("s3://"):
        assert mapped is None  # no local files: readers stream
        return
    assert mapped is not None
    try:
        assert bytes(mapped.view) == data[start:end] and len(mapped) == len(data[start:end])
    finally:
        mapped.close()
    with pytest.raises(ObjectNotFound):
        await store.map_range("missing", 0, 10)


async def test_s3_reads_reuse_presigned_urls_and_refresh_a_refused_one(s3_server: MotoS3, s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}/p", s3_endpoint=s3_server.endpoint)
    assert isinstance(store, S3Store)
    async with store:
        await store.put("k", b"0123456789")
        assert await store.get("k", 2, 5) == b"234"
        url, until = store._presigned_urls["p/k"]
        assert await store.get("k", 5) == b"56789"  # the same URL, another range
        assert store._presigned_urls["p/k"] == (url, until)
        # a URL the store no longer accepts (say, credentials rotated): presigned again
        bad = url.with_query(None)  # (moto checks that a request is signed, not the signature)
        store._presigned_urls["p/k"] = (bad, until)
        assert b"".join([p async for p in store.stream("k", 0, 4)]) == b"0123"
        assert store._presigned_urls["p/k"][0] != bad
        assert store.counters.errors == 0
        with pytest.raises(ObjectNotFound):
            await store.get("missing")


async def test_s3_put_urls_are_signed_as_botocore_signs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The presigned PUT URL (signed with botocore's SigV4 query signer, without the client's
    request machinery) is the very URL the client's generate_presigned_url makes: moto does not
    check signatures, so this is what tells a URL S3 would refuse."""
    import datetime

    import botocore.auth

    from tests.s3server import aws_test_env

    fixed = datetime.datetime(2026, 1, 2, 3, 4, 5)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: fixed)
    with aws_test_env():
        for endpoint, prefix in (("http://127.0.0.1:9", "pre/fix"), (None, "")):
            store = S3Store("bucket-1", prefix, endpoint=endpoint, region="eu-west-1")
            try:
                s3 = await store._client()
                for key in ("log/00000000000000000001-00000000000000000002.seg", "a b/ü+~x=y&z"):
                    k = store._key(key)
                    params = {"Bucket": "bucket-1", "Key": k, "ContentMD5": "bWQ1", "ContentType": "application/x",
                              "IfNoneMatch": "*"}
                    headers = {"Content-MD5": "bWQ1", "Content-Type": "application/x", "If-None-Match": "*",
                               "Accept-Encoding": "identity"}
                    ours = await store._presign_put(s3, k, params, headers)
                    theirs = await s3.generate_presigned_url("put_object", Params=params, ExpiresIn=900)
                    assert str(ours) == theirs
                assert store._put_base is not None and store._put_base[0]  # (not the fallback)
            finally:
                await store.close()


_CREATOR = """
import asyncio, sys
from pathlib import Path
from shared.objectstore import LocalStore

async def main() -> None:
    data = bytes(16 * 1024 * 1024)
    async with LocalStore(Path(sys.argv[1])) as store:
        for i in range(10_000):
            await store.put(f"d/{i}", data, if_absent=True)

asyncio.run(main())
"""


def test_a_local_creator_killed_mid_write_leaves_no_temp_file(tmp_path: Path) -> None:
    """if_absent writes (chunks, log segments) go through unnamed files: a process killed while
    writing one leaves the objects it finished and nothing else."""
    root = tmp_path / "objects"
    child = subprocess.Popen([sys.executable, "-c", _CREATOR, str(root)], cwd=Path(__file__).parent.parent,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    try:
        deadline = time.monotonic() + 60
        while len(list((root / "d").glob("*")) if (root / "d").exists() else []) < 3:
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.013)  # (most likely mid-write)
    finally:
        child.kill()
        child.wait(10)
    left = sorted(p.name for p in (root / "d").iterdir())
    assert left and all(not name.startswith(TEMP_PREFIX) for name in left), left
    for name in left:
        assert (root / "d" / name).stat().st_size == 16 * 1024 * 1024
