"""Warnings a process would repeat per request in a known state are logged once per interval
(shared.logs.RepeatedWarnings): a standby answers every stream request 503, and wrote a
WARNING line for each (275 lines in 14 s at 20 requests/s, found by QA). And a standby names
its owner once, not at each renewal of the owner's lease."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from shared import logs
from tests import procs
from tests.cluster import StoreView
from tests.test_durability import _req
from tests.test_standby import LEASE, TEXT, _node


def test_a_kind_is_logged_once_per_interval_and_the_next_line_counts_the_rest(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    repeats = logs.RepeatedWarnings(logging.getLogger("test.repeats"), interval=10)
    steps = [  # (seconds later, kind, logged line or None)
        (0, "a", "GET /x: a"),
        (1, "a", None),
        (1, "b", "GET /x: b"),  # another kind is logged at once
        (5, "a", None),
        (2.9, "a", None),
        (0.2, "a", "GET /x: a (and 3 more like it in the last 10 s, not logged)"),
        (10, "b", "GET /x: b"),  # nothing left out meanwhile: the plain line
    ]
    caplog.set_level(logging.WARNING, logger="test.repeats")
    for later, kind, line in steps:
        now[0] += later
        caplog.clear()
        repeats.warning(kind, "GET /x: %s", kind)
        assert [r.getMessage() for r in caplog.records] == ([line] if line else []), (later, kind)


@pytest.mark.slow
def test_a_standby_refusing_many_requests_logs_a_few_lines(tmp_path: Path) -> None:
    store = StoreView.local(tmp_path / "objects")
    a = _node(tmp_path / "a", store).start()
    b = _node(tmp_path / "b", store, "--standby").start()
    try:
        for i in range(100):
            assert _req("POST", f"{b.url}/v1/stream/s{i % 3}", b"x", TEXT)[0] == 503
        time.sleep(LEASE)  # the owner renews its lease three times meanwhile
        lines = b.log_path.read_text().splitlines()
        refusals = [line for line in lines if "this ingester is a standby" in line]
        assert 1 <= len(refusals) <= 2, refusals
        # the owner is named once, not at each of its renewals (every lease/3)
        owners = [line for line in lines if "standby: " in line and " owns " in line]
        assert len(owners) == 1, owners
    finally:
        b.stop()
        a.stop()


@pytest.mark.slow
def test_a_reader_whose_ingester_is_down_logs_a_few_lines(tmp_path: Path) -> None:
    (tmp_path / "objects").mkdir()
    store = (tmp_path / "objects").as_uri()
    ing = procs.ingester(tmp_path / "data", "--store", store).start()
    rdr = procs.reader(tmp_path, ing.url, store, "--workers", "1").start()
    try:
        assert procs.request(rdr, "PUT", "/v1/stream/x", headers=TEXT)[0] == 201
        ing.kill()
        for _ in range(60):
            status, _, body = procs.request(rdr, "POST", "/v1/stream/x", b"x", TEXT)
            assert status == 503
        assert f"the ingester at {ing.url} is unreachable".encode() in body, body  # (which one: a cluster has several)
        status, _, body = procs.request(rdr, "GET", "/v1/stream/x?offset=now")  # aiohttp's path
        assert status == 503 and f"the ingester at {ing.url} is unreachable".encode() in body, body
        lines = [line for line in rdr.log_path.read_text().splitlines() if "WARNING" in line and "/v1/stream/x" in line]
        assert 1 <= len(lines) <= 2, lines
        assert "does not exist" not in rdr.log_path.read_text()  # (the ingester had made the store)
    finally:
        rdr.stop()
        ing.kill()
