"""Read throughput of the `ds3` Spark data source against reading the same stream over HTTP
through a `ds3 reader`, in one run on one machine, for a JSON stream and a byte stream.

    .venv/bin/python scripts/bench_pipeline.py                 # 256 MiB each, 1 KiB JSON / 4 KiB byte messages
    .venv/bin/python scripts/bench_pipeline.py --mib 64 --message-bytes 200 --master local[2]
    .venv/bin/python scripts/bench_pipeline.py --store file    # a local-directory store, no S3

It starts moto's S3 server (in this process; or, with --store file, uses a directory), a `ds3
ingester` sealing 8 MiB chunks into it and
a `ds3 reader`, and appends two streams: `json` (1 MiB JSON-array POSTs) and `bytes`
(application/octet-stream, one message per POST, 16 at a time); closes them (so every byte is
sealed) and waits for the uploads. Then, per stream, each read twice (the better run counts):

- `boto3`: GET every chunk object, 2 threads: what moto itself can serve (the ceiling; with
  --store file, plain file reads);
- `http`: a catch-up read through the reader, offset by offset until Stream-Up-To-Date
  (aiohttp, one connection; sealed reads come from the store, never the ingester);
- `spark`: `spark.read.format("ds3")` on --master, counting rows and summing message lengths:
  every row with all ten columns built and handed to the JVM (Python data sources are not
  told which columns a query uses);
- `spark, 1 column`: the same query with the schema declared as `message binary` (the
  data source's projection: only that column is built);
- `Spark JVM chunk reader`: the same two queries through `pipeline.jvm.load` (chunks fetched
  and decoded in Spark's JVM: pipeline/jvm/), planned by the same catalog;
- `Spark floor`: the same one-column query over a Python data source that reads nothing and
  decodes nothing: it yields Arrow batches built once, of the same messages (count, sizes,
  messages per batch, partitions). What Spark's Python data sources cost on --master before
  any data source's own work: no Python data source can read faster here.

MB/s counts stored message bytes (each JSON message with its ',' delimiter); `x http` is the
read's messages/s over the HTTP read's, same stream, same run; `CPU s` is the CPU time the read
cost in this process (moto, the Spark driver) and every process under it (the ds3 servers,
Spark's JVM and Python workers): on a shared machine the wall clock also counts others' work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import psutil  # type: ignore[import-untyped, unused-ignore]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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


async def fill_bytes(url: str, total: int, message_bytes: int, concurrency: int = 16) -> tuple[int, str]:
    """Append about `total` bytes as messages of `message_bytes` (one POST each, `concurrency`
    at a time); return (messages, tail offset)."""
    n = -(-total // message_bytes)
    headers = {"Content-Type": "application/octet-stream"}
    tail = ""
    async with aiohttp.ClientSession() as s:
        async with s.put(url, headers=headers) as r:
            assert r.status == 201, await r.text()

        async def post(i: int) -> str:
            body = i.to_bytes(8, "big") * (message_bytes // 8) + b"x" * (message_bytes % 8)
            async with s.post(url, data=body, headers=headers) as r:
                assert r.status in (200, 204), await r.text()
                return r.headers["Stream-Next-Offset"]

        for first in range(0, n, concurrency):
            got = await asyncio.gather(*(post(i) for i in range(first, min(n, first + concurrency))))
            tail = max([tail, *got])
        async with s.post(url, headers={"Stream-Closed": "true"}) as r:
            assert r.status in (200, 204)
    return n, tail


async def http_read(url: str, json_mode: bool) -> tuple[int, int]:
    """Catch-up read from -1 to the end: (bytes of message data, pages)."""
    offset, size, pages = "-1", 0, 0
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(url, params={"offset": offset}) as r:
                body = await r.read()
                assert r.status == 200, r.status
                pages += 1
                if json_mode:  # '[' m1,...,mn ']' = stored bytes
                    size += len(body) - 1 if len(body) > 2 else 0
                else:
                    size += len(body)
                offset = r.headers["Stream-Next-Offset"]
                if r.headers.get("Stream-Up-To-Date") == "true":
                    return size, pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="size of each stream in MiB (default 256)")
    ap.add_argument("--message-bytes", type=int, default=1024, help="bytes per JSON message (default 1024)")
    ap.add_argument("--binary-message-bytes", type=int, default=4096,
                    help="bytes per message of the byte stream (default 4096; one POST each)")
    ap.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    ap.add_argument("--runs", type=int, default=2, help="runs of each read; the best is reported")
    ap.add_argument("--partition-bytes", type=int, help="the data source's partition_bytes option")
    ap.add_argument("--only", choices=["json", "bytes"], help="one stream only")
    ap.add_argument("--store", choices=["s3", "file"], default="s3",
                    help="moto's S3 (default) or a local directory (file://)")
    args = ap.parse_args()

    with aws_test_env(), MotoS3() as s3, tempfile.TemporaryDirectory() as tmp:
        bucket = s3.new_bucket()
        store = StoreView.s3_store(s3, bucket) if args.store == "s3" else StoreView.local(Path(tmp) / "objects")
        endpoint = {"endpoint_url": s3.endpoint} if args.store == "s3" else {}
        with Cluster(Path(tmp), store, seal_bytes=8 * MiB, seal_age=600) as c:
            from pipeline.catalog import Catalog
            from pipeline.store import open_sync_store

            catalog = Catalog(open_sync_store(store.url, **endpoint))
            streams: dict[str, tuple[int, int, int]] = {}  # name: messages, stored bytes, chunks
            for name in ("json", "bytes"):
                if args.only not in (None, name):
                    continue
                t = time.perf_counter()
                url = f"{c.ingester.url}/v1/stream/{name}"
                if name == "json":
                    messages, tail = asyncio.run(fill(url, args.mib * MiB, args.message_bytes))
                else:
                    messages, tail = asyncio.run(fill_bytes(url, args.mib * MiB, args.binary_message_bytes))
                end = int(tail.split("_")[1])
                desc = catalog.descriptor(name)
                assert desc is not None
                wait_for(partial(lambda d, e: catalog.plan(d).sealed_end == e, desc, end), 300,
                         "every chunk sealed", interval=0.5)
                streams[name] = (messages, end, len(store.chunk_keys(store.uid(name))))
                print(f"stream {name}: {messages:,} messages, {end / MiB:.1f} MiB stored, {streams[name][2]} chunks "
                      f"(written and sealed in {time.perf_counter() - t:.1f} s)", flush=True)

            client = s3.client()
            results: list[tuple[str, str, Run]] = []
            from pipeline.session import spark_session

            spark = spark_session(args.master, "ds3-bench", {"spark.ui.showConsoleProgress": "false"})
            try:
                for name, (messages, end, _) in streams.items():
                    chunk_keys = store.chunk_keys(store.uid(name))

                    def get_all(keys: list[str] = chunk_keys, m: int = messages) -> tuple[int, int]:
                        def get(k: str) -> int:
                            if args.store == "file":
                                return len(store.get(k))
                            return len(client.get_object(Bucket=bucket, Key=store.prefix + k)["Body"].read())
                        with ThreadPoolExecutor(2) as pool:
                            return m, sum(pool.map(get, keys))

                    ceiling = "boto3 GET" if args.store == "s3" else "file read"
                    results.append((name, f"{ceiling} of every chunk object (2 threads)", best(args.runs, get_all)))
                    run = best(args.runs, partial(http_catch_up, f"{c.reader.url}/v1/stream/{name}", name == "json",
                                                  messages))
                    assert run.size == end, (run.size, end)
                    results.append((name, "HTTP catch-up through ds3 reader", run))
                    opts = {"store": store.url, **endpoint, "stream": name}
                    if args.partition_bytes:
                        opts["partition_bytes"] = str(args.partition_bytes)
                    for via, label, schema in (
                            ("python", "", None), ("python", ", 1 column", "message binary"),
                            ("jvm", "", None), ("jvm", ", 1 column", "message binary")):
                        read = partial(spark_read, spark, opts, schema, 1 if name == "json" else 0, via)
                        read()  # warm-up: Python workers, imports, the JIT
                        run = best(args.runs, read)
                        assert (run.messages, run.size) == (messages, end), (run, messages, end)
                        what = "Spark data source" if via == "python" else "Spark JVM chunk reader"
                        results.append((name, f"{what}, {args.master}{label}", run))
                    partitions = spark.read.format("ds3").options(**opts).load().rdd.getNumPartitions()
                    floor = partial(spark_floor, spark, name, messages, end, streams[name][2], partitions)
                    floor()
                    run = best(args.runs, floor)  # (the same bytes but for the sizes' rounding)
                    assert run.messages == messages and 0 <= end - run.size < messages, (run, messages, end)
                    results.append((name, "Spark floor: no I/O, no decoding, 1 column", run))
            finally:
                spark.stop()

            print(f"{'stream':<6} {'read':<48} {'seconds':>8} {'CPU s':>6} {'messages/s':>12} {'MB/s':>8} "
                  f"{'x http':>7}")
            http = {name: r.messages / r.seconds for name, what, r in results if what.startswith("HTTP")}
            for name, what, r in results:
                rate = r.messages / r.seconds
                print(f"{name:<6} {what:<48} {r.seconds:8.2f} {r.cpu:6.2f} {rate:12,.0f} "
                      f"{r.size / r.seconds / 1e6:8.1f} {rate / http[name]:7.2f}")


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu: float  # CPU seconds of this process (moto, the Spark driver) and every process under it
    messages: int
    size: int


def cpu_seconds() -> float:
    """CPU time of this process and its descendants (the ds3 servers, Spark's JVM and Python
    workers): the work a read costs, which a shared machine's wall clock hides."""
    total = sum(psutil.Process().cpu_times()[:2])
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue  # gone meanwhile
        total += t.user + t.system + t.children_user + t.children_system
    return float(total)


def http_catch_up(url: str, json_mode: bool, messages: int) -> tuple[int, int]:
    return messages, asyncio.run(http_read(url, json_mode))[0]


def best(runs: int, f: Callable[[], tuple[int, int]]) -> Run:
    """The fastest of `runs` calls of `f` (which answers messages, bytes)."""
    out: list[Run] = []
    for _ in range(runs):
        cpu, t = cpu_seconds(), time.perf_counter()
        messages, size = f()
        out.append(Run(time.perf_counter() - t, cpu_seconds() - cpu, messages, size))
    return min(out, key=lambda r: r.seconds)


def spark_read(spark: Any, opts: dict[str, str], schema: str | None, delimiter: int,
               via: str = "python") -> tuple[int, int]:
    """count(*) and the stored bytes of a `ds3` read, with a declared schema when given: through
    the Python data source (`via` python) or the JVM chunk reader (pipeline/jvm.py)."""
    if via == "jvm":
        from pipeline import jvm

        df = jvm.load(spark, opts, schema)
    else:
        reader = spark.read.format("ds3").options(**opts)
        df = (reader if schema is None else reader.schema(schema)).load()
    row = df.selectExpr("count(*) AS n", f"sum(length(message) + {delimiter}) AS bytes").first()
    assert row is not None
    return int(row["n"]), int(row["bytes"])

def spark_floor(spark: Any, name: str, messages: int, stored: int, chunks: int, partitions: int) -> tuple[int, int]:
    """The one-column query over a Python data source yielding prebuilt batches of messages
    of the stream's mean size (JSON messages' stored bytes count their ',' delimiter), one
    batch per chunk, spread over `partitions` partitions: the query's cost with nothing read."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    delimiter = 1 if name == "json" else 0
    size = stored // messages - delimiter
    per_chunk = -(-messages // chunks)

    class FloorReader(DataSourceReader):
        def partitions(self) -> list[InputPartition]:
            return [InputPartition(i) for i in range(partitions)]

        def read(self, partition: InputPartition) -> Any:
            import pyarrow as pa  # type: ignore[import-untyped]

            mine = [c for c in range(chunks) if c % partitions == partition.value]
            batch = pa.RecordBatch.from_arrays([pa.array([b"x" * size] * per_chunk, pa.binary())], ["message"])
            for c in mine:
                yield batch.slice(0, min(per_chunk, messages - c * per_chunk))

    class Floor(DataSource):
        @classmethod
        def name(cls) -> str:
            return "ds3benchfloor"

        def schema(self) -> str:
            return "message binary"

        def reader(self, schema: Any) -> DataSourceReader:
            return FloorReader()

    spark.dataSource.register(Floor)
    row = spark.read.format("ds3benchfloor").load().selectExpr(
        "count(*) AS n", f"sum(length(message) + {delimiter}) AS bytes").first()
    assert row is not None
    return int(row["n"]), int(row["bytes"])


if __name__ == "__main__":
    main()
