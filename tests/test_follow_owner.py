"""Readers follow the store prefix's owner (issue 14 item 5), with real processes: a reader
started without --ingester forwards to the ingester the ownership record names; the ingester is
replaced by another on a new port and an empty disk (it restores from the store's log); the
reader moves to it without a restart, and every append is there at its offset."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests import procs
from tests.procs import request

TEXT = {"Content-Type": "text/plain"}


def test_a_reader_follows_the_prefix_owner_across_a_replacement(tmp_path: Path) -> None:
    store = (tmp_path / "objects").as_uri()
    a = procs.ingester(tmp_path / "a", "--store", store, "--write-rate", "0").start()
    reader = procs.reader(tmp_path / "r", None, store, "--write-rate", "0").start()
    b: procs.Proc | None = None
    try:
        assert request(reader, "PUT", "/v1/stream/f", headers=TEXT)[0] == 201
        offsets = []
        for i in range(20):
            status, headers, _ = request(reader, "POST", "/v1/stream/f", b"%d," % i, TEXT)
            assert status == 204
            offsets.append(headers["stream-next-offset"])
        a.stop()  # a clean stop releases the prefix: a replacement may take it at once
        b = procs.ingester(tmp_path / "b", "--store", store, "--write-rate", "0").start()
        started = time.monotonic()
        while True:  # the reader learns the new owner from the record (every 2 s, sooner on failures)
            status, headers, body = request(reader, "POST", "/v1/stream/f", b"after,", TEXT)
            if status == 204:
                break
            assert status == 503, (status, body)
            assert time.monotonic() - started < 15, "the reader never moved to the new owner"
            time.sleep(0.2)
        assert headers["stream-next-offset"] > offsets[-1]
        status, _, body = request(reader, "GET", "/v1/stream/f?offset=-1")
        assert status == 200 and body == b"".join(b"%d," % i for i in range(20)) + b"after,"
        # the same bytes from the same offsets as before the replacement
        status, _, body = request(reader, "GET", f"/v1/stream/f?offset={offsets[9]}")
        assert status == 200 and body.startswith(b"10,11,")
        metrics = request(reader, "GET", "/metrics")[2].decode()
        assert "ds3_reader_owner_changes_total 1.0" in metrics
    finally:
        reader.stop()
        if b is not None:
            b.stop()
        a.stop()


def test_a_reader_without_an_ingester_or_an_owner_says_what_to_do(tmp_path: Path) -> None:
    store = (tmp_path / "objects").as_uri()
    reader = procs.reader(tmp_path / "r", None, store).start()
    try:
        status, headers, body = request(reader, "PUT", "/v1/stream/x", headers=TEXT)
        assert status == 503 and headers["retry-after"] == "2"
        assert b"no ingester owns the store prefix yet" in body and b"--ingester" in body
        # /readyz gives the same reason (it said "no cluster description read yet")
        status, _, body = request(reader, "GET", "/readyz")
        ready = json.loads(body)
        assert status == 503 and "no ingester owns the store prefix yet" in ready["checks"]["ingester"], ready
        # and its log says the local store it was given did not exist (a typo'd --store is not silent)
        assert "does not exist: created it empty" in reader.log_path.read_text()
    finally:
        reader.stop()
