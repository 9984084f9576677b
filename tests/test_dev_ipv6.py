"""`ds3 dev --host` with an IPv6 address: its readiness check must bracket the address in
the URL (before, http://::1:port was no URL and `ds3 dev` never became ready)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.procs import DS3


def _free_port6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("host", ["::1", "::"])
def test_dev_on_an_ipv6_address_becomes_ready(tmp_path: Path, host: str) -> None:
    try:
        port = _free_port6()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    log = tmp_path / "dev.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([DS3, "dev", "--host", host, "--port", str(port), "--data-dir", str(tmp_path / "d")],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while "ds3 dev ready" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        assert "ds3 dev ready" in log.read_text(), log.read_text()
        with urllib.request.urlopen(f"http://[::1]:{port}/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(20)
