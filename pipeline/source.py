"""The `ds3` Spark data source: batch reads of sealed history (plus, on request, the unsealed
tail over HTTP), the streaming reader (pipeline/streaming.py) and the writer
(pipeline/writer.py).

    from pipeline.source import register
    register(spark)
    df = spark.read.format("ds3").option("store", "s3://bucket/ds3").option("stream", "orders").load()

Planning runs on the driver (descriptors, chunk listings, chunk headers: pipeline/catalog.py);
each input partition is a run of consecutive chunk objects (partition_bytes), each read by the
executor with one GET (the next one's running while this one is decoded) and decoded into the
columns the read's schema asks for (pipeline/columnar.py). The tail of a stream, when asked for,
is one more partition that reads it through a ds3 reader or ingester.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.types import StructType

from pipeline import rows
from pipeline.catalog import Catalog, ChunkRef, StreamPlan, check_bucket, display_name, resolve
from pipeline.http import Client
from pipeline.options import OptionError, ReadOptions, WriteOptions
from pipeline.store import LocalSyncStore, S3SyncStore
from shared import offsets


@dataclass(frozen=True, slots=True)
class Bounds:
    """Positions of one stream to read: [lo, hi); hi None: to the end of what is there.
    lo_offset is the server's spelling of lo (where a tail read starts when lo is unsealed)."""

    lo: int = 0
    hi: int | None = None
    lo_offset: str | None = None


class ChunkGroup(InputPartition):
    """Consecutive chunk objects read by one task."""

    def __init__(self, store: LocalSyncStore | S3SyncStore, items: list[tuple[rows.Target, ChunkRef]]) -> None:
        self.store = store
        self.items = items


class TailRead(InputPartition):
    """A stream's unsealed tail, read over HTTP from `offset` up to position `stop`."""

    def __init__(self, url: str, token: str | None, url_path: str, target: rows.Target, offset: str,
                 stop: int, inherited: tuple[tuple[int, int, int], ...] = ()) -> None:
        self.url = url
        self.token = token
        self.url_path = url_path
        self.target = target
        self.offset = offset
        self.stop = stop
        self.inherited = inherited  # StreamPlan.inherited_tail


def target_of(plan: StreamPlan, bounds: Bounds) -> rows.Target:
    bucket, name = display_name(plan.path)
    return rows.Target(name, bucket, plan.content_type, bounds.lo, bounds.hi)


def plan_partitions(
    plans: Sequence[StreamPlan], bounds: dict[str, Bounds], store: LocalSyncStore | S3SyncStore,
    partition_bytes: int, tail_url: str | None = None, tail_ends: dict[str, int] | None = None,
    token: str | None = None,
) -> list[InputPartition]:
    """Chunk groups (about partition_bytes each) for every stream's sealed chunks inside its
    bounds, then, where tail_ends gives a stream's tail position, a TailRead for what lies
    between its sealed end and that position."""
    bounds = {p.url_path: _retained(p, bounds.get(p.url_path, Bounds())) for p in plans}
    items: list[tuple[rows.Target, ChunkRef]] = []
    for plan in plans:
        b = bounds[plan.url_path]
        target = target_of(plan, b)
        items += [(target, ref) for ref in plan.chunks
                  if ref.end > b.lo and (b.hi is None or ref.start < b.hi)]
    parts: list[InputPartition] = [ChunkGroup(store, g) for g in grouped(items, partition_bytes)]
    for plan in plans:
        stop = (tail_ends or {}).get(plan.url_path)
        b = bounds.get(plan.url_path, Bounds())
        if tail_url is None or stop is None:
            continue
        if b.hi is not None:
            stop = min(stop, b.hi)
        begin = max(b.lo, plan.sealed_end)
        if stop <= begin:
            continue
        offset = plan.sealed_end_offset if begin == plan.sealed_end else (b.lo_offset or "-1")
        parts.append(TailRead(tail_url, token, plan.url_path, target_of(plan, b), offset, stop,
                              plan.inherited_tail))
    return parts


def grouped(items: list[tuple[rows.Target, ChunkRef]],
            partition_bytes: int) -> list[list[tuple[rows.Target, ChunkRef]]]:
    """`items` (in order) cut into runs of consecutive items of at most `partition_bytes` (a
    bigger chunk is a run of its own: never split), each run as long as it can be. Greedy from
    the start, so a read over a longer range of the same streams has the same first runs: the
    writer's producer ids are per input partition (pipeline/writer.py), and a job re-run over a
    stream that grew meanwhile sends the same rows again under the same ids."""
    groups: list[list[tuple[rows.Target, ChunkRef]]] = []
    size = 0
    for item in items:
        if not groups or size + item[1].object_size > partition_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1].object_size
    return groups


def _retained(plan: StreamPlan, b: Bounds) -> Bounds:
    """Reads start no earlier than the earliest retained position (after a snapshot)."""
    if b.lo >= plan.earliest:
        return b
    return Bounds(plan.earliest, b.hi, plan.earliest_offset)


def read_partition(partition: InputPartition, columns: Sequence[str] = rows.COLUMNS) -> Iterator[pa.RecordBatch]:
    """Executor side: the rows of one partition, as Arrow record batches with `columns`."""
    if isinstance(partition, ChunkGroup):
        for (target, ref), obj in prefetched(partition):
            batch = rows.chunk_batch(target, ref, obj, columns)
            if batch.num_rows:
                yield batch
    elif isinstance(partition, TailRead):
        client = Client(partition.url, partition.token)
        try:
            pages = list(client.catch_up(partition.url_path, partition.offset, partition.stop))
        finally:
            client.close()
        batch = rows.tail_batch(rows.Target(partition.target.stream, partition.target.bucket,
                                            partition.target.content_type, partition.target.lo,
                                            partition.stop), pages, partition.inherited)
        if batch.num_rows:
            yield rows.project(batch, columns)
    else:
        raise TypeError(f"not a ds3 partition: {partition!r}")


def prefetched(group: ChunkGroup, ahead: int = 1) -> Iterator[tuple[tuple[rows.Target, ChunkRef], bytes]]:
    """The group's items with their objects, in order; the next objects' GETs run (in threads:
    boto3 waits on the socket without the GIL) while the caller decodes this one and Spark
    takes its rows, so a task's time is about the larger of the two, not their sum. `ahead`
    objects ahead at most: a task holds ahead + 1 objects in memory."""
    if len(group.items) < 2:
        for item in group.items:
            yield item, group.store.get(item[1].key)
        return
    pool = ThreadPoolExecutor(ahead, thread_name_prefix="ds3-prefetch")
    try:
        pending = deque(pool.submit(group.store.get, ref.key) for _, ref in group.items[:ahead])
        for i, item in enumerate(group.items):
            obj = pending.popleft().result()
            if i + ahead < len(group.items):
                pending.append(pool.submit(group.store.get, group.items[i + ahead][1].key))
            yield item, obj
    finally:  # (also when Spark stops early, e.g. for a LIMIT)
        pool.shutdown(wait=False, cancel_futures=True)


def columns_of(schema: StructType) -> tuple[str, ...]:
    """The columns a read builds: Spark's read schema is the full row schema, or a projection
    of it the user gave (`spark.read.format("ds3").schema("offset string, message binary")`):
    Python data sources are not told which columns a query uses, so declaring fewer is how a
    read skips building the others. Each must be a row column with its type, nullable."""
    from pyspark.sql.pandas.types import to_arrow_schema

    columns = []
    for field in to_arrow_schema(schema, timezone="UTC"):
        if field.name not in rows.ARROW_SCHEMA.names:
            raise OptionError("schema", f"no column {field.name!r} in ds3 rows ({rows.SCHEMA_DDL})")
        want = rows.ARROW_SCHEMA.field(field.name)
        if not field.type.equals(want.type) or not field.nullable:
            raise OptionError("schema", f"column {field.name!r} is {rows.SPARK_TYPES[field.name]} (nullable) in "
                              f"ds3 rows, not {schema[field.name].dataType.simpleString()}"
                              f"{'' if field.nullable else ' not null'}")
        columns.append(field.name)
    return tuple(columns)


def bounds_for(opts: ReadOptions, plans: Sequence[StreamPlan]) -> dict[str, Bounds]:
    out = {}
    for plan in plans:
        start = opts.start.get(plan.url_path)
        end = opts.end.get(plan.url_path)
        out[plan.url_path] = Bounds(
            lo=start.position if start else 0, hi=end.position if end else None,
            lo_offset=str(start) if start else None,
        )
    return out


def tail_ends(url: str, plans: Sequence[StreamPlan], token: str | None = None) -> dict[str, int]:
    """Each stream's tail position now (HEAD on the reader or ingester)."""
    client = Client(url, token)
    try:
        return {p.url_path: offsets.parse(client.tail_offset(p.url_path)).position for p in plans}
    finally:
        client.close()


def batch_options(options: Mapping[str, str]) -> ReadOptions:
    """A batch read's options: a streaming one among them is refused (it was taken without a
    word, as if it bounded the read: found by QA)."""
    opts = ReadOptions.parse(options)
    if opts.max_chunks_per_trigger is not None:
        raise OptionError("max_chunks_per_trigger", "applies to streaming reads (spark.readStream) only")
    return opts


class DS3BatchReader(DataSourceReader):
    """A batch read's plan and its tasks. No filter pushdown: Spark 4.3 keeps the plan a Python
    source makes for pushed filters (PythonScanBuilder.pushFilters -> setReadInfo on the
    DataFrame's PythonDataSourceV2) and answers every later query of that DataFrame from it,
    filtered or not: a plan pruned for `offset >= X` made a later plain count of the same
    DataFrame count from X (found by QA). The JVM chunk reader (pipeline.jvm) prunes: a Java
    source's scan is built again for each query."""

    def __init__(self, opts: ReadOptions, columns: Sequence[str] = rows.COLUMNS) -> None:
        self.opts = opts
        self.columns = tuple(columns)

    def partitions(self) -> Sequence[InputPartition]:
        o = self.opts
        catalog = Catalog(o.store)
        descs = resolve(catalog, o.selection.paths, o.selection.path_prefix)
        if not descs:
            check_bucket(catalog, o.selection.paths, o.selection.path_prefix)
        plans = catalog.plans(descs, dict(o.start))
        ends = tail_ends(o.url, plans, o.token) if o.include_tail and o.url else None
        parts = plan_partitions(plans, bounds_for(o, plans), o.store, o.partition_bytes, o.url, ends, o.token)
        return parts or [ChunkGroup(o.store, [])]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition, self.columns)


class DS3DataSource(DataSource):
    """`format("ds3")`: see docs/pipeline.md for the options."""

    @classmethod
    def name(cls) -> str:
        return "ds3"

    def schema(self) -> str:
        return rows.SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return DS3BatchReader(batch_options(self.options), columns_of(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from pipeline.streaming import DS3StreamReader

        return DS3StreamReader(ReadOptions.parse(self.options), columns_of(schema))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from pipeline.writer import DS3Writer

        return DS3Writer(WriteOptions.parse(self.options), schema, overwrite)


def register(spark: SparkSession) -> None:
    """Make `format("ds3")` available in this session."""
    spark.dataSource.register(DS3DataSource)
