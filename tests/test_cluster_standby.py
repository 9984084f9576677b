"""A cluster member's standby (`--standby` with the member's `--ingester-id`) takes the member's
namespace over when it dies, and readers follow it by the member's ownership record while the
description still names the dead machine. Before, every request for the member's streams
answered 503 until an admin changed its URL with `ds3 cluster set`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from shared.placement import Cluster, Ingester
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


def _start(tmp_path: Path, store_root: Path, pa: int, pb: int, pa2: int) -> tuple[
        list[str], procs.Proc, procs.Proc, procs.Proc, procs.Proc]:
    """Members a and b, a's standby and a reader, started; their common arguments."""
    common = ["--store", store_root.as_uri(), "--durability", "store", "--lease-seconds", "2", "--cluster-refresh", "0.5",
              "--write-rate", "0"]
    a = procs.ingester(tmp_path / "a", *common, "--ingester-id", "a", port=pa).start()
    b = procs.ingester(tmp_path / "b", *common, "--ingester-id", "b", port=pb).start()
    standby = procs.ingester(tmp_path / "a2", *common, "--ingester-id", "a", "--standby", port=pa2).start()
    reader = procs.reader(tmp_path / "reader", None, store_root.as_uri(), "--cluster-refresh", "0.5").start()
    return common, a, b, standby, reader


def test_readers_follow_a_members_standby_by_its_ownership_record(tmp_path: Path) -> None:
    store_root = tmp_path / "objects"
    pa, pb, pa2 = procs.free_port(), procs.free_port(), procs.free_port()
    cluster = procs.write_cluster(store_root, {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"})
    _, a, b, standby, reader = _start(tmp_path, store_root, pa, pb, pa2)
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


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_ingesters_reach_a_members_standby_for_forks_and_moves(tmp_path: Path, fault: str) -> None:
    """The other members call a member's standby too, by its ownership record: a fork whose
    source the standby now holds, and streams moving from it to an ingester added after the
    takeover, while the description still names the dead (or frozen) machine. Before, both
    answered 503 until `ds3 cluster set` named the standby; a frozen member's calls waited
    their timeouts (15 s for a fork's pin, 60 s for a move) before its record was read."""
    store_root = tmp_path / "objects"
    pa, pb, pc, pa2 = procs.free_port(), procs.free_port(), procs.free_port(), procs.free_port()
    urls = {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"}
    procs.write_cluster(store_root, urls)
    grown = Cluster(2, tuple(Ingester(i, u) for i, u in {**urls, "c": f"http://127.0.0.1:{pc}"}.items()))
    names = [f"s-{n}" for n in range(300)]
    on_b = "/v1/stream/" + next(s for s in names if grown.owner(s).id == "b")
    moving = "/v1/stream/" + next(s for s in names if grown.owner(s).id == "c" and _first_owner(urls, s) == "a")
    source = "/v1/stream/" + next(s for s in names if grown.owner(s).id == "a")
    fork = "/v1/stream/" + next(s for s in names if grown.owner(s).id == "b" and f"/v1/stream/{s}" != on_b)
    common, a, b, standby, reader = _start(tmp_path, store_root, pa, pb, pa2)
    c = procs.ingester(tmp_path / "c", *common, "--ingester-id", "c", port=pc)
    try:
        for path in (moving, source):
            assert request(reader, "PUT", path, headers=TEXT)[0] == 201
            assert request(reader, "POST", path, b"1\n", TEXT)[0] == 204
        assert a.popen is not None
        os.kill(a.popen.pid, getattr(signal, fault))
        if fault == "SIGKILL":
            a.popen.wait()
        _until_accepted(reader, "POST", source, b"2\n", TEXT)  # the standby serves a's streams
        # b pins the fork's source at a's owner: the standby, by a's record
        _until_accepted(reader, "PUT", fork, b"", {**TEXT, "Stream-Forked-From": source})
        assert request(reader, "POST", fork, b"fork\n", TEXT)[0] == 204
        assert _read(reader, fork) == b"1\n2\nfork\n"
        # c joins with a still described at the dead machine's URL: c pulls a's streams from the standby
        c.start()
        procs.write_cluster(store_root, {**urls, "c": f"http://127.0.0.1:{pc}"})
        _until_accepted(c, "HEAD", moving, b"", {})  # c pulled it from the standby
        _until_accepted(reader, "POST", moving, b"2\n", TEXT)
        assert _read(reader, moving) == b"1\n2\n"
        assert _read(reader, source) == b"1\n2\n"
        assert "cluster member a, by its ownership record, is" in c.log_path.read_text()
    finally:
        if a.popen is not None and a.popen.poll() is None:
            os.kill(a.popen.pid, signal.SIGCONT)
        for p in (reader, c, standby, b, a):
            p.stop()


def _first_owner(urls: dict[str, str], stream: str) -> str:
    return Cluster(1, tuple(Ingester(i, u) for i, u in urls.items())).owner(stream).id


def _until_accepted(to: procs.Proc, method: str, path: str, body: bytes, headers: dict[str, str]) -> None:
    """Send until the request is accepted; only 503 + Retry-After is expected meanwhile."""
    deadline = time.monotonic() + 20
    while True:
        status, h, answer = request(to, method, path, body, headers)
        if status in (200, 201, 204):
            return
        assert status == 503 and h.get("retry-after"), (method, path, status, answer)
        assert time.monotonic() < deadline, f"{method} {path} still refused: {answer!r}"
        time.sleep(0.2)
