"""A sealed read of a stream with a TTL through a reader, its ingester frozen (SIGSTOP): served
from the store within about a second (reader.http.renew), as with the ingester down. Found by
QA: the reader waited for the ingester's renewal until its upstream timeout, 60 s."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests import procs
from tests.procs import request

TEXT = {"Content-Type": "text/plain"}


def test_a_sealed_read_of_a_ttl_stream_does_not_wait_for_a_frozen_ingester(tmp_path: Path) -> None:
    store = (tmp_path / "objects").as_uri()
    ingester = procs.ingester(tmp_path / "d", "--store", store, "--seal-age", "0.2").start()
    reader = procs.reader(tmp_path / "r", ingester.url, store).start()
    try:
        assert request(reader, "PUT", "/v1/stream/s", b"history", {**TEXT, "Stream-TTL": "600"})[0] == 201
        assert request(reader, "POST", "/v1/stream/s", b"", {"Stream-Closed": "true"})[0] == 204
        time.sleep(1.5)  # sealed, its descriptor in the store
        assert request(reader, "GET", "/v1/stream/s?offset=-1")[0] == 200
        assert ingester.popen is not None
        os.kill(ingester.popen.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            status, headers, body = request(reader, "GET", "/v1/stream/s?offset=-1", timeout=30)
            took = time.monotonic() - started
        finally:
            os.kill(ingester.popen.pid, signal.SIGCONT)
        assert (status, body, headers.get("stream-closed")) == (200, b"history", "true")
        assert took < 10, took  # (the upstream timeout is 60 s)
    finally:
        reader.stop()
        ingester.stop()
