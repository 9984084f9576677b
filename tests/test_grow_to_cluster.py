"""A single ingester's store prefix grows into a cluster, and a single ingester cannot start on a
cluster's prefix (shared/adoption.py, ingester/membership.py).

Found by QA: an ingester started without --ingester-id beside a cluster's members created a
stream the cluster had, and readers then served its bytes for that path; and a prefix run by
one ingester, given a cluster description, lost every stream it had (404 through the reader,
the old data dir refused as belonging with another store)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds3.cli import main
from tests import procs
from tests.procs import request

TEXT = {"Content-Type": "text/plain"}
STREAMS = [f"s{i}" for i in range(8)]


def _set(store: str, *specs: str) -> tuple[int, str]:
    done = CliRunner().invoke(main, ["cluster", "set", "--store", store, *(a for s in specs for a in ("--ingester", s))])
    return done.exit_code, done.output


def _single(tmp_path: Path, store: str) -> tuple[dict[str, bytes], dict[str, str]]:
    """Run a single ingester: streams with sealed history and an unsealed tail, a producer's
    append; stopped. What each stream holds, and its next offset."""
    lone = procs.ingester(tmp_path / "lone", "--store", store, "--seal-age", "0.3").start()
    held: dict[str, bytes] = {}
    tails: dict[str, str] = {}
    try:
        for s in STREAMS:
            assert request(lone, "PUT", f"/v1/stream/{s}", f"{s}:sealed;".encode(), TEXT)[0] == 201
            held[s] = f"{s}:sealed;".encode()
        time.sleep(1.2)  # sealed
        status, said = _set(store, "a=http://127.0.0.1:1", "b=http://127.0.0.1:2")
        assert status != 0 and "a single ingester owns this store prefix now" in said, said  # refused while it runs
        for s in STREAMS:
            producer = {**TEXT, "Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
            assert request(lone, "POST", f"/v1/stream/{s}", b"tail;", producer)[0] == 200
            held[s] += b"tail;"
            tails[s] = request(lone, "HEAD", f"/v1/stream/{s}")[1]["stream-next-offset"]
    finally:
        lone.stop()
    return held, tails


@pytest.mark.parametrize("disk", ["kept", "lost"])
def test_a_single_ingesters_streams_move_into_the_cluster(tmp_path: Path, disk: str) -> None:
    store_root = tmp_path / "objects"
    store = store_root.as_uri()
    held, tails = _single(tmp_path, store)
    pa, pb = procs.free_port(), procs.free_port()
    status, said = _set(store, f"b=http://127.0.0.1:{pb}", f"a=http://127.0.0.1:{pa}")
    assert status == 0, said
    assert '"generation": 2' in said and "adopts the streams of the single ingester" in said, said
    if disk == "lost":
        shutil.rmtree(tmp_path / "lone")
    common = ["--store", store, "--cluster-refresh", "0.2"]
    # the first listed (b) adopts: the single ingester's data dir, or an empty one restored from the root's log
    b = procs.ingester(tmp_path / "lone", *common, "--ingester-id", "b", port=pb).start()
    a = procs.ingester(tmp_path / "a", *common, "--ingester-id", "a", port=pa).start()
    reader = procs.reader(tmp_path / "r", None, store).start()
    try:
        owners = {request(a, "HEAD", f"/v1/stream/{s}")[0] for s in STREAMS}
        assert owners == {200, 421}, owners  # some streams are a's now: they moved
        for s in STREAMS:
            assert procs.read_all(reader, f"/v1/stream/{s}") == held[s], s
            assert request(reader, "HEAD", f"/v1/stream/{s}")[1]["stream-next-offset"] == tails[s], s
            retry = {**TEXT, "Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
            assert request(reader, "POST", f"/v1/stream/{s}", b"tail;", retry)[0] == 204, s  # deduplicated
            assert request(reader, "POST", f"/v1/stream/{s}", b"more;", TEXT)[0] == 204, s
            assert procs.read_all(reader, f"/v1/stream/{s}") == held[s] + b"more;", s
    finally:
        reader.stop()
        a.stop()
        b.stop()
    # and a single ingester is refused on the cluster's prefix
    lone = procs.ingester(tmp_path / "other", "--store", store)
    done = subprocess.run([procs.DS3, *lone.args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "is shared by a cluster of ingesters" in done.stderr, done.stderr


def test_a_single_ingester_is_refused_on_a_clusters_prefix(tmp_path: Path) -> None:
    store_root = tmp_path / "objects"
    procs.write_cluster(store_root, {"a": "http://127.0.0.1:1"})
    lone = procs.ingester(tmp_path / "lone", "--store", store_root.as_uri())
    done = subprocess.run([procs.DS3, *lone.args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "is shared by a cluster of ingesters (its _ds3/cluster.json describes the members)" in done.stderr
    assert not (store_root / "_ds3" / "owner.json").exists()  # it took nothing
