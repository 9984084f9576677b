"""`--durability local`: what a commit does in the object store (a sealed chunk, a descriptor,
objects deleted) waits until the store's log holds the commit (ingester/store_effects.py).

Found by QA: a close's chunk and its closed descriptor reached the store at once, the log
shipped later; the disk lost in between, the next owner had the stream open and empty while
readers served the old bytes as sealed and closed, and went on serving them after the new
owner appended other bytes at those offsets. In-process, so that only the log's PUTs fail.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ingester.service import SERVICE
from shared import keys
from shared.descriptor import Descriptor
from shared.errors import ObjectNotFound
from tests.test_visibility import fail_log_puts

TEXT = {"Content-Type": "text/plain"}


async def _until(check: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_close_reaches_the_store_only_with_the_log(tmp_path: Any, make_ingester: Any) -> None:
    client = await make_ingester(store=(tmp_path / "objects").as_uri(), durability="local")
    svc = client.server.app[SERVICE]
    objects = svc.objects
    path = "/v1/stream/ghost"
    assert (await client.put(path, headers=TEXT)).status == 201
    uid = (await svc.head("ghost")).uid
    failing = fail_log_puts(svc.shipper.objects)
    failing["on"] = True
    for part in (b"old1|", b"old2|"):
        assert (await client.post(path, data=part, headers=TEXT)).status == 204  # local: acknowledged
    assert (await client.post(path, headers={"Stream-Closed": "true"})).status == 204

    async def chunks() -> list[str]:
        return [info.key async for info in objects.list(keys.chunk_prefix(uid))]

    async def closed() -> bool:
        try:
            return Descriptor.decode(await objects.get(keys.descriptor_key("ghost"))).closed
        except ObjectNotFound:
            return False

    await asyncio.sleep(2.0)  # a closed stream's chunk is sealed at once: time enough for it
    assert await chunks() == [] and not await closed()  # the log does not hold the close yet
    assert (await client.get(path, params={"offset": "-1"})).status == 200  # the WAL still serves it
    failing["on"] = False
    await _until(lambda: _truthy(chunks()), "the sealed chunk")
    await _until(closed, "the closed descriptor")


async def test_a_delete_removes_objects_only_with_the_log(tmp_path: Any, make_ingester: Any) -> None:
    """A DELETE whose commit the log lacks must not remove the stream's sealed chunks: the
    next owner, restored from the log, still has the stream (and its reads would find nothing)."""
    client = await make_ingester(store=(tmp_path / "objects").as_uri(), durability="local", seal_bytes=1024)
    svc = client.server.app[SERVICE]
    objects = svc.objects
    path = "/v1/stream/kept"
    assert (await client.put(path, headers=TEXT)).status == 201
    uid = (await svc.head("kept")).uid
    for n in range(8):
        assert (await client.post(path, data=b"%03d" % n * 100, headers=TEXT)).status == 204

    async def chunks() -> list[str]:
        return [info.key async for info in objects.list(keys.chunk_prefix(uid))]

    await _until(lambda: _truthy(chunks()), "sealed chunks")
    await _until(lambda: _shipped(svc), "the log to hold every commit")
    sealed = await chunks()
    failing = fail_log_puts(svc.shipper.objects)
    failing["on"] = True
    started = time.monotonic()
    assert (await client.delete(path)).status == 204
    assert time.monotonic() - started < 5  # answered (after a bounded wait for the log)
    await asyncio.sleep(1.5)
    assert await chunks() == sealed  # still there: the log does not hold the delete
    failing["on"] = False
    await _until(lambda: _empty(chunks()), "the chunks' removal")


async def _truthy(coro: Any) -> bool:
    return bool(await coro)


async def _empty(coro: Any) -> bool:
    return not await coro


async def _shipped(svc: Any) -> bool:
    return bool(svc.shipper.shipped_seq >= svc.committer.seq)
