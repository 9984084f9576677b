"""Planning a read from a start offset (pipeline/catalog.py `plan(desc, start)`): a read of the
end of a long history lists and reads the headers of the chunks it needs, not of every chunk
the stream has, and plans exactly the tail of the whole plan. Offsets that are not known to be
the stream's (another stream's, a fork's, unsealed ones) plan the whole history as before.
Against chunks a real ingester sealed into moto's S3 (4 KiB chunks)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pipeline.catalog import Catalog, StreamPlan
from pipeline.store import Listed, SyncStore
from shared import offsets
from shared.descriptor import Descriptor
from tests.pipeline_fixtures import PipelineEnv

OCTET = "application/octet-stream"


@dataclass
class CountingStore:
    """A store that counts the requests made through it."""

    inner: SyncStore
    gets: int = 0
    lists: int = 0
    keys: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.inner.url

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self.gets += 1
        self.keys.append(key)
        return self.inner.get(key, start, end)

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[Listed]:
        self.lists += 1
        return self.inner.list(prefix, start_after)


def _sealed_stream(env: PipelineEnv, name: str, appends: int, seed: int) -> None:
    rng = random.Random(seed)
    env.create(f"/v1/stream/{name}", OCTET)
    env.append_all(f"/v1/stream/{name}", [rng.randbytes(rng.randint(300, 900)) for _ in range(appends)], OCTET)
    env.close(f"/v1/stream/{name}")
    tail = env.pages(f"/v1/stream/{name}")[-1].next_offset
    env.wait_sealed(name, offsets.parse(tail).position)


def _catalog(env: PipelineEnv) -> tuple[Catalog, CountingStore]:
    from pipeline.options import ReadOptions

    counting = CountingStore(ReadOptions.parse(env.source_options(stream="x")).store)
    return Catalog(counting), counting  # type: ignore[arg-type]


def _descriptor(catalog: Catalog, name: str) -> Descriptor:
    desc = catalog.descriptor(name)
    assert desc is not None
    return desc


def _same(a: StreamPlan, b: StreamPlan) -> tuple[Any, ...]:
    return (a.path, a.uid, a.content_type, a.zero_chunk, a.sealed_end, a.sealed_end_offset)


@pytest.fixture(scope="module")
def long_stream(pipeline_env: PipelineEnv) -> str:
    _sealed_stream(pipeline_env, "plan-long", 240, 31)  # about 35 chunks of 4 KiB
    return "plan-long"


def test_a_plan_from_a_late_offset_reads_only_the_chunks_from_there(pipeline_env: PipelineEnv,
                                                                      long_stream: str) -> None:
    whole_catalog, whole_store = _catalog(pipeline_env)
    whole = whole_catalog.plan(_descriptor(whole_catalog, long_stream))
    assert len(whole.chunks) >= 20
    full_gets = whole_store.gets
    # every message boundary of the last chunks, and chunk boundaries: the plan is the whole
    # plan's tail from the chunk holding the offset's position
    pages = pipeline_env.pages(f"/v1/stream/{long_stream}")
    for page in pages[-5:]:
        start = offsets.parse(page.offset)
        catalog, store = _catalog(pipeline_env)
        later = catalog.plan(_descriptor(catalog, long_stream), start)
        expected = [r for r in whole.chunks if r.end > start.position]
        assert later.chunks == tuple(expected), page.offset
        assert _same(later, whole) == _same(whole, whole)
        assert (later.earliest, later.earliest_offset) == (start.position, page.offset)
        # a descriptor, the listing from the offset's chunk, and a header per chunk planned (+1)
        assert store.gets <= 1 + len(expected) + 2, (store.gets, len(expected), full_gets)
        assert store.gets < full_gets / 3


def test_a_plan_from_the_sealed_end_is_empty_and_cheap(pipeline_env: PipelineEnv, long_stream: str) -> None:
    catalog, store = _catalog(pipeline_env)
    whole = catalog.plan(_descriptor(catalog, long_stream))
    catalog, store = _catalog(pipeline_env)
    at_end = catalog.plan(_descriptor(catalog, long_stream), offsets.parse(whole.sealed_end_offset))
    assert at_end.chunks == ()
    assert (at_end.sealed_end, at_end.sealed_end_offset) == (whole.sealed_end, whole.sealed_end_offset)
    assert store.gets <= 3


@pytest.mark.parametrize("how", ["another stream's chunk", "a chunk id no stream has", "past the sealed end",
                                 "position zero"])
def test_offsets_not_known_to_be_the_streams_plan_everything(pipeline_env: PipelineEnv, long_stream: str,
                                                              how: str) -> None:
    catalog, _ = _catalog(pipeline_env)
    whole = catalog.plan(_descriptor(catalog, long_stream))
    if how == "another stream's chunk":
        _sealed_stream(pipeline_env, "plan-other", 30, 32)
        other = catalog.plan(_descriptor(catalog, "plan-other"))
        start = offsets.parse(other.chunks[1].end_offset)
    elif how == "a chunk id no stream has":
        start = offsets.Offset(whole.chunks[-1].chunk + 1000, whole.chunks[-2].end)
    elif how == "past the sealed end":
        start = offsets.Offset(whole.chunks[-1].chunk, whole.sealed_end + 10)
    else:
        start = offsets.Offset(whole.chunks[3].chunk, 0)
    got = catalog.plan(_descriptor(catalog, long_stream), start)
    assert got.chunks == whole.chunks and got.earliest == 0


def test_a_forks_plan_from_an_offset_is_its_whole_history(pipeline_env: PipelineEnv, long_stream: str) -> None:
    env = pipeline_env
    pages = env.pages(f"/v1/stream/{long_stream}")
    fork_at = pages[len(pages) // 2].offset
    env.create("/v1/stream/plan-fork", OCTET, **{"Stream-Forked-From": f"/v1/stream/{long_stream}",
                                                 "Stream-Fork-Offset": fork_at})
    env.append_all("/v1/stream/plan-fork", [b"f" * 700] * 12, OCTET)
    env.close("/v1/stream/plan-fork")
    tail = env.pages("/v1/stream/plan-fork")[-1].next_offset
    env.wait_sealed("plan-fork", offsets.parse(tail).position)
    catalog, _ = _catalog(env)
    whole = catalog.plan(_descriptor(catalog, "plan-fork"))
    later = catalog.plan(_descriptor(catalog, "plan-fork"), offsets.parse(whole.chunks[-1].start_offset))
    assert later.chunks == whole.chunks


def test_a_read_from_a_start_offset_plans_from_it(pipeline_env: PipelineEnv, long_stream: str,
                                                   spark: Any) -> None:
    """The data source's planning with start_offset, and a query's `offset >=` filter: the rows
    are the whole read's from there; with start_offset the planner read a few headers, not all
    (a filter is not pushed to the Python source: see pipeline.source.DS3BatchReader)."""
    from pyspark.sql import functions as F

    from pipeline.options import ReadOptions
    from pipeline.source import ChunkGroup, DS3BatchReader

    env = pipeline_env
    everything = env.read(spark, stream=long_stream).orderBy("position").collect()
    start = everything[-40].offset
    by_option = env.read(spark, stream=long_stream, start_offset=start).orderBy("position").collect()
    by_filter = env.read(spark, stream=long_stream).filter(F.col("offset") >= start).orderBy("position").collect()
    assert by_option == by_filter == everything[-40:]

    def planned(reader: DS3BatchReader) -> tuple[int, int]:
        counting = CountingStore(reader.opts.store)
        reader.opts = dataclasses.replace(reader.opts, store=counting)  # type: ignore[arg-type]
        parts = reader.partitions()
        return counting.gets, sum(len(p.items) for p in parts if isinstance(p, ChunkGroup))

    whole_gets, whole_chunks = planned(DS3BatchReader(ReadOptions.parse(env.source_options(stream=long_stream))))
    option_gets, option_chunks = planned(DS3BatchReader(ReadOptions.parse(
        env.source_options(stream=long_stream, start_offset=start))))
    assert 0 < option_chunks < whole_chunks / 3
    assert option_gets < whole_gets / 3, (whole_gets, option_gets)
