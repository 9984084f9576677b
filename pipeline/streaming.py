"""`spark.readStream.format("ds3")`: new sealed chunks become new micro-batches.

Spark offsets are Durable Streams offsets, one per stream, keyed by the stream's URL path:

    {"streams": {"/v1/stream/orders": "0000000000000007_0000000000123456", ...}}

and, next to them, the uid of the stream each offset belongs to:

    {"streams": {...}, "uids": {"/v1/stream/orders": "<uid>", ...}}

A stream deleted and created again at the same path is another stream (another uid): its
offsets restart, so an offset saved for the old one means nothing for it, and it is read from
its start. (An offset saved without a uid, by an older ds3, is taken to be the current
stream's.)

A micro-batch (start, end] holds, for every stream, the messages between the two positions:
whole sealed chunks (end offsets normally fall on chunk ends), or with include_tail=true also
the unsealed tail up to the tail offset seen when the batch was planned, read over HTTP. Data
between two positions never changes (streams are append-only and chunks immutable), so a
batch re-planned after a restart from its checkpoint reads the same messages: from chunks if
they were sealed since, else from the tail. A stream that is not in the start offset starts at
its beginning (or its start_offset); streams created later under a `prefix`/`bucket` join in.

`max_chunks_per_trigger` caps the chunk objects (and tail reads) of one micro-batch
(Spark's ReadMaxFiles); `trigger(availableNow=True)` reads what was there when the query
started, in micro-batches of that size, then stops.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxFiles,
    SupportsTriggerAvailableNow,
)

from pipeline import rows
from pipeline.catalog import Catalog, StreamPlan, resolve
from pipeline.http import Client
from pipeline.options import ReadOptions
from pipeline.source import Bounds, ChunkGroup, plan_partitions, read_partition
from shared import offsets

SparkOffset = dict[str, Any]
log = logging.getLogger("ds3.pipeline")


def _position(offset: str | None) -> int:
    return 0 if offset is None or offset == offsets.START else offsets.parse(offset).position


class DS3StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: ReadOptions, columns: Sequence[str] = rows.COLUMNS) -> None:
        self.opts = opts
        self.columns = tuple(columns)
        self.catalog = Catalog(opts.store)
        self._target: dict[str, str] | None = None  # availableNow: where the query stops
        self._plans: dict[str, StreamPlan] = {}

    # ------------------------------------------------------------ where streams are now
    def _latest(self) -> dict[str, str]:
        """Every stream's latest readable offset: its sealed end, or its tail (include_tail),
        never past its end_offset option."""
        o = self.opts
        plans = self.catalog.plans(resolve(self.catalog, o.selection.paths, o.selection.path_prefix))
        self._plans = {p.url_path: p for p in plans}
        latest = {p.url_path: p.sealed_end_offset for p in plans}
        if o.include_tail and o.url:
            client = Client(o.url, o.token)
            try:
                for p in plans:
                    tail = client.tail_offset(p.url_path)
                    if offsets.parse(tail).position > p.sealed_end:
                        latest[p.url_path] = tail
            finally:
                client.close()
        for path, end in o.end.items():
            if end is not None and path in latest and _position(latest[path]) > end.position:
                latest[path] = str(end)
        return latest

    def _start_of(self, start: SparkOffset, path: str, uid: str | None) -> str | None:
        """Where `path` starts after `start`: its offset there, unless that offset belongs to
        an earlier stream at the path (another uid), then the stream's start."""
        got = start.get("streams", {}).get(path)
        saved_uid = start.get("uids", {}).get(path)
        if got is not None and uid is not None and saved_uid is not None and saved_uid != uid:
            return None
        if got is not None:
            return str(got)
        first = self.opts.start.get(path)
        return str(first) if first is not None else None

    # ------------------------------------------------------------ Spark's interface
    def initialOffset(self) -> SparkOffset:
        return {"streams": {k: str(v) for k, v in sorted(self.opts.start.items()) if v is not None}}

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_chunks_per_trigger
        return ReadMaxFiles(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def latestOffset(self, start: SparkOffset, limit: ReadLimit) -> SparkOffset:
        latest = self._latest()
        if self._target is not None:
            latest = {k: min(v, self._target[k], key=_position) for k, v in latest.items() if k in self._target}
        budget = limit.max_files if isinstance(limit, ReadMaxFiles) else None
        result = {str(k): str(v) for k, v in start.get("streams", {}).items()}
        uids = {str(k): str(v) for k, v in start.get("uids", {}).items()}
        for path in sorted(latest):
            uid = self._plans[path].uid
            begin = _position(self._start_of(start, path, uid))
            end = latest[path]
            if _position(end) <= begin:
                continue
            if budget is not None:
                if budget <= 0:
                    break
                end, used = self._capped(self._plans[path], begin, end, budget)
                budget -= used
            result[path] = end
            uids[path] = uid
        # without uids (nothing read yet) the offset stays equal to the initial one: no empty batch
        return {"streams": dict(sorted(result.items()))} | ({"uids": dict(sorted(uids.items()))} if uids else {})

    @staticmethod
    def _capped(plan: StreamPlan, begin: int, end: str, budget: int) -> tuple[str, int]:
        """The end offset after at most `budget` chunk reads from `begin`, and how many."""
        stop = _position(end)
        refs = [r for r in plan.chunks if r.end > begin and r.start < stop]
        tail = 1 if stop > plan.sealed_end else 0
        if len(refs) + tail <= budget or refs[budget - 1].end >= stop:
            return end, min(len(refs) + tail, budget)
        return refs[budget - 1].end_offset, budget

    def partitions(self, start: SparkOffset, end: SparkOffset) -> Sequence[InputPartition]:
        ends: dict[str, str] = end.get("streams", {})
        end_uids: dict[str, str] = end.get("uids", {})
        if any(p not in self._plans or self._plans[p].uid != end_uids.get(p, self._plans[p].uid) for p in ends):
            self._latest()  # a restart, a new stream, or one created again: plan afresh
        plans, bounds, tails = [], {}, {}
        for path, stop in sorted(ends.items()):
            plan = self._plans.get(path)
            if plan is not None and plan.uid != end_uids.get(path, plan.uid):
                # (said only when something is skipped: a batch that had read the old stream to
                # its end said it too, found by QA)
                if _position(stop) > _position(self._start_of(start, path, end_uids.get(path))):
                    log.warning("%s: skipping its messages up to %s: that stream was deleted (and created "
                                "again) before they were read", path, stop)
                continue
            lo_offset = self._start_of(start, path, end_uids.get(path))
            lo, hi = _position(lo_offset), _position(stop)
            if hi <= lo or plan is None:
                continue
            if lo < plan.earliest:
                log.warning("%s: messages from position %d to %d were removed by retention (a snapshot at %s) "
                            "before this query read them; they are skipped", path, lo, plan.earliest,
                            plan.earliest_offset)
            plans.append(plan)
            bounds[path] = Bounds(lo, hi, lo_offset)
            if hi > plan.sealed_end:
                if not (self.opts.include_tail and self.opts.url):
                    raise RuntimeError(f"{path}: history up to {stop} is no longer sealed in the store")
                tails[path] = hi
        parts = plan_partitions(plans, bounds, self.opts.store, self.opts.partition_bytes,
                                self.opts.url, tails, self.opts.token)
        return parts or [ChunkGroup(self.opts.store, [])]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition, self.columns)

    def commit(self, end: SparkOffset) -> None:
        """Nothing to release: the store keeps every chunk until the stream is deleted."""
