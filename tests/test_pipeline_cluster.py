"""The pipeline on a real Spark cluster (issue 16): a standalone master and one worker (1 core)
started from the pyspark installation (`spark-class ...Master` / `...Worker`) as child
processes on 127.0.0.1, not `local[*]`. Executors are separate JVMs launched by the worker,
with Python workers of their own: they find ds3's packages only through the worker's
environment (PYTHONPATH = this repository) and run the interpreter the driver names
(PYSPARK_PYTHON, set by pipeline.session), and they read S3 credentials from that environment.

- `ds3 pipeline export --master spark://...` (a subprocess, its own driver) exports every
  sealed message, the rows the same read on local[2,3] returns;
- the executors run the driver's interpreter and import this checkout's packages;
- a batch read on the cluster returns the rows the local read returns, for a local-directory
  store and for S3 (moto), and they match an HTTP catch-up;
- the writer, running on the cluster's executor, appends through a real ingester: the stream
  holds each row exactly once, each partition's rows in order.

One SparkSession serves the module (the run's local one is stopped meanwhile:
tests/pipeline_fixtures.py). Without Java the module skips, except under CI=true, where it
fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest

from shared import offsets
from tests.cluster import Cluster, StoreView
from tests.pipeline_fixtures import (
    LOCAL_MASTER,
    SEAL_BYTES,
    PipelineEnv,
    check_against_pages,
    spark_on,
    stop_spark,
)
from tests.procs import DS3, free_port
from tests.s3server import CLEARED_ENV, TEST_ENV, aws_test_env
from tests.test_pipeline_read import JSON, OCTET, byte_bodies, json_bodies, write_closed

pytestmark = [pytest.mark.spark_cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
APP = "ds3-cluster-tests"
COLUMNS = ["stream", "offset", "next_offset", "message", "value", "content_type", "chunk", "position"]
STREAMS = {"cl/events": JSON, "cl/blobs": OCTET}
START_TIMEOUT = 60.0


# ---------------------------------------------------------------- the standalone cluster
def java_binary() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(Path(home, "bin", "java"), os.X_OK):
        return str(Path(home, "bin", "java"))
    return shutil.which("java")


def require_java() -> None:
    if java_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("Java is not installed, and CI=true: Spark needs a JRE (17 or 21)")
        pytest.skip("Java is not installed: Spark needs a JRE (17 or 21)")


def tail(path: Path, chars: int = 3000) -> str:
    return f"--- {path}\n{path.read_text(errors='replace')[-chars:]}" if path.exists() else f"--- {path}: none"


@dataclass
class Standalone:
    """A Spark standalone master and one worker, each `spark-class` as its own process group."""

    work: Path
    master_port: int = field(default_factory=free_port)
    ui_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # "master", "worker"

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    @property
    def logs(self) -> list[Path]:
        return [self.work / "master.log", self.work / "worker.log"]

    def env(self) -> dict[str, str]:
        """The environment of the master, the worker (which passes it on to its executors)
        and the export's driver: this checkout first on PYTHONPATH (executors import its
        `pipeline` and `shared`, not an installed ds3), the S3 test credentials, loopback only;
        no REST submission server on the master (it would take the fixed port 6066)."""
        env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
        env.update(TEST_ENV)
        env.update({
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_WORKER_DIR": str(self.work / "worker"),
            "SPARK_LOG_DIR": str(self.work),
            "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
        })
        return env

    def spawn(self, name: str, *args: str) -> None:
        import pyspark

        spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
        with open(self.work / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen([str(spark_class), *args], stdout=out, stderr=subprocess.STDOUT,
                                                env=self.env(), cwd=self.work, start_new_session=True)

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as r:
            return dict(json.loads(r.read()))

    def wait(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = START_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    self.fail(f"the {name} exited ({p.returncode}) before {what}")
            try:
                status = self.status()
                if pred(status):
                    return status
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.fail(f"no {what} after {timeout:.0f}s")
            time.sleep(0.2)

    def fail(self, why: str) -> NoReturn:
        executors = sorted((self.work / "worker").glob("*/*/stderr"))
        logs = "\n".join(tail(p) for p in [*self.logs, *executors[-2:]])
        pytest.fail(f"Spark standalone cluster: {why}\n{logs}")

    def start(self) -> Standalone:
        (self.work / "worker").mkdir(parents=True, exist_ok=True)
        self.spawn("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                   "--port", str(self.master_port), "--webui-port", str(self.ui_port))
        self.wait("master", lambda s: s.get("status") == "ALIVE")
        self.spawn("worker", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                   "--cores", "1", "--memory", "1g", "--webui-port", str(free_port()),
                   "--work-dir", str(self.work / "worker"), self.url)
        self.wait("registered worker", lambda s: s.get("aliveworkers", 0) >= 1)
        return self

    def stop(self) -> None:
        procs = list(reversed(self.procs.values()))
        for p in procs:  # the worker (and its executors, same group), then the master
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # leftovers of the group (executors, Python workers)
            except ProcessLookupError:
                pass
            p.wait(5)

    def apps(self, name: str, state: str = "activeapps") -> list[dict[str, Any]]:
        return [a for a in self.status().get(state, []) if a.get("name") == name]


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    require_java()
    cluster = Standalone(tmp_path_factory.mktemp("spark-standalone"))
    try:
        yield cluster.start()
    finally:
        try:
            stop_spark()  # the module's session, before its master goes away
        finally:
            cluster.stop()


# ---------------------------------------------------------------- the data, and the local read
@dataclass
class Written:
    envs: dict[str, PipelineEnv]  # "file": this module's ingester + reader on a directory; "s3": moto
    local_rows: dict[str, list[tuple[Any, ...]]]  # the same read on local[2,3]


def rows_of(df: Any) -> list[tuple[Any, ...]]:
    return sorted((r.stream, r.position, *(bytes(v) if isinstance(v, bytearray) else v for v in r))
                  for r in df.select(*COLUMNS).collect())


@pytest.fixture(scope="module")
def written(pipeline_env: PipelineEnv, tmp_path_factory: pytest.TempPathFactory,
            _spark_run: None) -> Iterator[Written]:
    require_java()
    work = tmp_path_factory.mktemp("cluster-file-store")
    store = StoreView.local(work / "objects")
    servers = Cluster(work, store, seal_bytes=SEAL_BYTES, seal_age=60.0).start()
    try:
        envs = {"file": PipelineEnv(servers, store, None), "s3": pipeline_env}
        for env in envs.values():
            for i, (name, ct) in enumerate(STREAMS.items()):
                bodies = json_bodies(60, 51 + i) if ct == JSON else byte_bodies(40, 51 + i, False)
                write_closed(env, f"/v1/stream/{name}", name, ct, bodies)
        local = spark_on(LOCAL_MASTER)
        yield Written(envs, {kind: rows_of(env.read(local, prefix="cl/")) for kind, env in envs.items()})
    finally:
        servers.stop()


@pytest.fixture
def cluster_spark(standalone: Standalone, written: Written) -> Any:
    """The module's session on the standalone master (started on first use, after the
    local read; an executor of 1 core and 512 MiB; the driver on 127.0.0.1)."""
    spark = spark_on(standalone.url, APP, {
        "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
        "spark.executor.memory": "512m", "spark.cores.max": "1",
    })
    standalone.wait("executor for the test session",
                    lambda s: any(a.get("name") == APP and a.get("cores", 0) >= 1 for a in s.get("activeapps", [])))
    return spark


# ---------------------------------------------------------------- tests
def stop_spark_on(master: str) -> None:
    """Stop the in-process session if it holds the worker's core (tests run out of order)."""
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is not None and sc.master == master:
        stop_spark()


def test_export_runs_on_the_cluster(standalone: Standalone, written: Written, tmp_path: Path) -> None:
    """First in the module: its application needs the worker's only core."""
    stop_spark_on(standalone.url)
    out = tmp_path / "parquet"
    cmd = [DS3, "pipeline", "export", "--master", standalone.url, "--store", written.envs["file"].store.url,
           "--prefix", "cl/", "--output", str(out)]
    try:  # the driver's environment: this checkout on PYTHONPATH, loopback
        proc = subprocess.run(cmd, env=standalone.env(), capture_output=True, timeout=180, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        standalone.fail(f"`ds3 pipeline export` still running after 180 s:\n{(e.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-5000:]
    result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    file_env = written.envs["file"]
    assert result["exported_up_to"] == {f"/v1/stream/{n}": file_env.pages(f"/v1/stream/{n}")[-1].next_offset
                                        for n in STREAMS}
    assert [a["state"] for a in standalone.apps("ds3-export", "completedapps")] == ["FINISHED"]

    import pyarrow.dataset as ds  # type: ignore[import-untyped]

    table = ds.dataset(out, format="parquet", partitioning="hive").to_table()
    assert {"date", "sealed_at"} <= set(table.column_names)
    exported = sorted((r["stream"], r["position"], *(r[c] for c in COLUMNS)) for r in table.to_pylist())
    assert exported == written.local_rows["file"]


def test_executors_import_this_checkout(cluster_spark: Any) -> None:
    def where(_: Any) -> Iterator[tuple[str, str, str, str]]:
        import os
        import sys

        import pipeline
        import shared

        yield sys.executable, str(pipeline.__file__), str(shared.__file__), os.getcwd()

    [(python, pipeline_file, shared_file, cwd)] = cluster_spark.sparkContext.parallelize([0], 1).mapPartitions(
        where).collect()
    assert python == sys.executable
    assert pipeline_file == str(ROOT / "pipeline" / "__init__.py")
    assert shared_file == str(ROOT / "shared" / "__init__.py")
    assert "/worker/app-" in cwd, f"not an executor launched by the worker: {cwd}"


@pytest.mark.parametrize("via", ["python", "jvm"])
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_read_on_the_cluster_equals_the_local_read(cluster_spark: Any, written: Written, kind: str, via: str) -> None:
    """Through the Python data source and the JVM chunk reader (its jar reaches the executor
    through spark.jars; on S3 it reads presigned URLs)."""
    from pipeline import jvm

    env = written.envs[kind]
    # S3 without credentials in the options: the executors take them from the worker's environment
    opts = {k: v for k, v in env.source_options(prefix="cl/", partition_bytes="4096").items()
            if k not in ("access_key_id", "secret_access_key", "region")}
    if via == "jvm":  # planned in this process, which takes the credentials from its environment
        assert jvm.on_session(cluster_spark)
        with aws_test_env():
            df = jvm.load(cluster_spark, opts)
        assert "ds3 chunks" in df._jdf.queryExecution().executedPlan().toString()
    else:
        df = cluster_spark.read.format("ds3").options(**opts).load()
    assert df.rdd.getNumPartitions() >= 6  # one per chunk object, in turn on the one core
    rows = rows_of(df)
    assert rows == written.local_rows[kind]
    for name, ct in STREAMS.items():
        mine = sorted((r for r in df.where(df.stream == name).collect()), key=lambda r: r.position)
        assert len({r.chunk for r in mine}) >= 3, "several sealed chunks"
        check_against_pages(mine, env.pages(f"/v1/stream/{name}"), ct == JSON)


def test_writer_on_the_cluster_appends_each_row_once(cluster_spark: Any, written: Written) -> None:
    from pyspark.sql import functions as F

    env = written.envs["file"]
    ingester = env.cluster.ingester.url
    df = cluster_spark.range(0, 900, numPartitions=3).select(
        F.to_json(F.struct(F.col("id").alias("i"), F.repeat(F.lit("é,]"), (F.col("id") % 9).cast("int"))
                           .alias("pad"))).alias("value"))
    (df.write.format("ds3").mode("append")
     .options(url=ingester, stream="clw/out", content_type=JSON, create="true", batch_bytes="2000").save())

    got = [m for p in env.pages("/v1/stream/clw/out") if p.body for m in json.loads(p.body)]
    assert sorted(m["i"] for m in got) == list(range(900)), "every row exactly once"
    for part in (range(0, 300), range(300, 600), range(600, 900)):  # each task's rows keep their order
        assert [m["i"] for m in got if m["i"] in part] == list(part)
    assert all(m["pad"] == "é,]" * (m["i"] % 9) for m in got)

    # and read back on the cluster, sealed chunks and the tail
    env.close("/v1/stream/clw/out")
    env.wait_sealed("clw/out", offsets.parse(env.pages("/v1/stream/clw/out")[-1].next_offset).position)
    back = cluster_spark.read.format("ds3").options(**env.source_options(stream="clw/out")).load()
    assert [json.loads(r.value) for r in back.orderBy("position").collect()] == got
