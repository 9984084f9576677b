"""A fenced ingester (one that owned its store prefix and was taken over) answers no stream
request, reads included, and says so on /readyz, against real processes.

The owner is frozen (SIGSTOP) until a standby takes the prefix over and appends, then resumed
(SIGCONT). Its writes already answered 503 (tests/test_standby.py); its reads must too: its
tail, a HEAD's Stream-Next-Offset, a long-poll's "nothing new" are the old owner's, and a
reader pinned to it with --ingester would pass them on as up to date. /readyz is 503 naming the
fence, whether or not the owner was started with --standby or --ingester-id.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.cluster import StoreView
from tests.test_durability import _req
from tests.test_standby import LEASE, TEXT, _node

pytestmark = pytest.mark.slow


def _get_keep_alive(port: int, method: str, target: str) -> tuple[int, dict[str, str], bytes]:
    """One request on a keep-alive connection (the fast lane's kind of request)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, target)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("durability", ["local", "store"])
def test_a_resumed_owner_taken_over_answers_no_read_and_is_not_ready(tmp_path: Path, durability: str) -> None:
    store = StoreView.local(tmp_path / "objects")
    mode = ["--durability", durability, "--ship-interval", "0.2"]
    a = _node(tmp_path / "a", store, *mode).start()  # the default owner: no --standby, no --ingester-id
    b = _node(tmp_path / "b", store, *mode, "--standby").start()
    assert a.popen is not None
    try:
        assert _req("PUT", f"{a.url}/v1/stream/x", headers=TEXT)[0] == 201
        for i in range(5):
            assert _req("POST", f"{a.url}/v1/stream/x", b"a-%d\n" % i, TEXT)[0] == 204
        ready = json.loads(_req("GET", f"{a.url}/readyz")[2])
        assert ready["status"] == "ready" and ready["checks"]["ownership"] == "ok", ready
        stale_tail = _req("HEAD", f"{a.url}/v1/stream/x")[1]["Stream-Next-Offset"]
        time.sleep(0.6)  # shipped (local mode)
        os.kill(a.popen.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + LEASE + 15
            status = 0
            while time.monotonic() < deadline and status != 204:
                status = _req("POST", f"{b.url}/v1/stream/x", b"b-0\n", TEXT, timeout=5)[0]
                time.sleep(0.05)
            assert status == 204, b.log_path.read_text()[-3000:]
        finally:
            os.kill(a.popen.pid, signal.SIGCONT)
        new_tail = _req("HEAD", f"{b.url}/v1/stream/x")[1]["Stream-Next-Offset"]
        assert new_tail != stale_tail

        # at once after the resume, and on both of its paths (a fresh connection each, and a
        # keep-alive one: the fast lane's), every stream request answers 503, none the stale tail
        for _ in range(10):
            for method, target in [("HEAD", "/v1/stream/x"), ("GET", "/v1/stream/x?offset=-1"),
                                   ("GET", f"/v1/stream/x?offset={stale_tail}"),
                                   ("GET", f"/v1/stream/x?offset={stale_tail}&live=long-poll")]:
                status, headers, body = _req(method, f"{a.url}{target}", timeout=10)
                assert status == 503 and "Retry-After" in headers, (method, target, status, headers, body)
                assert b"does not own its store prefix" in body or method == "HEAD", body
                status, headers, _ = _get_keep_alive(a.port, method, target)
                assert status == 503 and "Retry-After" in headers, (method, target, status, headers)
            time.sleep(0.05)
        ready = json.loads(_req("GET", f"{a.url}/readyz")[2])
        assert ready["status"] == "not ready", ready
        assert any("fenced" in r for r in ready["reasons"]), ready
        assert _req("GET", f"{a.url}/healthz")[0] == 200  # alive, only not the owner
        # the new owner serves the whole stream, the old owner's appends and its own
        status, headers, body = _req("GET", f"{b.url}/v1/stream/x?offset=-1")
        assert status == 200 and body == b"".join(b"a-%d\n" % i for i in range(5)) + b"b-0\n", body
    finally:
        a.kill()
        b.stop()
