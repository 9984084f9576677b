"""An ingester that seals into an object store plus a reader in front of it, for tests of
sealing and of the reader (tests/test_sealing.py, tests/test_reader.py).

    store = StoreView.s3(s3_server, bucket)   # or StoreView.local(tmp_path / "objects")
    with Cluster(tmp_path, store, seal_bytes=1024) as c:
        ...  c.ingester.url, c.reader.url, c.store.keys("chunks/"), reader_metrics(c.reader.url)

Everything listens on 127.0.0.1 and is stopped on exit (also when the body fails).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp
from multidict import CIMultiDict

from shared import chunks, keys
from shared.objectstore.base import TEMP_PREFIX
from tests.procs import Proc, ingester, reader
from tests.s3server import MotoS3

TIMEOUT = aiohttp.ClientTimeout(total=20)


# ---------------------------------------------------------------- the object store, seen from the test
@dataclass
class StoreView:
    """Synchronous access to the objects a cluster wrote (S3 on moto, or a local directory)."""

    url: str  # what --store gets
    endpoint: str | None = None  # --s3-endpoint for the servers (None for file://)
    s3: MotoS3 | None = None
    bucket: str = ""
    prefix: str = ""
    root: Path | None = None
    _decoded: dict[str, tuple[chunks.ChunkHead, list[chunks.Record]]] = field(default_factory=dict, repr=False)

    @classmethod
    def s3_store(cls, server: MotoS3, bucket: str, prefix: str = "ds3") -> StoreView:
        return cls(url=f"s3://{bucket}/{prefix}", endpoint=server.endpoint, s3=server, bucket=bucket,
                   prefix=prefix + "/")

    @classmethod
    def local(cls, root: Path) -> StoreView:
        root.mkdir(parents=True, exist_ok=True)
        return cls(url=f"file://{root}", root=root)

    @property
    def kind(self) -> str:
        return "s3" if self.s3 is not None else "file"

    def server_args(self, endpoint: str | None = None) -> list[str]:
        args = ["--store", self.url]
        if endpoint or self.endpoint:
            args += ["--s3-endpoint", endpoint or self.endpoint or ""]
        return args

    def keys(self, under: str = "") -> list[str]:
        """Every visible object key under `under` (relative to the store URL), sorted."""
        if self.s3 is not None:
            out: list[str] = []
            pages = self.s3.client().get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + under
            )
            for page in pages:
                out += [o["Key"][len(self.prefix):] for o in page.get("Contents", [])]
            return sorted(out)
        assert self.root is not None
        base = self.root / under if under else self.root
        if not base.exists():
            return []
        found = []
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if not f.startswith(TEMP_PREFIX):  # a crash may leave temps: never visible
                    found.append(str(Path(dirpath, f).relative_to(self.root)))
        return sorted(found)

    def get(self, key: str) -> bytes:
        if self.s3 is not None:
            obj = self.s3.client().get_object(Bucket=self.bucket, Key=self.prefix + key)
            return bytes(obj["Body"].read())
        assert self.root is not None
        return (self.root / key).read_bytes()

    def chunk_keys(self, uid: str | None = None) -> list[str]:
        return self.keys(keys.chunk_prefix(uid) if uid else "chunks/")

    def descriptor(self, path: str) -> dict[str, Any] | None:
        k = keys.descriptor_key(path)
        if k not in self.keys(k.rsplit("/", 1)[0] + "/"):
            return None
        return dict(json.loads(self.get(k)))

    def uid(self, path: str) -> str:
        desc = self.descriptor(path)
        assert desc is not None, f"no descriptor for {path}"
        return str(desc["uid"])

    def chunk_objects(self, uid: str) -> list[tuple[str, chunks.ChunkHead, list[chunks.Record]]]:
        """(key, head, records) of every chunk object of a stream; raises on a malformed or
        partial object. Chunk objects are immutable (a re-upload writes identical bytes), so
        each is fetched and decoded once."""
        out = []
        for k in self.chunk_keys(uid):
            if k not in self._decoded:
                self._decoded[k] = chunks.decode_chunk(self.get(k))
            out.append((k, *self._decoded[k]))
        return out

    def decoded_chunks(self, uid: str) -> list[tuple[chunks.ChunkHead, list[chunks.Record]]]:
        return [(h, r) for _, h, r in self.chunk_objects(uid)]


# ---------------------------------------------------------------- processes
@dataclass
class Cluster:
    work: Path
    store: StoreView
    seal_bytes: int = 4096
    seal_age: float = 60.0
    ingester_args: list[str] = field(default_factory=list)
    reader_args: list[str] = field(default_factory=list)
    ingester_endpoint: str | None = None  # --s3-endpoint for the ingester only (a TcpGate)
    ingester: Proc = field(init=False)
    reader: Proc = field(init=False)

    def __post_init__(self) -> None:
        self.ingester = ingester(
            self.work / "data", *self.store.server_args(self.ingester_endpoint),
            "--seal-bytes", str(self.seal_bytes), "--seal-age", str(self.seal_age),
            "--long-poll-timeout", "5", "--log-level", "warning", *self.ingester_args,
        )
        self.reader = reader(
            self.work / "reader", self.ingester.url, self.store.url,
            *self.store.server_args()[2:], "--long-poll-timeout", "5", "--log-level", "warning",
            *self.reader_args,
        )

    def start(self) -> Self:
        try:
            self.ingester.start()
            self.reader.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.reader.stop()
        self.ingester.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def logs(self) -> str:
        out = []
        for p in (self.ingester, self.reader):
            if p.log_path.exists():
                out.append(f"--- {p.log_path.name}\n{p.log_path.read_text()[-4000:]}")
        return "\n".join(out)


# ---------------------------------------------------------------- HTTP helpers
def reader_metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{label="v",...}': value} (labels sorted; no braces without
    labels), parsed with prometheus_client's own parser so a malformed exposition fails."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape(base: str) -> dict[str, float]:
    """GET {base}/metrics of a running ds3 process, parsed (parse_metrics)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        return parse_metrics(r.read().decode())


@dataclass(frozen=True)
class Page:
    offset: str
    status: int
    headers: CIMultiDict[str]
    body: bytes

    @property
    def next_offset(self) -> str:
        return self.headers["Stream-Next-Offset"]

    @property
    def up_to_date(self) -> bool:
        return self.headers.get("Stream-Up-To-Date", "").lower() == "true"


async def get_page(
    session: aiohttp.ClientSession, url: str, offset: str, params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> Page:
    async with session.get(url, params={"offset": offset, **(params or {})}, headers=headers) as r:
        body = await r.read()
        return Page(offset, r.status, CIMultiDict(r.headers), body)


async def read_pages(session: aiohttp.ClientSession, url: str, offset: str = "-1", limit: int = 10_000) -> list[Page]:
    """Catch-up read until Stream-Up-To-Date; every page must be a 200 that makes progress."""
    pages: list[Page] = []
    for _ in range(limit):
        p = await get_page(session, url, offset)
        assert p.status == 200, f"GET {url}?offset={offset}: HTTP {p.status} {p.body[:200]!r}"
        pages.append(p)
        if p.up_to_date:
            return pages
        assert p.body and p.next_offset > offset, f"no progress at {offset}: {p.headers}"
        offset = p.next_offset
    raise AssertionError(f"catch-up read of {url} did not reach the tail in {limit} pages")


async def create(session: aiohttp.ClientSession, url: str, content_type: str, **headers: str) -> None:
    async with session.put(url, headers={"Content-Type": content_type, **headers}) as r:
        assert r.status == 201, f"PUT {url}: HTTP {r.status} {await r.text()}"


async def append(session: aiohttp.ClientSession, url: str, body: bytes, content_type: str) -> str:
    async with session.post(url, data=body, headers={"Content-Type": content_type}) as r:
        assert r.status in (200, 204), f"POST {url}: HTTP {r.status} {await r.text()}"
        return r.headers["Stream-Next-Offset"]


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `pred` until it returns something truthy (returned); AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def await_for(pred: Callable[[], Awaitable[Any]], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def covered(heads: list[chunks.ChunkHead]) -> int:
    """The end position of the contiguous run of chunks from position 0 (or the first start)."""
    end = heads[0].header.start if heads else 0
    for h in sorted(heads, key=lambda h: h.header.chunk):
        if h.header.start != end:
            break
        end = h.header.end
    return end


def position(offset: str) -> int:
    """The byte position of a ds3 offset (design §4: <chunk>_<position>)."""
    return int(offset.split("_")[1])


def chunk_ends(sizes: list[int], seal_bytes: int, start: int = 0) -> list[int]:
    """Where a stream's chunks end when appends of `sizes` bytes arrive and only size seals:
    the open chunk rolls after the append that brings it to seal_bytes or more."""
    ends, tail, chunk_start = [], start, start
    for n in sizes:
        tail += n
        if tail - chunk_start >= seal_bytes:
            ends.append(tail)
            chunk_start = tail
    return ends


def sealed_end(store: StoreView, uid: str) -> int:
    """How far from position 0 the stream's chunk objects reach without a gap."""
    return covered([h for h, _ in store.decoded_chunks(uid)])


async def read_sse_until(resp: aiohttp.ClientResponse, want: str, limit: float) -> list[tuple[str, str]]:
    """(event, data) pairs of an SSE response until a data event containing `want` arrives
    (or the stream ends); TimeoutError after `limit` seconds."""
    events: list[tuple[str, str]] = []
    event, data = "", []
    async with asyncio.timeout(limit):
        async for raw in resp.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif line == "":
                if event or data:
                    events.append((event, "\n".join(data)))
                    if event == "data" and want in "\n".join(data):
                        return events
                event, data = "", []
    return events
