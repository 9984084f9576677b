"""The JVM chunk reader (pipeline/jvm.py, pipeline/jvm/) gives the same rows, byte for byte, as
the Python rows (rows.chunk_batch_rows): byte, text and JSON streams, later chunks, fork cuts
(inside a byte stream's message too), position bounds, invalid UTF-8 (decoded with replacement
as Python does), offsets of every width; any projection; and a clear error for a chunk object
that is corrupt, cut short or gone. Reads through the catalog, on moto and on a local store, are
in tests/test_pipeline_read.py (`via` jvm)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import jvm, rows
from pipeline.catalog import ChunkRef
from shared import protocol
from tests.test_pipeline_columnar import CASES, JSON, OCTET, TEXT, chunk

pytestmark = pytest.mark.skipif(jvm.jar() is None and os.environ.get("CI") != "true",
                                reason="no javac: the JVM chunk reader cannot be built")


def item(path: Path, obj: bytes, r: ChunkRef, target: rows.Target) -> dict[str, Any]:
    return {
        "source": path.as_uri(), "size": len(obj), "chunk": r.chunk, "start": r.start, "cap": r.end,
        "lo": target.lo, "hi": -1 if target.hi is None else target.hi, "start_offset": r.start_offset,
        "end_offset": r.end_offset, "stream": target.stream, "bucket": target.bucket,
        "content_type": target.content_type, "json": protocol.is_json(target.content_type),
        "text": rows.has_text(target.content_type),
    }


def jvm_rows(spark: Any, partitions: list[list[dict[str, Any]]], schema: str | None = None) -> list[dict[str, Any]]:
    reader = spark.read.format(jvm.CLASS).option("plan", json.dumps({"partitions": [{"items": p}
                                                                                    for p in partitions]}))
    if schema is not None:
        reader = reader.schema(schema)
    return [normal(r.asDict()) for r in reader.load().collect()]


def normal(row: dict[str, Any]) -> dict[str, Any]:
    """A row as Spark's and Arrow's Python values agree: bytes, naive UTC datetimes."""
    out = dict(row)
    if out.get("message") is not None:
        out["message"] = bytes(out["message"])
    if out.get("sealed_at") is not None:
        out["sealed_at"] = out["sealed_at"].replace(tzinfo=None)
    return out


class Case:
    def __init__(self, tmp: Path, name: str, ctype: str, start: int, messages: list[bytes], cap: int | None,
                 lo: int, hi: int | None, bucket: str | None = None) -> None:
        self.obj = chunk(start, messages, ctype)
        end = start + sum(len(m) + (1 if ctype == JSON else 0) for m in messages)
        self.ref = ChunkRef(uid="u" * 32, chunk=5, start=start, end=end if cap is None else cap, prev_chunk=4,
                            object_size=len(self.obj), sealed_at=0.0)
        self.target = rows.Target(name, bucket, ctype, lo, hi)
        self.path = tmp / f"{name}.chunk"
        self.path.write_bytes(self.obj)

    def want(self) -> list[dict[str, Any]]:
        return [normal(r) for r in rows.chunk_batch_rows(self.target, self.ref, self.obj).to_pylist()]

    def item(self) -> dict[str, Any]:
        return item(self.path, self.obj, self.ref, self.target)


@pytest.fixture
def cases(tmp_path: Path) -> dict[str, Case]:
    out = {}
    for i, (name, (ctype, start, messages, kw)) in enumerate(CASES.items()):
        cap = kw.get("cap")
        out[name] = Case(tmp_path, f"c{i}", ctype, start, messages, None if cap is None else start + cap,
                         kw.get("lo", 0), kw.get("hi"))
    return out


def test_the_rows_of_every_case_equal_the_python_rows(spark: Any, cases: dict[str, Case]) -> None:
    got = jvm_rows(spark, [[c.item()] for c in cases.values()])
    want = [row for c in cases.values() for row in c.want()]
    assert len(want) > 15 and got == want


def test_chunks_of_one_partition_are_read_in_order(spark: Any, cases: dict[str, Case]) -> None:
    every = list(cases.values())
    got = jvm_rows(spark, [[c.item() for c in every]])
    assert got == [row for c in every for row in c.want()]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.lists(st.tuples(
    st.sampled_from([OCTET, TEXT, JSON]), st.integers(0, 10**12),
    st.lists(st.binary(min_size=1, max_size=12), min_size=1, max_size=20),
    st.floats(0, 1.2), st.integers(0, 300), st.one_of(st.none(), st.integers(0, 300)),
), min_size=30, max_size=30))
def test_any_chunk_gives_the_python_rows(spark: Any, tmp_path: Path, data: list[Any]) -> None:
    """Random chunks (random bytes: text streams get invalid UTF-8), fork cuts and bounds, all
    read in one job, one partition each."""
    every = []
    for i, (ctype, start, messages, cut, lo, span) in enumerate(data):
        if ctype == JSON:
            messages = [m.replace(b",", b"") or b"0" for m in messages]
        end = start + sum(len(m) + (1 if ctype == JSON else 0) for m in messages)
        cap = min(end, start + 1 + int((end - start) * cut))
        every.append(Case(tmp_path, f"h{i}", ctype, start, messages, cap, start + lo,
                          None if span is None else start + lo + span, bucket="b" if i % 2 else None))
    got = jvm_rows(spark, [[c.item()] for c in every])
    assert got == [row for c in every for row in c.want()]


@pytest.mark.parametrize("schema", [
    "message binary", "position long, value string, stream string",
    "sealed_at timestamp, next_offset string, offset string, chunk long, bucket string, content_type string",
])
def test_a_projection_is_those_columns_of_the_full_rows(spark: Any, cases: dict[str, Case], schema: str) -> None:
    names = [c.split(" ")[0] for c in schema.split(", ")]
    got = jvm_rows(spark, [[c.item()] for c in cases.values()], schema)
    assert [list(r) for r in got][:1] == [names]
    assert got == [{k: row[k] for k in names} for c in cases.values() for row in c.want()]


def test_a_bad_schema_names_the_column(spark: Any, cases: dict[str, Case]) -> None:
    for schema in ("colour string", "offset long"):
        with pytest.raises(Exception, match=f"no column {schema.split(' ')[0]} "):
            jvm_rows(spark, [[cases["bytes"].item()]], schema)


def test_a_corrupt_short_or_missing_object_is_a_clear_error(spark: Any, cases: dict[str, Case]) -> None:
    case = cases["json"]
    good = case.item()
    broken = bytearray(case.obj)
    broken[0:8] = b"NOTCHUNK"
    case.path.write_bytes(bytes(broken))
    with pytest.raises(Exception, match=r"c\d+\.chunk: not a ds3 chunk object"):
        jvm_rows(spark, [[good]])
    case.path.write_bytes(case.obj[:-3])
    with pytest.raises(Exception, match=r"c\d+\.chunk: \d+ bytes, the catalog listed"):
        jvm_rows(spark, [[good]])
    other = cases["bytes"].item()
    with pytest.raises(Exception, match="header names chunk 5 at 0, expected 6 at 0"):
        jvm_rows(spark, [[{**other, "chunk": 6}]])
    case.path.unlink()
    with pytest.raises(Exception, match=r"NoSuchFileException.*c\d+\.chunk"):
        jvm_rows(spark, [[good]])


class FlakyStore:
    """An HTTP server on 127.0.0.1 serving the cases' chunk files, failing as told first: each
    GET takes the next of `faults` (503, "cut": half the body then a closed connection, 404,
    or None: serve), then serves."""

    def __init__(self, root: Path, faults: list[int | str | None]) -> None:
        import http.server
        import threading

        self.faults = list(faults)
        self.gets = 0
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                store.gets += 1
                fault = store.faults.pop(0) if store.faults else None
                body = (root / self.path.split("?")[0].lstrip("/")).read_bytes()
                if isinstance(fault, int):
                    self.send_response(fault)
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"nope")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if fault == "cut" else body)
                if fault == "cut":
                    self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}?X-Amz-Signature=secret"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_failing_store_is_retried_and_a_missing_object_named(spark: Any, cases: dict[str, Case],
                                                             tmp_path: Path) -> None:
    """A 503 and a connection cut mid-body are retried (the rows are whole); a 404 is not, and
    the error names the object without the URL's signature."""
    case = cases["json"]
    store = FlakyStore(tmp_path, [503, "cut", None])
    try:
        got = jvm_rows(spark, [[{**case.item(), "source": store.url(case.path.name)}]])
        assert got == case.want() and store.gets == 3
        store.faults = [404] * 4  # (each attempt of the task: local[2,3] tries it thrice)
        with pytest.raises(Exception, match=r"GET http://127.0.0.1:\d+/c\d+\.chunk: HTTP 404 nope") as err:
            jvm_rows(spark, [[{**case.item(), "source": store.url(case.path.name)}]])
        assert "secret" not in str(err.value)
    finally:
        store.close()


def test_a_read_with_the_tail_takes_the_python_source(pipeline_env: Any, spark: Any) -> None:
    """The unsealed tail is read over HTTP by the Python data source: `load` with include_tail
    hands the read to it (same rows); without, the JVM reader reads the sealed chunks."""
    from tests.test_pipeline_read import json_bodies

    env = pipeline_env
    env.create("/v1/stream/jvmtail", JSON)
    env.append_all("/v1/stream/jvmtail", json_bodies(30, 21), JSON)

    def scan(df: Any) -> str:
        return str(df._jdf.queryExecution().executedPlan().toString())

    sealed = jvm.load(spark, env.source_options(stream="jvmtail"))
    with_tail = jvm.load(spark, env.source_options(stream="jvmtail", include_tail="true", url=env.url))
    assert "ds3 chunks" in scan(sealed) and "ds3 chunks" not in scan(with_tail)
    python = env.read(spark, stream="jvmtail", include_tail="true", url=env.url)
    assert with_tail.collect() == python.collect() and with_tail.count() > sealed.count()


def test_a_jar_is_built_once_and_a_source_that_does_not_compile_is_logged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The jar is keyed by its sources: built on first use, then found; a source that does not
    compile (another Spark's API) leaves no jar and says why, and reads take the Python source."""
    monkeypatch.setenv("DS3_JVM_CACHE", str(tmp_path / "cache"))
    built = jvm.jar()
    assert built is not None and built.parent == tmp_path / "cache" and jvm.jar() == built
    with zipfile.ZipFile(built) as z:
        assert "io/ds3/spark/ChunkSource.class" in z.namelist()
        assert z.read("META-INF/services/org.apache.spark.sql.sources.DataSourceRegister").strip() == b"io.ds3.spark.ChunkSource"
    broken = tmp_path / "src" / "io" / "ds3" / "spark"
    broken.mkdir(parents=True)
    (broken / "Broken.java").write_text("package io.ds3.spark; class Broken { int x = nope; }")
    monkeypatch.setattr(jvm, "SOURCES", tmp_path / "src")
    assert jvm.jar() is None and jvm.jar(build=False) is None
    assert "compiling the JVM chunk reader failed" in caplog.text and "nope" in caplog.text
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [built.name]  # no torn jar left
