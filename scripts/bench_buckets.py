"""Listing a big bucket: create a bucket with many streams through `ds3 ingester`, then list it
page by page (limit 1000), measuring each page's latency and the server's memory.

    .venv/bin/python scripts/bench_buckets.py                  # 100,000 streams
    .venv/bin/python scripts/bench_buckets.py --streams 20000 --concurrency 128
    .venv/bin/python scripts/bench_buckets.py --help

The ingester runs on 127.0.0.1 with a fresh data dir (under --data-root, default $TMPDIR; deleted
afterwards unless --keep-data) and is stopped on exit. The streams are created with concurrent PUTs
(each an ordinary stream create, durable before its 201). Then the ingester is restarted (unless
--no-restart), so that the listing starts from a fresh process whose memory holds none of the
writer's caches, and the whole bucket is listed twice, page by page. Memory is the server's RSS
and its anonymous part (RSS minus file-backed pages, i.e. without the LMDB map's page cache),
sampled before the listing, after each pass and at the highest point during it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import psutil  # type: ignore[import-untyped, unused-ignore]
from benchlib import DS3, MiB, free_port


class Server:
    def __init__(self, data_dir: Path, log_path: Path) -> None:
        self.data_dir, self.log_path = data_dir, log_path
        self.port = free_port()
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.popen = subprocess.Popen(
            [str(DS3), "ingester", "--host", "127.0.0.1", "--port", str(self.port),
             "--data-dir", str(self.data_dir), "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"ds3 ingester exited:\n{self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("ds3 ingester did not become ready in 30 s")

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()  # its own process only (we started it, by pid)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def memory(self) -> tuple[float, float]:
        """(RSS, RSS without file-backed pages) in MiB."""
        assert self.popen is not None
        info = psutil.Process(self.popen.pid).memory_info()
        return info.rss / MiB, (info.rss - info.shared) / MiB


class PeakSampler:
    """Samples the server's memory every 20 ms in a thread; keeps the highest values."""

    def __init__(self, server: Server) -> None:
        self.server, self.peak = server, (0.0, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            rss, anon = self.server.memory()
            self.peak = (max(self.peak[0], rss), max(self.peak[1], anon))

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def create_streams(url: str, bucket: str, n: int, concurrency: int) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async with s.put(f"{url}/v1/buckets/{bucket}") as r:
            if r.status != 201:
                raise RuntimeError(f"bucket create: HTTP {r.status} {await r.text()}")
        ids = iter(range(n))
        t0 = time.perf_counter()

        async def worker() -> None:
            for i in ids:
                async with s.put(f"{url}/v1/buckets/{bucket}/stream-{i:07d}",
                                 headers={"Content-Type": "text/plain"}) as r:
                    if r.status != 201:
                        raise RuntimeError(f"stream create: HTTP {r.status} {await r.text()}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0


async def list_all(url: str, bucket: str, limit: int) -> tuple[list[float], int]:
    """Every page of the bucket; (per-page latencies in ms, streams seen). Checks order."""
    latencies: list[float] = []
    seen, last, after = 0, "", None
    async with aiohttp.ClientSession() as s:
        while True:
            params = {"limit": str(limit), **({"after": after} if after else {})}
            t0 = time.perf_counter()
            async with s.get(f"{url}/v1/buckets/{bucket}/streams", params=params) as r:
                body = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"listing: HTTP {r.status} {body[:200]!r}")
            latencies.append((time.perf_counter() - t0) * 1000)
            page = json.loads(body)
            for e in page["streams"]:
                if e["stream_id"] <= last:
                    raise RuntimeError(f"listing out of order at {e['stream_id']!r}")
                last = e["stream_id"]
            seen += page["stream_count"]
            if not page["has_more"]:
                return latencies, seen
            after = page["next_cursor"]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=100_000)
    ap.add_argument("--concurrency", type=int, default=256, help="concurrent stream PUTs")
    ap.add_argument("--limit", type=int, default=1000, help="page size of the listing")
    ap.add_argument("--data-root", type=Path, default=None, help="where the data dir goes (default $TMPDIR)")
    ap.add_argument("--keep-data", action="store_true")
    ap.add_argument("--no-restart", action="store_true", help="list with the process that created the streams")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ds3-bench-buckets-", dir=args.data_root))
    server = Server(work / "data", work / "ingester.log")
    results: dict[str, Any] = {"streams": args.streams, "limit": args.limit}
    try:
        server.start()
        bucket = "bench-bucket"
        secs = asyncio.run(create_streams(server.url, bucket, args.streams, args.concurrency))
        results["create_seconds"] = round(secs, 2)
        results["creates_per_second"] = round(args.streams / secs)
        print(f"created {args.streams:,} streams in {secs:.1f} s ({args.streams / secs:,.0f}/s, "
              f"{args.concurrency} concurrent PUTs)")
        rss, anon = server.memory()
        print(f"server memory after the creates: RSS {rss:.0f} MiB, anonymous {anon:.0f} MiB")
        if not args.no_restart:
            server.stop()
            server.start()
        with urllib.request.urlopen(f"{server.url}/v1/buckets/{bucket}") as r:
            count = json.loads(r.read())["streams"]
        before = server.memory()
        print(f"bucket metadata: streams={count:,}; server memory before listing: "
              f"RSS {before[0]:.0f} MiB, anonymous {before[1]:.0f} MiB")
        results["memory_before_mib"] = {"rss": round(before[0], 1), "anon": round(before[1], 1)}
        for n in (1, 2):
            with PeakSampler(server) as peak:
                t0 = time.perf_counter()
                lat, seen = asyncio.run(list_all(server.url, bucket, args.limit))
                total = time.perf_counter() - t0
            after = server.memory()
            if seen != args.streams:
                raise RuntimeError(f"listed {seen} streams, created {args.streams}")
            row = {
                "pages": len(lat), "total_seconds": round(total, 2),
                "page_ms": {"p50": round(statistics.median(lat), 1), "p95": round(pct(lat, 0.95), 1),
                            "max": round(max(lat), 1), "first": round(lat[0], 1)},
                "memory_after_mib": {"rss": round(after[0], 1), "anon": round(after[1], 1)},
                "memory_peak_mib": {"rss": round(peak.peak[0], 1), "anon": round(peak.peak[1], 1)},
            }
            results[f"pass{n}"] = row
            print(f"listing pass {n}: {len(lat)} pages of {args.limit} in {total:.2f} s; per page "
                  f"p50 {row['page_ms']['p50']} ms, p95 {row['page_ms']['p95']} ms, max {row['page_ms']['max']} ms "
                  f"(first {row['page_ms']['first']} ms); server memory after: RSS {after[0]:.0f} MiB, "
                  f"anonymous {after[1]:.0f} MiB (peak {peak.peak[0]:.0f} / {peak.peak[1]:.0f} MiB)")
        db = sum(f.stat().st_size for f in (work / "data" / "wal").glob("*.mdb"))
        results["wal_file_mib"] = round(db / MiB, 1)
        print(f"WAL file: {db / MiB:.0f} MiB")
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        return 0
    finally:
        server.stop()
        if not args.keep_data:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"data kept in {work}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
