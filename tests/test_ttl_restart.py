"""A read's TTL renewal survives a crash (ingester/store_expiry.py load_expiry_index).

Found by QA: reads renew a stream's TTL in memory, persisted every few seconds; a SIGKILL half a
second after a read, and the restarted ingester deleted the stream at the deadline the read had
pushed back, data and all. After a run that did not stop cleanly every stream with a TTL counts
as renewed at the start; after a clean stop nothing is extended."""

from __future__ import annotations

import time
from pathlib import Path

from tests import procs
from tests.procs import request

TEXT = {"Content-Type": "text/plain"}


def test_a_renewal_by_a_read_is_kept_across_a_sigkill(tmp_path: Path) -> None:
    p = procs.ingester(tmp_path / "d").start()
    try:
        created = time.monotonic()
        assert request(p, "PUT", "/v1/stream/s", b"kept", {**TEXT, "Stream-TTL": "4"})[0] == 201
        time.sleep(2.5)
        assert request(p, "GET", "/v1/stream/s?offset=-1")[0] == 200  # renewed: lives until ~6.5 s
        p.kill()
        p.start()
        time.sleep(max(0.0, created + 5.0 - time.monotonic()))  # past the deadline of the creation
        status, _, body = request(p, "GET", "/v1/stream/s?offset=-1")
        assert (status, body) == (200, b"kept")
    finally:
        p.stop()


def test_a_clean_stop_extends_nothing(tmp_path: Path) -> None:
    p = procs.ingester(tmp_path / "d").start()
    try:
        assert request(p, "PUT", "/v1/stream/s", b"gone", {**TEXT, "Stream-TTL": "2"})[0] == 201
        p.stop()
        time.sleep(2.5)
        p.start()
        assert request(p, "GET", "/v1/stream/s?offset=-1")[0] == 404
    finally:
        p.stop()
