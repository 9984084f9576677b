"""Fixtures and helpers of the Spark pipeline tests (tests/test_pipeline*.py), imported by
conftest.py. Spark takes 5-9 s to start, so the whole run shares ONE SparkSession (local[2],
a failed task is tried up to 3 times; tests/test_pipeline_cluster.py swaps it for one on a
standalone cluster while that module runs) and one ingester + reader sealing 4 KiB chunks into
moto's S3; each test uses its own streams. pyspark is imported only when a pipeline test runs."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from tests.cluster import TIMEOUT, Cluster, Page, StoreView, append, create, read_pages, wait_for
from tests.s3server import TEST_ENV, MotoS3, aws_test_env

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SEAL_BYTES = 4096
LOCAL_MASTER = "local[2,3]"
TEST_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.streaming.stopTimeout": "10s",
}
_session: SparkSession | None = None


def spark_on(master: str, app_name: str = "ds3-tests", conf: dict[str, str] | None = None) -> SparkSession:
    """The run's SparkSession on `master`: the current one if it runs there, else a new one
    after stopping the current one (a process holds one SparkContext at a time; the cluster
    tests, tests/test_pipeline_cluster.py, switch to a standalone master and back)."""
    global _session
    if _session is not None and _session.sparkContext._jsc is not None and _session.sparkContext.master == master:
        return _session
    stop_spark()
    from pipeline.session import spark_session

    with aws_test_env():  # the JVM, and so every Python worker, gets moto's dummy credentials
        _session = spark_session(master, app_name, {**TEST_CONF, **(conf or {})})
    return _session


def stop_spark() -> None:
    global _session
    if _session is not None:
        _session.stop()
        _session = None


def has_jvm_reader(spark: SparkSession) -> bool:
    """Whether the session has the JVM chunk reader (pipeline/jvm.py: it needs javac, a JDK's);
    without it, checks of that reader are skipped, except under CI=true, where they fail."""
    from pipeline import jvm

    if jvm.on_session(spark):
        return True
    if os.environ.get("CI") == "true":
        pytest.fail("no JVM chunk reader in the Spark session (is javac installed?), and CI=true")
    return False


@pytest.fixture(scope="session")
def _spark_run() -> Iterator[None]:
    yield
    stop_spark()


@pytest.fixture
def spark(_spark_run: None) -> SparkSession:
    """The local session (started once; again only if a cluster test stopped it)."""
    return spark_on(LOCAL_MASTER)


@dataclass
class PipelineEnv:
    """An ingester + reader sealing into a store (the shared one on moto, or a test's own on
    a local directory, s3=None), seen from a pipeline test."""

    cluster: Cluster
    store: StoreView
    s3: MotoS3 | None

    @property
    def url(self) -> str:
        return self.cluster.reader.url

    @property
    def s3_endpoint(self) -> str:
        assert self.s3 is not None, "a store on a local directory"
        return self.s3.endpoint

    def source_options(self, **extra: str) -> dict[str, str]:
        """Options of format("ds3") for this store (S3 settings given explicitly, as the
        executors' environment holds no AWS variables)."""
        if self.s3 is None:
            return {"store": self.store.url, **extra}
        return {
            "store": self.store.url, "endpoint_url": self.s3.endpoint,
            "region": TEST_ENV["AWS_DEFAULT_REGION"], "access_key_id": "testing",
            "secret_access_key": "testing", **extra,
        }

    def read(self, spark: SparkSession, via: str = "python", **options: str) -> DataFrame:
        """A read through the Python data source (`via` python) or the JVM chunk reader."""
        if via == "jvm":
            from pipeline import jvm

            assert has_jvm_reader(spark)
            return jvm.load(spark, self.source_options(**options))
        return spark.read.format("ds3").options(**self.source_options(**options)).load()

    # ------------------------------------------------------------ HTTP, through the reader
    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    def create(self, url_path: str, content_type: str, **headers: str) -> None:
        async def go() -> None:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                await create(s, self.url + url_path, content_type, **headers)
        self.run(go())

    def append_all(self, url_path: str, bodies: list[bytes], content_type: str) -> str:
        async def go() -> str:
            nxt = ""
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                for b in bodies:
                    nxt = await append(s, self.url + url_path, b, content_type)
            return nxt
        return str(self.run(go()))

    def close(self, url_path: str) -> None:
        async def go() -> None:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(
                self.url + url_path, headers={"Stream-Closed": "true"}
            ) as r:
                assert r.status in (200, 204), await r.text()
        self.run(go())

    def delete(self, url_path: str) -> None:
        async def go() -> None:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.delete(self.url + url_path) as r:
                assert r.status in (200, 204), await r.text()
        self.run(go())

    def recreate(self, internal_path: str, content_type: str, bodies: list[bytes]) -> None:
        """Delete the plain stream, create it again with `bodies`, close it, and wait until the
        new stream (another uid) is sealed in the store."""
        url_path = "/v1/stream/" + internal_path
        old = self.uid(internal_path)
        self.delete(url_path)
        self.create(url_path, content_type)
        self.append_all(url_path, bodies, content_type)
        self.close(url_path)
        tail = self.pages(url_path)[-1].next_offset
        self.wait_sealed(internal_path, int(tail.split("_")[1]), not_uid=old)

    def pages(self, url_path: str, offset: str = "-1") -> list[Page]:
        async def go() -> list[Page]:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                return await read_pages(s, self.url + url_path, offset)
        return list(self.run(go()))

    def put_bucket(self, bucket_id: str) -> None:
        async def go() -> None:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.put(f"{self.url}/v1/buckets/{bucket_id}") as r:
                assert r.status == 201, await r.text()
        self.run(go())

    # ------------------------------------------------------------ the store
    def uid(self, internal_path: str) -> str | None:
        """The uid in the stream's descriptor in the store (None: no descriptor)."""
        from pipeline.catalog import Catalog
        from pipeline.store import open_sync_store

        opts = self.source_options()
        desc = Catalog(open_sync_store(opts.pop("store"), **opts)).descriptor(internal_path)
        return None if desc is None else desc.uid

    def wait_sealed(self, internal_path: str, position: int, timeout: float = 20.0, not_uid: str | None = None) -> None:
        """Until the stream's chunk objects cover [0, position) (forks: their own part); with
        `not_uid`, in a descriptor of another stream than that one (created again)."""
        from pipeline.catalog import Catalog
        from pipeline.store import open_sync_store

        opts = self.source_options()
        store = open_sync_store(opts.pop("store"), **opts)

        def covered() -> bool:
            catalog = Catalog(store)
            desc = catalog.descriptor(internal_path)
            return (desc is not None and desc.uid != not_uid and not desc.soft_deleted
                    and catalog.plan(desc).sealed_end >= position)

        wait_for(covered, timeout, f"{internal_path!r} sealed up to {position}", interval=0.1)


@pytest.fixture(scope="session")
def pipeline_env(s3_server: MotoS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PipelineEnv]:
    with aws_test_env():
        bucket = s3_server.new_bucket()
        store = StoreView.s3_store(s3_server, bucket)
        cluster = Cluster(tmp_path_factory.mktemp("pipeline"), store, seal_bytes=SEAL_BYTES, seal_age=60.0)
        cluster.start()
    try:
        yield PipelineEnv(cluster, store, s3_server)
    finally:
        cluster.stop()
        with aws_test_env():
            s3_server.drop_bucket(bucket)


# ---------------------------------------------------------------- comparing with HTTP reads
def check_against_pages(rows: list[Any], pages: list[Page], is_json: bool) -> None:
    """Rows (sorted by position) hold exactly what the catch-up pages hold, byte for byte:
    each page is the rows in [its start, its next offset), as one JSON array of their
    messages or their bytes back to back; page boundaries are row offsets."""
    by_offset = {r.offset: i for i, r in enumerate(rows)}
    i = 0
    for page in pages:
        if not page.body:
            continue
        if page.offset != "-1":
            assert page.offset in by_offset, f"page at {page.offset} starts inside a row"
            assert by_offset[page.offset] == i
        group = []
        while i < len(rows) and rows[i].next_offset <= page.next_offset:
            group.append(rows[i])
            i += 1
        assert group and group[-1].next_offset == page.next_offset, f"page ending {page.next_offset}"
        msgs = [bytes(r.message) for r in group]
        body = b"[" + b",".join(msgs) + b"]" if is_json else b"".join(msgs)
        assert body == page.body
        if is_json:
            assert [json.loads(r.value) for r in group] == json.loads(page.body)
    assert i == len(rows), f"{len(rows) - i} rows after the last page"
