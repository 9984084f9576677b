"""Interop driver for the PyPI `durable-streams` client (0.1.0) against a server.

Usage: python client_py.py BASE_URL TAG [SCENARIO ...]
Runs each scenario against its own stream under BASE_URL/v1/stream/interop-py-TAG-<scenario> and
prints one line `RESULT <json>`: {scenario: {...observed values...} | {"error": "..."}}.
tests/test_interop.py compares the observed values with what was written; this script asserts
nothing itself, so every scenario reports even when an earlier one fails. It runs in its own
process so that a client blocked on a live read cannot hang pytest.
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from durable_streams import (
    AsyncDurableStream,
    DurableStream,
    LiveMode,
    SeqConflictError,
    StreamExistsError,
    StreamNotFoundError,
    astream,
    stream,
)

BASE = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:4437").rstrip("/")
TAG = sys.argv[2] if len(sys.argv) > 2 else str(int(time.time() * 1000))
LIVE_WAIT_S = 10.0


def stream_url(name: str) -> str:
    return f"{BASE}/v1/stream/interop-py-{TAG}-{name}"


def recording_client(log: list[dict[str, Any]]) -> httpx.Client:
    """An httpx client that records each answer's live mode, status and content type."""

    def hook(r: httpx.Response) -> None:
        log.append({"live": r.request.url.params.get("live"), "status": r.status_code,
                    "contentType": r.headers.get("content-type")})

    return httpx.Client(timeout=30, event_hooks={"response": [hook]})


def live_read(
    handle: DurableStream, mode: LiveMode, kind: str, append: Callable[[], object], done: Callable[[Any], bool]
) -> dict[str, Any]:
    """Start a live read at the current tail in a thread, append once it runs, collect until done()."""
    tail = handle.head().offset
    q: queue.Queue[Any] = queue.Queue()
    requests: list[dict[str, Any]] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            with stream(handle.url, offset=tail, live=mode, client=recording_client(requests)) as res:
                items = res.iter_json() if kind == "json" else res.iter_text() if kind == "text" else iter(res)
                for item in items:
                    q.put(item)
                    if stop.is_set():
                        return
        except Exception as e:  # surfaced to the caller
            q.put(e)

    threading.Thread(target=reader, daemon=True).start()
    time.sleep(0.3)
    append()
    got: Any = [] if kind == "json" else "" if kind == "text" else b""
    deadline = time.monotonic() + LIVE_WAIT_S
    while not done(got):
        item = q.get(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(item, Exception):
            raise item
        got = [*got, item] if kind == "json" else got + item
    stop.set()
    return {"data": got.hex() if kind == "bytes" else got, "requests": list(requests)}


def scenario_json() -> dict[str, Any]:
    r: dict[str, Any] = {}
    handle = DurableStream.create(stream_url("json"), content_type="application/json")
    for i in range(1, 4):
        handle.append({"n": i, "msg": f"hello {i}"})
    with stream(handle.url, live=False) as res:
        r["catchup"] = res.read_json()
        saved = res.offset
    r["longpoll"] = live_read(handle, "long-poll", "json",
                              lambda: handle.append({"n": 4, "msg": "live via long-poll"}), lambda a: len(a) >= 1)
    r["sse"] = live_read(handle, "sse", "json",
                         lambda: handle.append({"n": 5, "msg": "live via sse"}), lambda a: len(a) >= 1)
    handle.append({"n": 6, "msg": "seq a"}, seq="0001")
    handle.append({"n": 7, "msg": "seq b"}, seq="0002")
    try:
        handle.append({"n": 8, "msg": "seq regression"}, seq="0001")
        r["seqRegression"] = "accepted"
    except SeqConflictError:
        r["seqRegression"] = "SeqConflictError"
    with stream(handle.url, live=False) as res:
        r["all"] = res.read_json()
        r["allOffset"] = res.offset
    with stream(handle.url, offset=saved, live=False) as res:
        r["resumed"] = res.read_json()
    DurableStream.create(handle.url, content_type="application/json")  # same config: idempotent
    try:
        DurableStream.create(handle.url, content_type="text/plain")
        r["createConflict"] = "accepted"
    except StreamExistsError:
        r["createConflict"] = "StreamExistsError"
    head = handle.head()
    r["head"] = {"contentType": head.content_type, "offset": head.offset}
    handle.delete()
    try:
        handle.head()
        r["afterDelete"] = "exists"
    except StreamNotFoundError:
        r["afterDelete"] = "StreamNotFoundError"
    return r


def scenario_text() -> dict[str, Any]:
    r: dict[str, Any] = {}
    handle = DurableStream.create(stream_url("text"), content_type="text/plain")
    handle.append("héllo ")
    handle.append("wörld ✓\n")
    with stream(handle.url, live=False) as res:
        r["catchup"] = res.read_text()
    r["longpoll"] = live_read(handle, "long-poll", "text", lambda: handle.append("long-poll ✓\n"),
                              lambda t: len(t) >= len("long-poll ✓\n"))
    r["sse"] = live_read(handle, "sse", "text", lambda: handle.append("sse ✓\n"),
                         lambda t: len(t) >= len("sse ✓\n"))
    with stream(handle.url, live=False) as res:
        r["all"] = res.read_text()
    r["contentType"] = handle.head().content_type
    handle.delete()
    return r


def scenario_bytes() -> dict[str, Any]:
    """Binary data; the 0.1.0 client has no SSE for binary streams, so catch-up and long-poll only."""
    r: dict[str, Any] = {}
    handle = DurableStream.create(stream_url("bytes"), content_type="application/octet-stream")
    handle.append(bytes(range(256)))
    with stream(handle.url, live=False) as res:
        r["catchup"] = res.read_bytes().hex()
    r["longpoll"] = live_read(handle, "long-poll", "bytes", lambda: handle.append(bytes(range(255, -1, -1))),
                              lambda b: len(b) >= 256)
    with stream(handle.url, live=False) as res:
        r["all"] = res.read_bytes().hex()
    handle.delete()
    return r


async def _async_json() -> dict[str, Any]:
    r: dict[str, Any] = {}
    handle = await AsyncDurableStream.create(stream_url("async"), content_type="application/json")
    try:
        for i in range(1, 4):
            await handle.append({"n": i})
        async with astream(handle.url, live=False) as res:
            r["catchup"] = await res.read_json()
        tail = (await handle.head()).offset
        got: list[Any] = []

        async def read_live() -> None:
            async with astream(handle.url, offset=tail, live="sse") as res:
                async for item in res.iter_json():
                    got.append(item)
                    return

        task = asyncio.create_task(read_live())
        await asyncio.sleep(0.3)
        await handle.append({"n": 4, "msg": "async sse"})
        await asyncio.wait_for(task, LIVE_WAIT_S)
        r["sse"] = got
        await handle.delete()
    finally:
        await handle.aclose()
    return r


def scenario_async() -> dict[str, Any]:
    """The asyncio API: create, append, catch-up, SSE live read."""
    return asyncio.run(_async_json())


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "json": scenario_json, "text": scenario_text, "bytes": scenario_bytes, "async": scenario_async,
}


def main() -> None:
    only = sys.argv[3:]
    results: dict[str, Any] = {}
    for name, fn in SCENARIOS.items():
        if only and name not in only:
            continue
        try:
            results[name] = fn()
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
