"""Sealed catch-up through a `ds3 reader` against reading the same chunk objects directly, in one
run on one machine (issue: the relay must reach at least 80% of a direct GET).

    .venv/bin/python scripts/bench_catchup.py                   # 64 MiB, both stores, binary and JSON
    .venv/bin/python scripts/bench_catchup.py --mib 128 --stores local --runs 5

For each store (moto's S3 server as a process; a local directory) and each content type it
writes a stream of 64 KiB appends (binary) or 1 KiB JSON messages through a `ds3 ingester` that
seals 8 MiB chunks, closes it, waits until every chunk is sealed, then times, best of --runs:

- `direct`: every chunk object's data range fetched in turn with a ranged HTTP GET by the same
  client (straight from moto for S3; from a plain aiohttp file server over the store's directory,
  sendfile, for the local store): what the store itself can deliver over HTTP;
- `reader`: a catch-up from -1 through the reader (one aiohttp connection, page by page until
  Stream-Up-To-Date). Sealed pages come from the store; the ingester is not asked.

MiB/s counts stored bytes (JSON messages with their ',' delimiter). The ratio reader/direct is
the figure the target is about; the reader runs with one worker. The servers run this tree's
code (PYTHONPATH is set for them). The two reads alternate (direct, reader, direct, ...), so a
slow moment of the machine falls on both: the report gives the ratio of the best runs and the
median of the runs' pairwise ratios, and the CPU seconds per GiB of each process a read
involves (the store's server, the reader, the client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # type: ignore[import-untyped, unused-ignore]  # noqa: E402
from bench_run import tree_cpu_seconds  # noqa: E402

from shared import chunks  # noqa: E402
from tests.cluster import Cluster, StoreView, wait_for  # noqa: E402
from tests.moto_keepalive import MotoProcess  # noqa: E402
from tests.procs import free_port  # noqa: E402
from tests.s3server import MotoS3, aws_test_env  # noqa: E402

MiB = 1024 * 1024
TARGET = 0.8


async def fill(url: str, total: int, json_mode: bool) -> int:
    """Append about `total` stored bytes and close the stream; the tail position."""
    ctype = "application/json" if json_mode else "application/octet-stream"
    tail = ""
    async with aiohttp.ClientSession() as s:
        async with s.put(url, headers={"Content-Type": ctype}) as r:
            assert r.status == 201, await r.text()
        written, n = 0, 0
        while written < total:
            if json_mode:
                msgs = [json.dumps({"n": n + i, "pad": "x" * 990}) for i in range(64)]
                body = ("[" + ",".join(msgs) + "]").encode()
                n += 64
                written += sum(len(m) + 1 for m in msgs)
            else:
                body = os.urandom(64 * 1024)
                written += len(body)
            async with s.post(url, data=body, headers={"Content-Type": ctype}) as r:
                assert r.status in (200, 204), await r.text()
                tail = r.headers["Stream-Next-Offset"]
        async with s.post(url, headers={"Stream-Closed": "true", "Content-Type": ctype}) as r:
            assert r.status in (200, 204), await r.text()
    return int(tail.split("_")[1])


async def catch_up(url: str) -> tuple[int, int]:
    """(stored bytes read, pages) of a catch-up from -1 through `url`."""
    offset, size, pages = "-1", 0, 0
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        while True:
            async with s.get(url, params={"offset": offset}) as r:
                assert r.status == 200, r.status
                json_mode = r.headers["Content-Type"].startswith("application/json")
                n = 0
                async for piece in r.content.iter_chunked(1 << 20):
                    n += len(piece)
                size += (n - 1 if n > 2 else 0) if json_mode else n  # '[' m1,...,mn ']' = stored bytes
                pages += 1
                offset = r.headers["Stream-Next-Offset"]
                if r.headers.get("Stream-Up-To-Date") == "true":
                    return size, pages


async def ranged_gets(urls: list[tuple[str, int, int]]) -> int:
    """GET each (url, lo, hi) byte range in turn on one connection; the bytes received."""
    total = 0
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        for url, lo, hi in urls:
            async with s.get(url, headers={"Range": f"bytes={lo}-{hi - 1}"}) as r:
                assert r.status == 206, (url, r.status)
                async for piece in r.content.iter_chunked(1 << 20):
                    total += len(piece)
    return total


STATIC_SERVER = """
import sys
from aiohttp import web
async def get(request):
    return web.FileResponse(sys.argv[2] + "/" + request.match_info["key"])
app = web.Application()
app.router.add_get("/{key:.+}", get)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def static_server(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A plain HTTP file server over the store's directory (aiohttp's FileResponse on the default
    asyncio loop: sendfile, zero-copy): what a direct GET of a local object costs over HTTP."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", STATIC_SERVER, str(port), str(root)])
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(url), 20, "the static file server")
    return proc, url


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/", timeout=1)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def timed(read: Callable[[], int], want: int, procs: dict[str, psutil.Process]) -> tuple[float, dict[str, float]]:
    """(seconds, CPU seconds of each process) of one read, which must return `want` bytes. The
    reader's count its workers; the client's (this process, whose children are the servers)
    only its own."""
    me = psutil.Process()

    def cpu() -> dict[str, float]:
        return {k: float(sum(p.cpu_times()[:2])) if p.pid == me.pid else tree_cpu_seconds(p) for k, p in procs.items()}

    before, t = cpu(), time.perf_counter()
    got = read()
    took, after = time.perf_counter() - t, cpu()
    assert got == want, (got, want)
    return took, {k: after[k] - before[k] for k in procs}


def data_ranges(store: StoreView, uid: str) -> list[tuple[str, int, int]]:
    """(key, first data byte, end) of every chunk object of the stream, from their heads."""
    out = []
    for key in store.chunk_keys(uid):
        head = chunks.parse_head(store.get(key)[: 1 << 20])
        out.append((key, head.data_offset, head.data_offset + head.header.end - head.header.start))
    return out


def measure(kind: str, store: StoreView, s3: MotoS3 | None, work: Path, mib: int, runs: int,
            json_mode: bool) -> dict[str, Any]:
    name = f"{kind}-{'json' if json_mode else 'binary'}"
    with Cluster(work / name, store, seal_bytes=8 * MiB, seal_age=600, reader_args=["--workers", "1"]) as c:
        path = f"catchup-{name}"
        end = asyncio.run(fill(f"{c.ingester.url}/v1/stream/{path}", mib * MiB, json_mode))
        uid = store.uid(path)
        wait_for(lambda: sum(e - s for _, s, e in data_ranges(store, uid)) == end, 300, "every chunk sealed",
                 interval=0.5)
        ranges = data_ranges(store, uid)
        server = None
        if s3 is not None:  # presigned: moto refuses unsigned requests
            client = s3.client()
            bucket, prefix = store.url.removeprefix("s3://").split("/", 1)
            urls = [(client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": f"{prefix}/{k}"}),
                     lo, hi) for k, lo, hi in ranges]
        else:
            server = static_server(Path(store.url.removeprefix("file://")))
            urls = [(f"{server[1]}/{k}", lo, hi) for k, lo, hi in ranges]

        def direct() -> int:
            return asyncio.run(ranged_gets(urls))

        def relayed() -> int:
            n, pages[0] = asyncio.run(catch_up(f"{c.reader.url}/v1/stream/{path}"))
            return n

        pages = [0]
        assert c.reader.popen is not None
        store_pid = s3.pid if isinstance(s3, MotoProcess) else server[0].pid if server is not None else os.getpid()
        procs = {"store": psutil.Process(store_pid), "reader": psutil.Process(c.reader.popen.pid),
                 "client": psutil.Process()}
        runs_direct, runs_reader = [], []
        for _ in range(runs):  # alternating, so that a slow moment of the machine falls on both
            runs_direct.append(timed(direct, end, procs))
            runs_reader.append(timed(relayed, end, procs))
        if server is not None:
            server[0].terminate()
            server[0].wait(10)
    t_direct, t_reader = min(r[0] for r in runs_direct), min(r[0] for r in runs_reader)
    gib = end / 2**30
    out: dict[str, Any] = {
        "case": name, "mib": end / MiB, "chunks": len(ranges), "pages": pages[0], "runs": runs,
        "direct_mib_s": end / MiB / t_direct, "reader_mib_s": end / MiB / t_reader,
        "ratio_median": statistics.median(d[0] / r[0] for d, r in zip(runs_direct, runs_reader, strict=True)),
        "cpu_s_per_gib": {mode: {k: round(statistics.median(r[1][k] for r in rs) / gib, 3) for k in procs}
                          for mode, rs in (("direct", runs_direct), ("reader", runs_reader))},
    }
    out["ratio"] = out["reader_mib_s"] / out["direct_mib_s"]
    cpu = "; ".join(f"{mode} " + ", ".join(f"{k} {v:.2f}" for k, v in per.items() if k != "reader" or mode == "reader")
                    for mode, per in out["cpu_s_per_gib"].items())
    print(f"{name:14} {out['mib']:6.1f} MiB in {len(ranges)} chunks, {pages[0]} pages: direct "
          f"{out['direct_mib_s']:7.1f} MiB/s, reader {out['reader_mib_s']:7.1f} MiB/s, ratio {out['ratio']:.2f} "
          f"(median of {runs} pairs {out['ratio_median']:.2f}; {'PASS' if out['ratio'] >= TARGET else 'FAIL'} "
          f">= {TARGET})\n{'':15}CPU s per GiB, median: {cpu}", flush=True)
    return out


def main() -> None:
    # The servers are `.venv/bin/ds3` processes: make them import this tree's code (a venv shared
    # between worktrees would import another checkout's otherwise).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="stream size in MiB (default 64)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each read; the best is reported")
    ap.add_argument("--stores", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument("--types", default="binary,json", help="comma-separated: binary, json")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    results = []
    # moto_server as measured since 2026-11-24 (tests/moto_keepalive.py says why not waitress here)
    with aws_test_env(), MotoProcess(keepalive=False) as s3, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for kind in args.stores.split(","):
            for t in args.types.split(","):
                if kind == "s3":
                    store, server = StoreView.s3_store(s3, s3.new_bucket()), s3
                else:
                    store, server = StoreView.local(work / f"objects-{t}"), None
                results.append(measure(kind, store, server, work, args.mib, args.runs, t == "json"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.exit(0 if all(r["ratio"] >= TARGET for r in results) else 1)


if __name__ == "__main__":
    main()
