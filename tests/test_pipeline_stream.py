"""Structured Streaming with the `ds3` data source (issue 5): new sealed chunks become new
micro-batches; a query restarted from its checkpoint neither skips nor repeats a message
(file sink: the memory sink cannot restart); trigger(availableNow=True) honours
max_chunks_per_trigger; include_tail reads the unsealed tail, and a restart after that tail
was sealed continues exactly where the tail read stopped."""

from __future__ import annotations

import itertools
import json
import logging
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from shared import offsets
from tests.cluster import wait_for
from tests.pipeline_fixtures import PipelineEnv
from tests.test_pipeline_read import JSON, json_bodies, write_closed


def start(env: PipelineEnv, spark: Any, work: Path, trigger: dict[str, Any], **options: str) -> Any:
    df = spark.readStream.format("ds3").options(**env.source_options(**options)).load()
    return (df.writeStream.format("parquet").option("path", str(work / "sink"))
            .option("checkpointLocation", str(work / "checkpoint")).trigger(**trigger).start())


def sink_rows(spark: Any, work: Path) -> list[Any]:
    return list(spark.read.parquet(str(work / "sink")).orderBy("position").collect())


def assert_exactly(rows: list[Any], expected: list[Any], tail: str | None = None) -> None:
    """The rows are the stream's first len(expected) messages, each once, in a gapless chain."""
    assert [json.loads(r.value) for r in rows] == expected
    assert rows[0].position == 0
    for a, b in itertools.pairwise(rows):
        assert a.next_offset == b.offset, f"gap or repeat between {a.next_offset} and {b.offset}"
    if tail is not None:
        assert rows[-1].next_offset == tail


def sealed_end(env: PipelineEnv, path: str) -> int:
    from pipeline.catalog import Catalog
    from pipeline.options import ReadOptions

    catalog = Catalog(ReadOptions.parse(env.source_options(stream=path)).store)
    desc = catalog.descriptor(path)
    return catalog.plan(desc).sealed_end if desc else 0


def test_new_seals_become_batches_and_a_restart_neither_skips_nor_repeats(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path
) -> None:
    env, name = pipeline_env, "live/restart"
    url = f"/v1/stream/{name}"
    bodies = json_bodies(120, 21)
    expected = [m for b in bodies for m in json.loads(b)]
    env.create(url, JSON)
    env.append_all(url, bodies[:40], JSON)
    q1 = start(env, spark, tmp_path, {"processingTime": "0.2 seconds"}, stream=name)
    try:
        q1.processAllAvailable()
        first = sealed_end(env, name)
        assert first > 0
        env.append_all(url, bodies[40:80], JSON)  # more chunks roll and are uploaded
        wait_for(lambda: sealed_end(env, name) > first + 4096, 20, "new chunks sealed")
        q1.processAllAvailable()
        batches = [p for p in q1.recentProgress if p["numInputRows"] > 0]
        assert len(batches) >= 2, "the new chunks came as a new micro-batch"
    finally:
        q1.stop()
    before = sink_rows(spark, tmp_path)
    assert_exactly(before, expected[: len(before)])
    assert before[-1].position + len(before[-1].message) + 1 >= first + 4096  # the later seals were read

    env.append_all(url, bodies[80:], JSON)
    env.close(url)
    tail = env.pages(url)[-1].next_offset
    env.wait_sealed(name, offsets.parse(tail).position)
    q2 = start(env, spark, tmp_path, {"processingTime": "0.2 seconds"}, stream=name)
    try:
        q2.processAllAvailable()
    finally:
        q2.stop()
    assert_exactly(sink_rows(spark, tmp_path), expected, tail)


def test_available_now_honours_max_chunks_per_trigger(pipeline_env: PipelineEnv, spark: Any, tmp_path: Path) -> None:
    env, name = pipeline_env, "live/capped"
    url = f"/v1/stream/{name}"
    bodies = json_bodies(90, 22)
    env.create(url, JSON)
    env.append_all(url, bodies, JSON)
    env.close(url)
    tail = env.pages(url)[-1].next_offset
    env.wait_sealed(name, offsets.parse(tail).position)
    chunk_ends = sorted({r.next_offset for r in env.read(spark, stream=name).collect()} & {
        p.next_offset for p in env.pages(url)})  # page ends of sealed reads are chunk ends
    assert len(chunk_ends) >= 5
    q = start(env, spark, tmp_path, {"availableNow": True}, stream=name, max_chunks_per_trigger="2")
    assert q.awaitTermination(120)
    ends = [json.loads(p["sources"][0]["endOffset"])["streams"]["/v1/stream/" + name]
            for p in q.recentProgress if p["numInputRows"] > 0]
    assert ends == chunk_ends[1::2] + ([] if len(chunk_ends) % 2 == 0 else [chunk_ends[-1]])
    assert_exactly(sink_rows(spark, tmp_path), [m for b in bodies for m in json.loads(b)], tail)


def test_include_tail_then_restart_after_the_tail_is_sealed(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path
) -> None:
    env, name = pipeline_env, "live/tail"
    url = f"/v1/stream/{name}"
    bodies = json_bodies(100, 23)
    expected = [m for b in bodies for m in json.loads(b)]
    env.create(url, JSON)
    tail1 = env.append_all(url, bodies[:50], JSON)
    n = 50
    time.sleep(0.5)  # uploads of rolled chunks settle
    while sealed_end(env, name) >= offsets.parse(tail1).position:  # the last append rolled the chunk
        bodies.insert(n, b'[{"small":%d}]' % n)
        expected = [m for b in bodies for m in json.loads(b)]
        n += 1
        tail1 = env.append_all(url, bodies[n - 1 : n], JSON)
        time.sleep(0.5)
    opts = {"stream": name, "include_tail": "true", "url": env.url}
    q1 = start(env, spark, tmp_path, {"availableNow": True}, **opts)
    assert q1.awaitTermination(120)
    first = sink_rows(spark, tmp_path)
    assert_exactly(first, expected[: len(first)], tail1)

    env.append_all(url, bodies[n:], JSON)
    env.close(url)
    tail2 = env.pages(url)[-1].next_offset
    env.wait_sealed(name, offsets.parse(tail2).position)  # what was read as tail is now sealed
    q2 = start(env, spark, tmp_path, {"availableNow": True}, **opts)
    assert q2.awaitTermination(120)
    assert_exactly(sink_rows(spark, tmp_path), expected, tail2)


def test_a_stream_created_again_is_read_from_its_start(pipeline_env: PipelineEnv, spark: Any, tmp_path: Path) -> None:
    """The checkpoint holds an offset of the deleted stream; the stream created at its path
    (another uid, a shorter history) is read from its start on the restart."""
    env, name = pipeline_env, "live/again"
    old, new = json_bodies(20, 24), json_bodies(4, 25)
    write_closed(env, f"/v1/stream/{name}", name, JSON, old)
    q1 = start(env, spark, tmp_path, {"availableNow": True}, stream=name)
    assert q1.awaitTermination(120)
    assert len(sink_rows(spark, tmp_path)) == sum(len(json.loads(b)) for b in old)

    env.recreate(name, JSON, new)
    q2 = start(env, spark, tmp_path, {"availableNow": True}, stream=name)
    assert q2.awaitTermination(120)
    def canonical(m: Any) -> str:
        return json.dumps(m, sort_keys=True)

    got = Counter(canonical(json.loads(r.value)) for r in sink_rows(spark, tmp_path))
    assert got == Counter(canonical(m) for b in old + new for m in json.loads(b))


def test_a_restart_below_the_retained_start_warns(pipeline_env: PipelineEnv, caplog: Any) -> None:
    """A snapshot published while a query was stopped removes the history before it: the
    restart skips it (there is nothing else it could do) and says so in the log."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from pipeline.catalog import Catalog
    from pipeline.options import ReadOptions
    from pipeline.streaming import DS3StreamReader

    env, name = pipeline_env, "live/retained"
    url = f"/v1/stream/{name}"
    write_closed(env, url, name, JSON, json_bodies(40, 26))
    pages = env.pages(url)
    assert len(pages) >= 3
    saved, snapshot = pages[0].next_offset, pages[len(pages) // 2].next_offset
    request = urllib.request.Request(f"{env.url}{url}/snapshot/{snapshot}", data=b"[]", method="PUT",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()
    opts = ReadOptions.parse(env.source_options(stream=name))
    wait_for(lambda: (d := Catalog(opts.store).descriptor(name)) is not None and d.snapshot_offset == snapshot,
             20, "the snapshot in the store's descriptor")

    reader = DS3StreamReader(opts)
    start = {"streams": {url: saved}}
    end = reader.latestOffset(start, ReadAllAvailable())
    with caplog.at_level(logging.WARNING, "ds3.pipeline"):
        parts = reader.partitions(start, end)
    assert f"{url}: messages from position {offsets.parse(saved).position} to " \
        f"{offsets.parse(snapshot).position} were removed by retention" in caplog.text
    assert parts  # and the rest is read


def test_a_batch_of_a_deleted_stream_warns_only_when_it_skips_something(pipeline_env: PipelineEnv,
                                                                         caplog: Any) -> None:
    """Found by QA: a batch planned for a stream since deleted and created again said it skipped
    the old stream's messages up to its end when the query had read them all already."""
    from pipeline.options import ReadOptions
    from pipeline.streaming import DS3StreamReader

    env, name = pipeline_env, "live/gone"
    url = f"/v1/stream/{name}"
    write_closed(env, url, name, JSON, json_bodies(6, 27))
    old_uid, old_end = env.uid(name), env.pages(url)[-1].next_offset
    env.recreate(name, JSON, json_bodies(2, 28))
    reader = DS3StreamReader(ReadOptions.parse(env.source_options(stream=name)))
    batch = {"streams": {url: old_end}, "uids": {url: old_uid}}
    with caplog.at_level(logging.WARNING, "ds3.pipeline"):
        reader.partitions(batch, batch)  # it had read the old stream to its end: nothing skipped
    assert "skipping its messages" not in caplog.text
    with caplog.at_level(logging.WARNING, "ds3.pipeline"):
        reader.partitions({"streams": {}, "uids": {}}, batch)  # nothing of it read yet
    assert f"{url}: skipping its messages up to {old_end}" in caplog.text
