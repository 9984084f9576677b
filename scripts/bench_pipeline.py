"""Read throughput of the `ds3` Spark data source against reading the same stream over HTTP
through a `ds3 reader`, in one run on one machine.

    .venv/bin/python scripts/bench_pipeline.py                 # 256 MiB JSON stream, 1 KiB messages
    .venv/bin/python scripts/bench_pipeline.py --mib 64 --message-bytes 200 --master local[2]

It starts moto's S3 server (in this process), a `ds3 ingester` sealing 8 MiB chunks into it and
a `ds3 reader`, appends the stream (1 MiB JSON-array POSTs to the ingester), closes it (so every
byte is sealed) and waits for the uploads. Then, each twice (the better run is reported):

- `boto3`: GET every chunk object, 2 threads: what moto itself can serve (the ceiling);
- `http`: a catch-up read through the reader, offset by offset until Stream-Up-To-Date
  (aiohttp, one connection; sealed reads come from the store, never the ingester);
- `spark`: `spark.read.format("ds3")` on --master, counting rows and summing message lengths
  (every message is decoded on the executors and handed to the JVM).

MB/s counts stored message bytes (each JSON message with its ',' delimiter).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import best_of  # noqa: E402

from tests.cluster import Cluster, StoreView, wait_for  # noqa: E402
from tests.s3server import MotoS3, aws_test_env  # noqa: E402

MiB = 1024 * 1024


async def fill(url: str, total: int, message_bytes: int) -> tuple[int, str]:
    """Append about `total` bytes of JSON messages; return (messages, tail offset)."""
    pad = "x" * max(0, message_bytes - 40)
    per_post = max(1, MiB // (message_bytes + 1))
    n, tail = 0, ""
    async with aiohttp.ClientSession() as s:
        async with s.put(url, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 201, await r.text()
        while n * (message_bytes + 1) < total:
            body = "[" + ",".join(json.dumps({"n": n + i, "pad": pad}) for i in range(per_post)) + "]"
            async with s.post(url, data=body.encode(), headers={"Content-Type": "application/json"}) as r:
                assert r.status in (200, 204), await r.text()
                tail = r.headers["Stream-Next-Offset"]
            n += per_post
        async with s.post(url, headers={"Stream-Closed": "true"}) as r:
            assert r.status in (200, 204)
    return n, tail


async def http_read(url: str) -> tuple[int, int]:
    """Catch-up read from -1 to the end: (bytes of message data, pages)."""
    offset, size, pages = "-1", 0, 0
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(url, params={"offset": offset}) as r:
                body = await r.read()
                assert r.status == 200, r.status
                pages += 1
                size += len(body) - 1 if len(body) > 2 else 0  # '[' m1,...,mn ']' = stored bytes
                offset = r.headers["Stream-Next-Offset"]
                if r.headers.get("Stream-Up-To-Date") == "true":
                    return size, pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="stream size in MiB (default 256)")
    ap.add_argument("--message-bytes", type=int, default=1024, help="bytes per JSON message (default 1024)")
    ap.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    ap.add_argument("--runs", type=int, default=2, help="runs of each read; the best is reported")
    args = ap.parse_args()

    with aws_test_env(), MotoS3() as s3, tempfile.TemporaryDirectory() as tmp:
        bucket = s3.new_bucket()
        store = StoreView.s3_store(s3, bucket)
        with Cluster(Path(tmp), store, seal_bytes=8 * MiB, seal_age=600) as c:
            t = time.perf_counter()
            messages, tail = asyncio.run(fill(f"{c.ingester.url}/v1/stream/bench", args.mib * MiB,
                                              args.message_bytes))
            end = int(tail.split("_")[1])
            uid = store.uid("bench")
            from pipeline.catalog import Catalog
            from pipeline.store import open_sync_store

            catalog = Catalog(open_sync_store(store.url, endpoint_url=s3.endpoint))
            desc = catalog.descriptor("bench")
            assert desc is not None
            wait_for(lambda: catalog.plan(desc).sealed_end == end, 300, "every chunk sealed", interval=0.5)
            chunk_keys = store.chunk_keys(uid)
            print(f"stream: {messages:,} JSON messages, {end / MiB:.1f} MiB stored, {len(chunk_keys)} chunks "
                  f"(written and sealed in {time.perf_counter() - t:.1f} s)", flush=True)

            client = s3.client()

            def get_all() -> int:
                def get(k: str) -> int:
                    return len(client.get_object(Bucket=bucket, Key=store.prefix + k)["Body"].read())
                with ThreadPoolExecutor(2) as pool:
                    return sum(pool.map(get, chunk_keys))

            results: dict[str, tuple[float, int, int]] = {}
            took, size = best_of(args.runs, get_all)
            results["boto3 GET of every chunk object (2 threads)"] = (took, messages, size)
            took, (size, pages) = best_of(args.runs, lambda: asyncio.run(http_read(f"{c.reader.url}/v1/stream/bench")))
            assert size == end, (size, end)
            results[f"HTTP catch-up through ds3 reader ({pages} pages)"] = (took, messages, size)

            from pipeline.session import spark_session

            spark = spark_session(args.master, "ds3-bench", {"spark.ui.showConsoleProgress": "false"})
            try:
                opts = {"store": store.url, "endpoint_url": s3.endpoint, "stream": "bench"}

                def spark_read() -> tuple[int, int]:
                    row = (spark.read.format("ds3").options(**opts).load()
                           .selectExpr("count(*) AS n", "sum(length(message) + 1) AS bytes").first())
                    assert row is not None
                    return int(row["n"]), int(row["bytes"])

                spark_read()  # warm-up: Python workers, imports
                took, (n, size) = best_of(args.runs, spark_read)
                assert (n, size) == (messages, end), (n, size, messages, end)
                results[f"Spark data source, {args.master}"] = (took, n, size)
            finally:
                spark.stop()

            print(f"{'read':<52} {'seconds':>8} {'messages/s':>12} {'MB/s':>8}")
            for name, (took, n, size) in results.items():
                print(f"{name:<52} {took:8.2f} {n / took:12,.0f} {size / took / 1e6:8.1f}")


if __name__ == "__main__":
    main()
