"""A data dir's WAL belongs with the store its commits are logged to (ingester/wal_binding.py).

Found by QA: an ingester run with --durability store, restarted once on the same data dir
without --store (DS3_STORE forgotten), acknowledged writes the store's log never got; with
--store back nothing noticed, and after a lost disk the restore lacked those streams (404)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import procs

TEXT = {"Content-Type": "text/plain"}


def _start_refused(data_dir: Path, *extra: str) -> str:
    """Start `ds3 ingester` expecting a refusal: its output."""
    p = procs.ingester(data_dir, *extra)
    done = subprocess.run([procs.DS3, *p.args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.count("not starting:") == 1, done.stderr  # (click's "Error:" said it again)
    return done.stderr


def test_a_wal_used_with_a_store_is_refused_without_it_and_with_another(tmp_path: Path) -> None:
    store = (tmp_path / "store").as_uri()
    data = tmp_path / "d"
    owner = procs.ingester(data, "--store", store, "--durability", "store", "--lease-seconds", "3").start()
    try:
        assert procs.request(owner, "PUT", "/v1/stream/s1", headers=TEXT)[0] == 201
        assert procs.request(owner, "POST", "/v1/stream/s1", b"acked", headers=TEXT)[0] == 204
    finally:
        owner.stop()

    said = _start_refused(data)  # no --store
    assert f"belongs with the object store {store}" in said and f"--store {store} (DS3_STORE)" in said, said
    typo = (tmp_path / "stroe").as_uri()
    said = _start_refused(data, "--store", typo, "--durability", "store")
    assert f"belongs with the object store {store}, not {typo}" in said, said
    assert not (tmp_path / "stroe" / "_ds3").exists()  # nothing was written to the other store

    # With its store it starts, and what it acknowledged is in the log: a new disk has it all.
    again = procs.ingester(data, "--store", store, "--durability", "store", "--lease-seconds", "3").start()
    try:
        assert procs.request(again, "POST", "/v1/stream/s1", b"+more", headers=TEXT)[0] == 204
    finally:
        again.kill()
    same_owner = (data / "owner-id").read_text().strip()  # (a new disk need not wait out the lease)
    fresh = procs.ingester(tmp_path / "new-disk", "--store", store, "--durability", "store",
                           "--owner-id", same_owner).start(timeout=30)
    try:
        assert procs.read_all(fresh, "/v1/stream/s1") == b"acked+more"
    finally:
        fresh.stop()


@pytest.mark.parametrize("mode", ["local", "store"])
def test_a_wal_that_logged_before_it_was_bound_is_refused_without_a_store(tmp_path: Path, mode: str) -> None:
    """A WAL from before the binding was recorded: a commit seq says it logged to a store."""
    from ingester import wal_binding
    from ingester.wal import WalEnv

    store = (tmp_path / "store").as_uri()
    data = tmp_path / "d"
    owner = procs.ingester(data, "--store", store, "--durability", mode, "--lease-seconds", "3").start()
    try:
        assert procs.request(owner, "PUT", "/v1/stream/s", headers=TEXT)[0] == 201
    finally:
        owner.stop()
    wal = WalEnv(data / "wal", 1 << 30)
    try:
        with wal.env.begin(write=True) as txn:
            assert txn.delete(wal_binding.BOUND_TO, db=wal.sys)
    finally:
        wal.close()
    said = _start_refused(data)
    assert "was used with an object store (its commits were logged there)" in said, said


def test_a_store_can_be_added_to_a_wal_that_never_had_one(tmp_path: Path) -> None:
    data = tmp_path / "d"
    alone = procs.ingester(data).start()
    try:
        assert procs.request(alone, "PUT", "/v1/stream/s", b"before", headers=TEXT)[0] == 201
    finally:
        alone.stop()
    store = (tmp_path / "store").as_uri()
    logged = procs.ingester(data, "--store", store, "--lease-seconds", "3").start()
    try:
        assert procs.read_all(logged, "/v1/stream/s") == b"before"
    finally:
        logged.stop()
    assert "belongs with the object store" in _start_refused(data)  # and from then on it is bound


def test_a_data_dir_holding_its_store_can_be_moved(tmp_path: Path) -> None:
    """`ds3 dev` keeps its local store in the data dir: moved (a new mount point), the WAL and
    the store go together, so it starts there."""
    old = tmp_path / "old"
    first = procs.ingester(old, "--store", (old / "objects").as_uri(), "--seal-age", "0.2").start()
    try:
        assert procs.request(first, "PUT", "/v1/stream/s", b"sealed", headers=TEXT)[0] == 201
    finally:
        first.stop()
    new = old.rename(tmp_path / "new")
    moved = procs.ingester(new, "--store", (new / "objects").as_uri()).start()
    try:
        assert procs.request(moved, "POST", "/v1/stream/s", b"+tail", headers=TEXT)[0] == 204
        assert procs.read_all(moved, "/v1/stream/s") == b"sealed+tail"
    finally:
        moved.stop()
    said = _start_refused(new, "--store", (tmp_path / "elsewhere").as_uri())
    assert f"belongs with the object store {(new / 'objects').as_uri()}, not" in said, said


def test_a_data_dir_beside_its_store_can_be_moved_with_it_or_alone(tmp_path: Path) -> None:
    """`ds3 dev --ingesters N` keeps each member's data dir beside the store (`.ds3/i1`,
    `.ds3/objects`): found by QA, the moved `.ds3` was refused as belonging with the store's old
    path. Moved together, or the data dir alone (the store where it was), the WAL starts."""
    old = tmp_path / "old"

    def started(data: Path, store: Path) -> procs.Proc:
        return procs.ingester(data, "--store", store.as_uri(), "--seal-age", "0.2").start()

    first = started(old / "i1", old / "objects")
    try:
        assert procs.request(first, "PUT", "/v1/stream/s", b"sealed", headers=TEXT)[0] == 201
    finally:
        first.stop()
    new = old.rename(tmp_path / "new")
    moved = started(new / "i1", new / "objects")
    try:
        assert procs.request(moved, "POST", "/v1/stream/s", b"+1", headers=TEXT)[0] == 204
    finally:
        moved.stop()
    alone = (new / "i1").rename(tmp_path / "i1")
    again = started(alone, new / "objects")
    try:
        assert procs.request(again, "POST", "/v1/stream/s", b"+2", headers=TEXT)[0] == 204
        assert procs.read_all(again, "/v1/stream/s") == b"sealed+1+2"
    finally:
        again.stop()
    said = _start_refused(alone, "--store", (tmp_path / "old" / "objects").as_uri())
    assert f"belongs with the object store {(new / 'objects').as_uri()}, not" in said, said
