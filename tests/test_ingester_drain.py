"""SIGTERM drains an ingester with real processes: every live wait in flight gets a complete
answer before its connection closes. A parked long-poll, on the fast lane (a concrete offset,
keep-alive: ingester/fastlane.py _LongPoll) and on aiohttp's path (`offset=now`, or a
`Connection: close` request: ingester/http.py handle_get), answers as at its timeout (204, the
same Stream-Next-Offset: its client asks again, of whoever serves next); an SSE response ends
with its last chunk; the process exits 0. Before, they were cut with no answer (the reader's
side: tests/test_reader_drain.py)."""

from __future__ import annotations

import http.client
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.procs import ingester, request
from tests.test_reader_drain import Outcome

TEXT = {"Content-Type": "text/plain"}


def _client(port: int, target: str, headers: dict[str, str], out: Outcome) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", target, headers=headers)
        r = conn.getresponse()
        out.status, out.headers = r.status, {k.lower(): v for k, v in r.getheaders()}
        out.body = r.read()  # a cut chunked body raises IncompleteRead
    except Exception as e:
        out.error = e
    finally:
        conn.close()


@pytest.mark.slow
def test_sigterm_answers_every_live_wait_then_exits_0(tmp_path: Path) -> None:
    (tmp_path / "objects").mkdir()
    ing = ingester(tmp_path / "data", "--long-poll-timeout", "60", "--store", (tmp_path / "objects").as_uri())
    ing.start()
    assert ing.popen is not None
    try:
        assert request(ing, "PUT", "/v1/stream/x", headers=TEXT)[0] == 201
        assert request(ing, "POST", "/v1/stream/x", body=b"hello", headers=TEXT)[0] == 204
        tail = request(ing, "HEAD", "/v1/stream/x")[1]["stream-next-offset"]
        kinds = {
            "lane": (f"/v1/stream/x?offset={tail}&live=long-poll", {}),
            "aiohttp-now": ("/v1/stream/x?offset=now&live=long-poll", {}),
            "aiohttp-close": (f"/v1/stream/x?offset={tail}&live=long-poll", {"Connection": "close"}),
            "sse": (f"/v1/stream/x?offset={tail}&live=sse", {}),
        }
        outcomes: dict[str, list[Outcome]] = {k: [Outcome() for _ in range(3)] for k in kinds}
        threads = [threading.Thread(target=_client, args=(ing.port, *kinds[k], o), daemon=True)
                   for k, os_ in outcomes.items() for o in os_]
        for t in threads:
            t.start()
        time.sleep(1.5)  # all parked (a 60 s long-poll timeout: whatever answers them is the drain)
        waiting = [o for k in ("lane", "aiohttp-now", "aiohttp-close") for o in outcomes[k]]
        assert all(o.status is None and o.error is None for o in waiting), outcomes
        sent = time.monotonic()
        ing.popen.send_signal(signal.SIGTERM)
        assert ing.popen.wait(10) == 0
        took = time.monotonic() - sent
        for t in threads:
            t.join(10)
        assert took < 5, took
        for kind in ("lane", "aiohttp-close"):
            for o in outcomes[kind]:
                assert o.error is None and o.status == 204, (kind, o)
                assert o.headers["stream-next-offset"] == tail and o.headers["stream-up-to-date"] == "true", (kind, o)
        for o in outcomes["aiohttp-now"]:
            assert o.error is None and o.status == 204 and o.headers["stream-next-offset"] == tail, o
        for o in outcomes["sse"]:
            assert o.error is None and o.status == 200, o  # the whole body, ended by its last chunk
            assert b"event: control" in o.body and tail.encode() in o.body, o
    finally:
        ing.stop()
