"""Bootstrap of a stream with a large history: does the response stream (flat memory), and how
fast is it next to a plain catch-up read of the same messages?

    .venv/bin/python scripts/bench_bootstrap.py                   # 256 MiB in 64 KiB appends
    .venv/bin/python scripts/bench_bootstrap.py --mib 64 --append-kib 16

Runs `ds3 dev` (ingester + reader, local-directory store, 8 MiB seals) on 127.0.0.1 with a
fresh data dir (deleted afterwards), writes a binary stream, publishes a small snapshot after
its first append, waits until all but the open tail is sealed, then through the reader:
  1. GET {stream}/bootstrap, read and discarded as it arrives (parts counted);
  2. a catch-up read of the same range (offset = the snapshot offset, page after page).
Memory is the RSS of the reader and the ingester, sampled every 20 ms; "flat" means the peak
during the bootstrap exceeds the RSS before it by a small fraction of the stream's size.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil  # type: ignore[import-untyped, unused-ignore]
from benchlib import DS3, MiB, free_port


class Peak:
    """Highest RSS of each process while running (sampled in a thread)."""

    def __init__(self, procs: dict[str, psutil.Process]) -> None:
        self.procs = procs
        self.peak = {name: p.memory_info().rss for name, p in procs.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for name, p in self.procs.items():
                self.peak[name] = max(self.peak[name], p.memory_info().rss)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def write(session: aiohttp.ClientSession, url: str, total: int, piece: int, concurrency: int) -> list[str]:
    async with session.put(url, headers={"Content-Type": "application/octet-stream"}) as r:
        assert r.status == 201, r.status
    body = bytes(range(256)) * (piece // 256)
    offsets: list[str] = []
    async with session.post(url, data=body, headers={"Content-Type": "application/octet-stream"}) as r:
        offsets.append(r.headers["Stream-Next-Offset"])
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem, session.post(url, data=body, headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 204, r.status

    await asyncio.gather(*(one() for _ in range(total // piece - 1)))
    async with session.head(url) as r:
        offsets.append(r.headers["Stream-Next-Offset"])
    return offsets


async def run(args: argparse.Namespace, base: str, procs: dict[str, psutil.Process]) -> None:
    url = f"{base}/v1/stream/bench-bootstrap"
    total = args.mib * MiB
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        first, tail = await write(session, url, total, args.append_kib * 1024, 32)
        print(f"wrote {args.mib} MiB in {args.append_kib} KiB appends in {time.perf_counter() - t0:.1f}s")
        async with session.put(f"{url}/snapshot/{first}", data=b'{"state":"after the first append"}',
                               headers={"Content-Type": "application/json"}) as r:
            assert r.status == 204, await r.text()
        objects = Path(args.data) / "objects" / "chunks"
        deadline = time.monotonic() + 120
        while sum(f.stat().st_size for f in objects.rglob("*") if f.is_file()) < total - 9 * MiB:
            assert time.monotonic() < deadline, "sealing did not catch up"
            await asyncio.sleep(0.2)
        before = {name: p.memory_info().rss for name, p in procs.items()}

        with Peak(procs) as peak:
            t0 = time.perf_counter()
            size = parts = 0
            async with session.get(f"{url}/bootstrap") as r:
                assert r.status == 200, r.status
                boundary = r.headers["Content-Type"].split("boundary=", 1)[1].encode()
                held = b""
                async for piece in r.content.iter_chunked(256 * 1024):
                    size += len(piece)
                    parts += (held + piece).count(b"--" + boundary) - held.count(b"--" + boundary)
                    held = piece[-64:]
                assert r.headers["Stream-Next-Offset"] == tail
            boot_s = time.perf_counter() - t0
        print(f"bootstrap: {size / MiB:.1f} MiB, {parts - 1} parts (snapshot + messages) in {boot_s:.2f}s = "
              f"{size / MiB / boot_s:.0f} MiB/s")
        for name in procs:
            grow = (peak.peak[name] - before[name]) / MiB
            print(f"  {name:9s} RSS before {before[name] / MiB:6.1f} MiB, peak {peak.peak[name] / MiB:6.1f} MiB "
                  f"(+{grow:.1f} MiB = {100 * grow / args.mib:.1f}% of the stream)")

        t0 = time.perf_counter()
        offset, read, pages = first, 0, 0
        while True:
            async with session.get(url, params={"offset": offset}) as r:
                assert r.status == 200, r.status
                read += len(await r.read())
                pages += 1
                offset = r.headers["Stream-Next-Offset"]
                if r.headers.get("Stream-Up-To-Date") == "true":
                    break
        cat_s = time.perf_counter() - t0
        print(f"catch-up read of the same range: {read / MiB:.1f} MiB in {pages} pages in {cat_s:.2f}s = "
              f"{read / MiB / cat_s:.0f} MiB/s (bootstrap/catch-up time ratio {boot_s / cat_s:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="stream size in MiB")
    ap.add_argument("--append-kib", type=int, default=64, help="size of each append")
    ap.add_argument("--data-root", default=None, help="where the temporary data dir goes")
    args = ap.parse_args()
    args.data = tempfile.mkdtemp(prefix="ds3-bench-bootstrap-", dir=args.data_root)
    port = free_port()
    dev = subprocess.Popen(
        [str(DS3), "dev", "--port", str(port), "--data-dir", args.data, "--seal-bytes", str(8 * MiB),
         "--seal-age", "1", "--log-level", "warning"],
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{base}/healthz", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        children = psutil.Process(dev.pid).children()
        procs = {("reader" if "reader" in c.cmdline() else "ingester"): c for c in children}
        asyncio.run(run(args, base, procs))
    finally:
        dev.send_signal(signal.SIGTERM)
        dev.wait(30)
        shutil.rmtree(args.data, ignore_errors=True)


if __name__ == "__main__":
    main()
