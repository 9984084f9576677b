"""A cluster member's standby (`--standby` with the member's `--ingester-id`) takes the member's
namespace over when it dies, and readers follow it by the member's ownership record while the
description still names the dead machine. Before, every request for the member's streams
answered 503 until an admin changed its URL with `ds3 cluster set`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests import procs
from tests.procs import request

TEXT = {"Content-Type": "text/plain"}


def _read(reader: procs.Proc, path: str) -> bytes:
    out, off = b"", "-1"
    while True:
        status, h, body = request(reader, "GET", f"{path}?offset={off}")
        assert status == 200, (status, body)
        out += body
        if h.get("stream-up-to-date") == "true":
            return out
        off = h["stream-next-offset"]


def test_readers_follow_a_members_standby_by_its_ownership_record(tmp_path: Path) -> None:
    store_root = tmp_path / "objects"
    pa, pb, pa2 = procs.free_port(), procs.free_port(), procs.free_port()
    cluster = procs.write_cluster(store_root, {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"})
    common = ["--store", store_root.as_uri(), "--durability", "store", "--lease-seconds", "2", "--cluster-refresh", "0.5",
              "--write-rate", "0"]
    a = procs.ingester(tmp_path / "a", *common, "--ingester-id", "a", port=pa).start()
    b = procs.ingester(tmp_path / "b", *common, "--ingester-id", "b", port=pb).start()
    standby = procs.ingester(tmp_path / "a2", *common, "--ingester-id", "a", "--standby", port=pa2).start()
    reader = procs.reader(tmp_path / "reader", None, store_root.as_uri(), "--cluster-refresh", "0.5").start()
    try:
        on_a = "/v1/stream/" + next(s for s in (f"s-{n}" for n in range(100)) if cluster.owner(s).id == "a")
        on_b = "/v1/stream/" + next(s for s in (f"s-{n}" for n in range(100)) if cluster.owner(s).id == "b")
        for path in (on_a, on_b):
            assert request(reader, "PUT", path, headers=TEXT)[0] == 201
            assert request(reader, "POST", path, b"1\n", TEXT)[0] == 204
        assert a.popen is not None
        os.kill(a.popen.pid, signal.SIGKILL)
        a.popen.wait()
        # b's streams go on; a's answer 503 + Retry-After until the standby has taken over
        # and the reader has found it (its first failed forward made it read a's record)
        assert request(reader, "POST", on_b, b"2\n", TEXT)[0] == 204
        deadline, statuses = time.monotonic() + 20, []
        while True:
            status, headers, body = request(reader, "POST", on_a, b"2\n", TEXT)
            statuses.append(status)
            if status == 204:
                break
            assert status == 503 and headers.get("retry-after"), (status, body)
            assert time.monotonic() < deadline, f"a's streams still refused: {body!r}"
            time.sleep(0.2)
        for path in (on_a, on_b):
            assert _read(reader, path) == b"1\n2\n", path
            assert request(reader, "POST", path, b"3\n", TEXT)[0] == 204
        assert f"cluster member a, by its ownership record, is http://127.0.0.1:{pa2}" in reader.log_path.read_text()
        print(f"\na's standby took over: {len(statuses) - 1} appends refused (503) before the first through it")
    finally:
        reader.stop()
        standby.stop()
        b.stop()
        a.stop()
