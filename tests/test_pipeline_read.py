"""Batch reads with the `ds3` Spark data source (issue 5) and the JVM chunk reader (issue 16), against chunks a real ingester
sealed into moto's S3 (4 KiB chunks): every read must equal a catch-up read of the same
stream over HTTP through the reader, byte for byte and page boundary for page boundary —
binary, text and JSON streams, a bucketed stream, a fork (its history lives partly in its
source's chunks), a prefix over several streams, an offset range, and the unsealed tail.
Bad options fail with a message that names the option."""

from __future__ import annotations

import itertools
import json
import random
import urllib.request
from typing import Any

import pytest

from pipeline.options import OptionError, ReadOptions
from shared import buckets, offsets
from tests.pipeline_fixtures import PipelineEnv, check_against_pages, has_jvm_reader

OCTET, TEXT, JSON = "application/octet-stream", "text/plain; charset=utf-8", "application/json"


def byte_bodies(n: int, seed: int, text: bool) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = rng.randint(20, 700)
        if text:
            out.append((f"<{i}:" + "".join(rng.choice("abcé€ \n") for _ in range(size)) + ">").encode())
        else:
            out.append(bytes([i % 256]) + rng.randbytes(size))
    return out


def json_bodies(n: int, seed: int) -> list[bytes]:
    """JSON appends: arrays of 1-5 messages (an array is flattened one level), some nested
    arrays and strings with commas, brackets and non-ASCII."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs: list[Any] = [
            {"i": i, "j": j, "s": "x, ]" * rng.randint(0, 30), "u": "é€😀"} for j in range(rng.randint(1, 5))
        ]
        if i % 7 == 3:
            msgs.append([1, [2, 3], "a,b"])
        out.append(json.dumps(msgs, ensure_ascii=bool(i % 2)).encode())
    return out


def sorted_rows(env: PipelineEnv, spark: Any, **options: str) -> list[Any]:
    """The read's rows in stream order, read through the Python data source; the JVM chunk
    reader (pipeline/jvm.py) reads the same rows."""
    rows = list(env.read(spark, **options).orderBy("bucket", "stream", "position").collect())
    if has_jvm_reader(spark):
        assert list(env.read(spark, "jvm", **options).orderBy("bucket", "stream", "position").collect()) == rows
    return rows


def write_closed(env: PipelineEnv, url_path: str, internal: str, ct: str, bodies: list[bytes]) -> str:
    env.create(url_path, ct)
    env.append_all(url_path, bodies, ct)
    env.close(url_path)  # closing seals the open chunk: the whole stream is in the store
    tail = env.pages(url_path)[-1].next_offset
    env.wait_sealed(internal, offsets.parse(tail).position)
    return tail


KINDS = {"binary": OCTET, "text": TEXT, "json": JSON}


def test_batch_read_equals_http_catch_up(pipeline_env: PipelineEnv, spark: Any) -> None:
    """Binary, text and JSON streams of many chunks, read with one prefix read."""
    env = pipeline_env
    written = {}
    for kind, ct in KINDS.items():
        bodies = json_bodies(120, 1) if ct == JSON else byte_bodies(80, 2, ct == TEXT)
        write_closed(env, f"/v1/stream/read/{kind}", f"read/{kind}", ct, bodies)
        written[kind] = bodies
    everything = sorted_rows(env, spark, prefix="read/")
    for kind, ct in KINDS.items():
        name, bodies = f"read/{kind}", written[kind]
        rows = [r for r in everything if r.stream == name]
        assert len({r.chunk for r in rows}) >= 5, "the stream spans several sealed chunks"
        check_against_pages(rows, env.pages(f"/v1/stream/{name}"), ct == JSON)
        assert all(r.bucket is None and r.content_type == ct for r in rows)
        assert rows[0].position == 0 and offsets.parse(rows[0].offset).position == 0
        for a, b in itertools.pairwise(rows):
            assert a.next_offset == b.offset and offsets.parse(b.offset).position == b.position
        if ct == JSON:
            expected = [m for body in bodies for m in json.loads(body)]
            assert [json.loads(r.value) for r in rows] == expected
        else:
            assert [bytes(r.message) for r in rows] == bodies  # one row per append
            assert all((r.value is None) == (ct == OCTET) for r in rows)
            if ct == TEXT:
                assert "".join(r.value for r in rows) == b"".join(bodies).decode()


def test_bucketed_stream_and_bucket_prefix(pipeline_env: PipelineEnv, spark: Any) -> None:
    env = pipeline_env
    env.put_bucket("plb1")
    for sid, seed in (("user-1", 3), ("user-2", 4), ("other", 5)):
        path = buckets.internal_path("plb1", sid)
        write_closed(env, buckets.url_path(path), path, JSON, json_bodies(40, seed))
    one = sorted_rows(env, spark, bucket="plb1", stream_id="user-1")
    check_against_pages(one, env.pages("/v1/buckets/plb1/user-1"), True)
    assert {(r.bucket, r.stream) for r in one} == {("plb1", "user-1")}

    some = sorted_rows(env, spark, bucket="plb1", prefix="user-")
    assert {r.stream for r in some} == {"user-1", "user-2"}
    check_against_pages([r for r in some if r.stream == "user-2"], env.pages("/v1/buckets/plb1/user-2"), True)
    whole = sorted_rows(env, spark, bucket="plb1")
    assert {r.stream for r in whole} == {"user-1", "user-2", "other"}
    check_against_pages([r for r in whole if r.stream == "other"], env.pages("/v1/buckets/plb1/other"), True)


def test_prefix_reads_several_plain_streams(pipeline_env: PipelineEnv, spark: Any) -> None:
    env = pipeline_env
    names = ["many/a", "many/b", "many/c/d", "manyx"]
    for i, name in enumerate(names):
        write_closed(env, f"/v1/stream/{name}", name, OCTET, byte_bodies(15 + 10 * i, 10 + i, False))
    rows = sorted_rows(env, spark, prefix="many/")
    assert sorted({r.stream for r in rows}) == ["many/a", "many/b", "many/c/d"]
    for name in names[:3]:
        check_against_pages([r for r in rows if r.stream == name], env.pages(f"/v1/stream/{name}"), False)


def test_offset_range(pipeline_env: PipelineEnv, spark: Any) -> None:
    env = pipeline_env
    write_closed(env, "/v1/stream/range", "range", JSON, json_bodies(100, 6))
    everything = sorted_rows(env, spark, stream="range")
    lo, hi = everything[37], everything[211]
    part = sorted_rows(env, spark, stream="range", start_offset=lo.offset, end_offset=hi.offset)
    assert [r.offset for r in part] == [r.offset for r in everything[37:211]]
    # the same range from HTTP: catch-up from lo, cut at hi
    pages = [p for p in env.pages("/v1/stream/range", lo.offset) if p.next_offset <= hi.offset]
    check_against_pages([r for r in part if r.next_offset <= pages[-1].next_offset], pages, True)
    assert sorted_rows(env, spark, stream="range", start_offset=hi.offset)[0].offset == hi.offset


def test_fork_reads_its_sources_chunks(pipeline_env: PipelineEnv, spark: Any) -> None:
    env = pipeline_env
    src = byte_bodies(40, 7, False)
    env.create("/v1/stream/fsrc", OCTET)
    env.append_all("/v1/stream/fsrc", src, OCTET)
    src_rows = env.pages("/v1/stream/fsrc")
    fork_at = src_rows[len(src_rows) // 2].offset  # a page boundary inside the source's history
    env.create("/v1/stream/fork", OCTET, **{"Stream-Forked-From": "/v1/stream/fsrc", "Stream-Fork-Offset": fork_at})
    env.append_all("/v1/stream/fork", byte_bodies(30, 8, False), OCTET)
    env.close("/v1/stream/fork")
    env.close("/v1/stream/fsrc")
    tail = env.pages("/v1/stream/fork")[-1].next_offset
    env.wait_sealed("fork", offsets.parse(tail).position)
    rows = sorted_rows(env, spark, stream="fork")
    check_against_pages(rows, env.pages("/v1/stream/fork"), False)
    inherited = [r for r in rows if r.position < offsets.parse(fork_at).position]
    assert inherited and len({r.chunk for r in inherited}) >= 2
    assert max(r.chunk for r in inherited) < min(r.chunk for r in rows if r not in inherited)


def test_include_tail_reads_unsealed_messages_over_http(pipeline_env: PipelineEnv, spark: Any) -> None:
    env = pipeline_env
    tails, written = {}, {}
    for ct in (OCTET, JSON):
        name = f"tail/{ct.split('/')[1]}"
        written[name] = json_bodies(60, 9) if ct == JSON else byte_bodies(50, 9, False)
        env.create(f"/v1/stream/{name}", ct)
        tails[name] = env.append_all(f"/v1/stream/{name}", written[name], ct)
    sealed_all = sorted_rows(env, spark, prefix="tail/")
    with_tail = sorted_rows(env, spark, prefix="tail/", include_tail="true", url=env.url)
    for name, tail in tails.items():
        sealed = [r for r in sealed_all if r.stream == name]
        rows = [r for r in with_tail if r.stream == name]
        assert sealed and sealed[-1].next_offset < tail, "part of the stream is still unsealed"
        pages = env.pages(f"/v1/stream/{name}")
        assert rows[-1].next_offset == pages[-1].next_offset == tail
        assert [r.offset for r in rows[: len(sealed)]] == [r.offset for r in sealed]
        assert all(r.chunk is None for r in rows[len(sealed):]) and len(rows) > len(sealed)
        if name.endswith("json"):
            check_against_pages(rows, pages, True)
            assert [json.loads(r.value) for r in rows] == [m for b in written[name] for m in json.loads(b)]
        else:
            assert b"".join(bytes(r.message) for r in rows) == b"".join(p.body for p in pages)


def test_include_tail_of_a_fork_made_in_its_sources_unsealed_part(pipeline_env: PipelineEnv, spark: Any) -> None:
    """Found by QA: a fork made at an offset its source had not sealed; with the tail, the rows
    of the source's unsealed part below the fork point named the fork's chunk, offsets the
    server refuses (400) and a consumer resuming from them could not use."""
    env = pipeline_env
    env.create("/v1/stream/usrc", JSON)
    fork_at = env.append_all("/v1/stream/usrc", json_bodies(80, 12), JSON)  # some sealed (4 KiB chunks), a tail
    env.create("/v1/stream/ufork", JSON, **{"Stream-Forked-From": "/v1/stream/usrc", "Stream-Fork-Offset": fork_at})
    env.append_all("/v1/stream/ufork", json_bodies(5, 13), JSON)
    rows = sorted_rows(env, spark, stream="ufork", include_tail="true", url=env.url)
    pages = env.pages("/v1/stream/ufork")
    check_against_pages(rows, pages, True)
    below = [r for r in rows if r.position < offsets.parse(fork_at).position and r.chunk is None]
    assert below, "part of the source below the fork point is unsealed"
    assert fork_at in {r.next_offset for r in rows}  # the fork point, spelled as the server does
    for r in below[-3:] + rows[-3:]:
        for offset in (r.offset, r.next_offset):
            with urllib.request.urlopen(f"{env.url}/v1/stream/ufork?offset={offset}", timeout=10) as answer:
                assert answer.status == 200, offset


@pytest.mark.parametrize(("options", "named"), [
    ({}, "stream"),
    ({"stream": "x", "prefix": "y"}, "prefix"),
    ({"stream_id": "x"}, "stream_id"),
    ({"bucket": "NO", "stream_id": "x"}, "bucket"),
    ({"stream": "x", "start_offset": "12_34"}, "start_offset"),
    ({"prefix": "x", "start_offset": "-1"}, "start_offset"),
    ({"stream": "x", "include_tail": "true"}, "url"),
    ({"stream": "x", "include_tail": "yes", "url": "http://h"}, "include_tail"),
    ({"stream": "x", "partition_bytes": "0"}, "partition_bytes"),
    ({"stream": "x", "colour": "red"}, "colour"),
    # (found by QA: a key that names no selected stream was ignored, and the read took everything)
    ({"prefix": "orders/", "start_offsets": '{"orders/json": "-1"}'}, "start_offsets"),
    ({"prefix": "orders/", "end_offsets": '{"/v1/stream/other": "-1"}'}, "end_offsets"),
    ({"stream": "a", "start_offsets": '{"/v1/buckets/b/a": "-1"}'}, "start_offsets"),
])
def test_bad_options_name_the_option(options: dict[str, str], named: str) -> None:
    with pytest.raises(OptionError, match=f"option '{named}'"):
        ReadOptions.parse({"store": "file:///tmp", **options})  # (a directory that exists)


def test_offset_maps_take_any_spelling_of_a_selected_streams_url() -> None:
    opts = ReadOptions.parse({"store": "file:///tmp", "prefix": "a b/",
                              "start_offsets": '{"/v1/stream/a b/c": "-1", "/v1/stream/a%20b/d": "-1"}'})
    assert set(opts.start) == {"/v1/stream/a%20b/c", "/v1/stream/a%20b/d"}  # as the plans' url paths


def test_errors_reach_the_spark_user(pipeline_env: PipelineEnv, spark: Any) -> None:
    with pytest.raises(Exception, match=r"option .store.*scheme"):
        spark.read.format("ds3").option("store", "ftp://x").option("stream", "a").load().collect()
    with pytest.raises(Exception, match="stream 'nope' not found"):
        pipeline_env.read(spark, stream="nope").collect()
    with pytest.raises(Exception, match="bucket 'nope' not found"):  # (found by QA: it read as empty)
        pipeline_env.read(spark, bucket="nope").collect()
    with pytest.raises(Exception, match="option 'max_chunks_per_trigger': applies to streaming reads"):
        pipeline_env.read(spark, stream="nope", max_chunks_per_trigger="2").collect()


def test_offset_filters_prune_chunks_at_planning(pipeline_env: PipelineEnv, spark: Any) -> None:
    """`offset >= X` (and <, <=, >, =) in a query: the rows are those of filtering the whole
    stream; the JVM chunk reader prunes the chunk objects that cannot hold such rows before any
    task runs (the Python source takes no pushed filters: pipeline.source.DS3BatchReader)."""
    from pyspark.sql import functions as F

    env = pipeline_env
    write_closed(env, "/v1/stream/pruned", "pruned", JSON, json_bodies(100, 9))
    everything = sorted_rows(env, spark, stream="pruned")
    lo, hi = everything[len(everything) // 3].offset, everything[2 * len(everything) // 3].offset
    for via in ("python", "jvm") if has_jvm_reader(spark) else ("python",):
        df = env.read(spark, via, stream="pruned").filter((F.col("offset") >= lo) & (F.col("offset") < hi))
        got = [r.offset for r in df.orderBy("position").collect()]
        assert got == [r.offset for r in everything if lo <= r.offset < hi] and got
    # the JVM chunk reader prunes (one chunk per partition here: its partitions are counted)
    if not has_jvm_reader(spark):
        return
    whole_jvm = env.read(spark, "jvm", stream="pruned", partition_bytes="4096")
    middle_jvm = whole_jvm.filter((F.col("offset") >= lo) & (F.col("offset") < hi))
    assert whole_jvm.rdd.getNumPartitions() > 3
    assert 0 < middle_jvm.rdd.getNumPartitions() < whole_jvm.rdd.getNumPartitions() * 0.6
    assert whole_jvm.filter(F.col("offset") >= "9" * 33).rdd.getNumPartitions() == 0


def test_an_offset_filter_does_not_stick_to_the_dataframe(pipeline_env: PipelineEnv, spark: Any) -> None:
    """QA: a DataFrame queried once with `offset >= X` answered its later queries without the
    filter (a count, a select, a write) from X on as well: Spark keeps the plan a Python source
    makes for pushed filters for every later query of the DataFrame (pipeline.source)."""
    from pyspark.sql import functions as F

    env = pipeline_env
    write_closed(env, "/v1/stream/sticky", "sticky", JSON, json_bodies(60, 14))
    for via in ("python", "jvm") if has_jvm_reader(spark) else ("python",):
        df = env.read(spark, via, stream="sticky")
        every = [r.offset for r in df.orderBy("position").collect()]
        mid, late = every[len(every) // 2], every[3 * len(every) // 4]
        assert df.filter(F.col("offset") >= mid).count() == len(every) - len(every) // 2
        assert df.count() == len(every), via
        assert [r.offset for r in df.select("offset", "position").orderBy("position").collect()] == every
        # a second, narrower filter, then a wider one: each query its own range
        assert df.filter(F.col("offset") >= late).count() == len(every) - 3 * len(every) // 4
        assert df.filter(F.col("offset") < mid).count() == len(every) // 2, via
        assert df.count() == len(every), via


def test_a_declared_schema_is_a_projection(pipeline_env: PipelineEnv, spark: Any) -> None:
    """`.schema("...")` with some of the row columns, in any order: the rows are those columns of
    the full read (JSON, byte and tail rows alike), and no other column is built."""
    env = pipeline_env
    write_closed(env, "/v1/stream/proj/json", "proj/json", JSON, json_bodies(60, 11))
    write_closed(env, "/v1/stream/proj/bytes", "proj/bytes", OCTET, byte_bodies(40, 12, False))
    env.create("/v1/stream/proj/tail", JSON)
    env.append_all("/v1/stream/proj/tail", json_bodies(20, 13), JSON)
    opts = env.source_options(prefix="proj/", include_tail="true", url=env.url)
    full = spark.read.format("ds3").options(**opts).load()
    assert full.count() > 100
    for schema in ("message binary", "position long, value string, stream string",
                   "sealed_at timestamp, next_offset string, offset string, chunk long, bucket string, content_type string"):
        names = [c.split(" ")[0] for c in schema.split(", ")]
        df = spark.read.format("ds3").options(**opts).schema(schema).load()
        assert df.columns == names
        # the same partitions in the same order, so the same rows in the same order
        assert df.collect() == full.select(*names).collect()


def test_a_bad_declared_schema_names_the_column(pipeline_env: PipelineEnv, spark: Any) -> None:
    write_closed(pipeline_env, "/v1/stream/badschema", "badschema", OCTET, byte_bodies(3, 14, False))
    for schema, complaint in (
        ("colour string", "no column 'colour'"),
        ("offset long", "column 'offset' is string"),
        ("message binary not null", "column 'message' is binary"),
    ):
        with pytest.raises(Exception, match=f"option 'schema'.*{complaint}"):
            spark.read.format("ds3").options(**pipeline_env.source_options(stream="badschema")).schema(schema) \
                .load().collect()


def test_partitions_and_an_early_stop(pipeline_env: PipelineEnv, spark: Any) -> None:
    """Partitions are runs of consecutive chunks of at most partition_bytes, cut greedily (a
    read over less of the stream has the same first partitions); small partitions give the
    rows of one big partition, in the same order; a LIMIT stops a task that is fetching its
    next chunk ahead."""
    from pipeline.catalog import Catalog, resolve
    from pipeline.source import ChunkGroup, DS3BatchReader

    env = pipeline_env
    write_closed(env, "/v1/stream/parts", "parts", JSON, json_bodies(150, 15))

    def partitions(**extra: str) -> list[ChunkGroup]:
        parts = DS3BatchReader(ReadOptions.parse(env.source_options(stream="parts", **extra))).partitions()
        assert all(isinstance(p, ChunkGroup) for p in parts)
        return parts  # type: ignore[return-value]

    parts = partitions(partition_bytes="20000")
    catalog = Catalog(parts[0].store)
    refs = catalog.plans(resolve(catalog, ("parts",), None))[0].chunks
    assert len(parts) > 3 and [ref for p in parts for _, ref in p.items] == list(refs)
    for p, after in itertools.pairwise(parts):
        size = sum(ref.object_size for _, ref in p.items)
        assert size <= 20000 < size + after.items[0][1].object_size  # as long as it can be
    shorter = partitions(partition_bytes="20000", end_offset=refs[len(refs) // 2].end_offset)
    def chunk_runs(ps: list[ChunkGroup]) -> list[list[int]]:
        return [[ref.chunk for _, ref in p.items] for p in ps]

    assert len(shorter) > 1 and chunk_runs(shorter[:-1]) == chunk_runs(parts[:len(shorter) - 1])

    small = env.read(spark, stream="parts", partition_bytes="20000").collect()
    one = env.read(spark, stream="parts").collect()  # 128 MiB: every chunk in one partition
    assert small == one and [r.position for r in one] == sorted(r.position for r in one)
    assert env.read(spark, stream="parts").limit(3).collect() == one[:3]
    for via in ("jvm",) if has_jvm_reader(spark) else ():  # the JVM chunk reader: same partitions, same stop
        df = env.read(spark, via, stream="parts", partition_bytes="20000")
        assert df.rdd.getNumPartitions() == len(parts) and df.collect() == one
        assert env.read(spark, via, stream="parts").limit(3).collect() == one[:3]
