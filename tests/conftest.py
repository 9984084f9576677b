"""Shared pytest fixtures. Keep each one small; helpers live in their own tests/*.py modules."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from ingester.app import create_app
from shared.config import IngesterConfig
from tests.cluster import StoreView
from tests.pipeline_fixtures import _spark_run, pipeline_env, spark  # noqa: F401 - Spark pipeline tests
from tests.s3server import CLEARED_ENV, TEST_ENV, MotoS3
from tests.tcpgate import TcpGate
from tests.wal_harness import clock, h  # noqa: F401 - write-path tests (test_store, test_journal)


# ---------------------------------------------------------------- S3 (moto server)
@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3]:
    """One moto S3 server for the whole run (starting one takes a moment)."""
    with MotoS3() as server:
        yield server


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy AWS credentials and region in the environment, for this test only; variables
    that would send botocore elsewhere (profile, endpoint) are cleared."""
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    for k in CLEARED_ENV:
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def s3_bucket(s3_server: MotoS3, aws_env: None) -> Iterator[str]:
    """A fresh, empty bucket on the moto server (with aws_env). It is dropped afterwards:
    moto holds objects in memory."""
    bucket = s3_server.new_bucket()
    yield bucket
    s3_server.drop_bucket(bucket)


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreView:
    """Each test that asks for it runs against a local-directory store and moto's S3."""
    if request.param == "s3":
        return StoreView.s3_store(request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket"))
    return StoreView.local(tmp_path / "objects")


@pytest.fixture
def gated_s3(s3_server: MotoS3, s3_bucket: str) -> Iterator[tuple[StoreView, TcpGate]]:
    """An S3 bucket on moto plus a gate in front of moto for the ingester to go through
    (tests/tcpgate.py: cut it, or slow it down)."""
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    gate = TcpGate((host, int(port))).start()
    try:
        yield StoreView.s3_store(s3_server, s3_bucket), gate
    finally:
        gate.stop()


# ---------------------------------------------------------------- in-process ingesters
MakeIngester = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
async def make_ingester(tmp_path: Path) -> AsyncIterator[MakeIngester]:
    """Start in-process ingesters (aiohttp TestServer around create_app): keyword arguments
    override IngesterConfig fields (data_dir defaults to tmp_path/data, so a second call
    reopens the same WAL). All are closed after the test."""
    clients: list[TestClient[Any, Any]] = []

    async def make(**overrides: Any) -> TestClient[Any, Any]:
        config = IngesterConfig(**{"data_dir": tmp_path / "data", "long_poll_timeout": 1, **overrides})
        client: TestClient[Any, Any] = TestClient(TestServer(create_app(config)))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()


# Tests that run alone: scripts/test runs the rest first, several at a time (pytest-xdist), then
# these one by one (-m serial). Spark's (a JVM per session or per `ds3 pipeline` run, and its
# Python workers must connect back within Spark's timeout: under a machine's full load they did
# not) and the conformance suite (which runs its topologies side by side itself).
SERIAL_MODULES = ("test_conformance", "test_pipeline_")


@pytest.hookimpl(tryfirst=True)  # (before -m selects by the markers)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        if module.startswith(SERIAL_MODULES):
            item.add_marker(pytest.mark.serial)
