"""Settings that cannot work are refused at start in one line naming the problem, exit code
non-zero and no traceback (a port in use, a data dir that cannot be a directory)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import DS3, free_port


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS3_")}
    return subprocess.run([DS3, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:  # an ordinary listener holds the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def test_an_ingester_on_a_port_in_use_says_so_and_releases_its_lease(tmp_path: Path, taken_port: int) -> None:
    """It used to end in uvloop's OSError traceback (the lease was released all the same)."""
    store = (tmp_path / "o").as_uri()
    r = _run("ingester", "--port", str(taken_port), "--data-dir", "d", "--store", store, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert f"ds3 ingester: cannot listen on 127.0.0.1 port {taken_port}: Address already in use" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "released " in r.stderr, r.stderr  # the store's lease: another ingester may start at once


def test_a_host_that_does_not_resolve_is_named(tmp_path: Path) -> None:
    """Found by QA: "cannot listen on ...: Unknown error -2"."""
    r = _run("ingester", "--host", "not.a.host.invalid", "--port", "4421", "--data-dir", "d", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "cannot listen on not.a.host.invalid port 4421: the host name does not resolve" in r.stderr, r.stderr
    assert "--host, DS3_HOST" in r.stderr and "Unknown error" not in r.stderr


def test_a_lone_reader_on_a_port_in_use_says_so(tmp_path: Path, taken_port: int) -> None:
    (tmp_path / "o").mkdir()
    r = _run("reader", "--workers", "1", "--port", str(taken_port), "--ingester", "http://127.0.0.1:1",
             "--store", (tmp_path / "o").as_uri(), cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert f"ds3 reader: cannot listen on 127.0.0.1 port {taken_port}: Address already in use" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["ingester", "dev"])
@pytest.mark.parametrize("data_dir, why", [
    ("afile", "exists and is not a directory"),
    ("afile/sub", "Not a directory"),
    ("/proc/nope", "cannot create /proc/nope"),
])
def test_a_data_dir_that_cannot_be_one_is_refused_by_name(tmp_path: Path, command: str, data_dir: str,
                                                          why: str) -> None:
    """It used to end in a FileExistsError, NotADirectoryError or FileNotFoundError traceback."""
    (tmp_path / "afile").write_text("not a directory")
    r = _run(command, "--data-dir", data_dir, "--port", str(free_port()), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "data-dir (DS3_DATA_DIR)" in r.stderr and why in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
