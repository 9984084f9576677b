"""Interoperability with the official clients: the TypeScript `@durable-streams/client` (from
tests/conformance/node_modules) and the PyPI `durable-streams` client (0.1.0, in the venv) against a
real `ds3 ingester`.

Each client runs as a child process driven by a script under tests/interop/ that exercises create,
append, catch-up read, long-poll and SSE live reads (plus, per client: idempotent producer, resume
from a saved offset, close, Stream-Seq, create conflicts, delete) on JSON, text and binary streams
and prints what it observed as one JSON line; the tests assert it equals what was written, and that
the live reads really went over long-poll / text/event-stream.

DS3_INTEROP_BASE_URL=http://127.0.0.1:PORT runs the tests against an already running server (e.g.
the Node reference server) instead of starting an ingester.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import ingester

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
INTEROP = HERE / "interop"
CONF = HERE / "conformance"
DRIVER_TIMEOUT_S = 180

JSON_ITEMS = [{"n": i, "msg": f"hello {i}"} for i in (1, 2, 3)]
LP_ITEM = {"n": 4, "msg": "live via long-poll"}
SSE_ITEM = {"n": 5, "msg": "live via sse"}
TEXT = ("héllo wörld ✓\n", "long-poll ✓\n", "sse ✓\n")
UP, DOWN = bytes(range(256)).hex(), bytes(range(255, -1, -1)).hex()


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("DS3_INTEROP_BASE_URL")
    if external:
        yield external.rstrip("/")
        return
    server = ingester(tmp_path_factory.mktemp("interop") / "data", "--long-poll-timeout", "2")
    try:
        server.start()
        yield server.url
    finally:
        server.stop()


def _ensure_npm_deps() -> None:
    """npm install in tests/conformance when node_modules is missing or package*.json changed (the
    same stamp as scripts/test and tests/test_conformance.py)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm not found on PATH: install Node.js (>= 20) to run the TypeScript client")
    want = hashlib.sha256(
        (CONF / "package.json").read_bytes() + (CONF / "package-lock.json").read_bytes()
    ).hexdigest()
    stamp = CONF / "node_modules" / ".ds3-stamp"
    if stamp.is_file() and stamp.read_text().strip() == want:
        return
    r = subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=CONF, capture_output=True, text=True, timeout=600, check=False,
    )
    assert r.returncode == 0, f"npm install in {CONF} failed:\n{r.stdout}\n{r.stderr}"
    stamp.write_text(want + "\n")


def _run_driver(cmd: list[str], cwd: Path) -> dict[str, Any]:
    """Run a client driver; returns its RESULT object."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd[1]} did not finish in {DRIVER_TIMEOUT_S}s:\n{e.stdout!r}\n{e.stderr!r}")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"{cmd} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


class Checks:
    """Collects every mismatch so that one run reports all of them."""

    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result
        self.problems: list[str] = []

    def scenario(self, name: str) -> dict[str, Any]:
        got = self.result.get(name)
        if not isinstance(got, dict) or "error" in got:
            self.problems.append(f"{name}: {got.get('error') if isinstance(got, dict) else 'missing'}")
            return {}
        return got

    def eq(self, what: str, got: object, want: object) -> None:
        if got != want:
            self.problems.append(f"{what}: got {got!r}, want {want!r}")

    def live(self, what: str, observed: dict[str, Any], mode: str, want: object) -> None:
        """A live read delivered `want`, over requests of the right mode."""
        self.eq(f"{what} data", observed.get("data"), want)
        reqs = observed.get("requests", [])
        live = [q for q in reqs if q.get("live") is not None]
        if not live or any(q["live"] != mode for q in live):
            self.problems.append(f"{what}: expected live={mode} requests, saw {reqs}")
        elif mode == "sse" and not any(
            q["status"] == 200 and (q.get("contentType") or "").startswith("text/event-stream") for q in live
        ):
            self.problems.append(f"{what}: no 200 text/event-stream answer among {live}")
        elif mode == "long-poll" and not any(q["status"] == 200 for q in live):
            self.problems.append(f"{what}: no long-poll request answered 200: {live}")

    def done(self) -> None:
        assert not self.problems, "client interop mismatches:\n  " + "\n  ".join(self.problems)


def test_typescript_client(base_url: str, tmp_path: Path) -> None:
    _ensure_npm_deps()
    # The driver resolves @durable-streams/client from a node_modules beside it.
    shutil.copy(INTEROP / "client_js.mjs", tmp_path / "client_js.mjs")
    (tmp_path / "node_modules").symlink_to(CONF / "node_modules", target_is_directory=True)
    result = _run_driver(["node", str(tmp_path / "client_js.mjs"), base_url, str(time.time_ns())], tmp_path)
    c = Checks(result)

    j = c.scenario("json")
    if j:
        c.eq("json catch-up", j["catchup"], JSON_ITEMS)
        c.live("json long-poll", j["longpoll"], "long-poll", [LP_ITEM])
        c.live("json sse", j["sse"], "sse", [SSE_ITEM])
        producer = [{"n": 6, "msg": "via producer"}, {"n": 7, "msg": "via producer"}]
        c.eq("json after idempotent producer", j["all"], [*JSON_ITEMS, LP_ITEM, SSE_ITEM, *producer])
        c.eq("json producer error", j.get("producerError"), None)
        c.eq("json resumed from saved offset", j["resumed"], [LP_ITEM, SSE_ITEM, *producer])
        c.eq("json head after close", j["head"],
             {"contentType": "application/json", "offset": j["closeOffset"], "streamClosed": True})
        c.eq("json catch-up of closed stream reports closed", j["readClosed"], True)
        c.eq("json exists after delete", j["existsAfterDelete"], False)

    t = c.scenario("text")
    if t:
        c.eq("text catch-up", t["catchup"], TEXT[0])
        c.live("text long-poll", t["longpoll"], "long-poll", TEXT[1])
        c.live("text sse", t["sse"], "sse", TEXT[2])
        c.eq("text all", t["all"], "".join(TEXT))
        c.eq("text content type", t["contentType"], "text/plain")

    b = c.scenario("bytes")
    if b:
        c.eq("bytes catch-up", b["catchup"], UP)
        c.live("bytes long-poll", b["longpoll"], "long-poll", DOWN)
        c.live("bytes sse (base64)", b["sse"], "sse", UP[:200])
        c.eq("bytes all", b["all"], UP + DOWN + UP[:200])
    c.done()


def test_python_client(base_url: str) -> None:
    result = _run_driver([sys.executable, str(INTEROP / "client_py.py"), base_url, str(time.time_ns())], INTEROP)
    c = Checks(result)

    j = c.scenario("json")
    if j:
        seq = [{"n": 6, "msg": "seq a"}, {"n": 7, "msg": "seq b"}]
        c.eq("json catch-up", j["catchup"], JSON_ITEMS)
        c.live("json long-poll", j["longpoll"], "long-poll", [LP_ITEM])
        c.live("json sse", j["sse"], "sse", [SSE_ITEM])
        c.eq("json Stream-Seq regression", j["seqRegression"], "SeqConflictError")
        c.eq("json all", j["all"], [*JSON_ITEMS, LP_ITEM, SSE_ITEM, *seq])
        c.eq("json resumed from saved offset", j["resumed"], [LP_ITEM, SSE_ITEM, *seq])
        c.eq("json create with another content type", j["createConflict"], "StreamExistsError")
        c.eq("json head", j["head"], {"contentType": "application/json", "offset": j["allOffset"]})
        c.eq("json head after delete", j["afterDelete"], "StreamNotFoundError")

    t = c.scenario("text")
    if t:
        c.eq("text catch-up", t["catchup"], TEXT[0])
        c.live("text long-poll", t["longpoll"], "long-poll", TEXT[1])
        c.live("text sse", t["sse"], "sse", TEXT[2])
        c.eq("text all", t["all"], "".join(TEXT))
        c.eq("text content type", t["contentType"], "text/plain")

    b = c.scenario("bytes")
    if b:
        c.eq("bytes catch-up", b["catchup"], UP)
        c.live("bytes long-poll", b["longpoll"], "long-poll", DOWN)
        c.eq("bytes all", b["all"], UP + DOWN)

    a = c.scenario("async")
    if a:
        c.eq("async catch-up", a["catchup"], [{"n": 1}, {"n": 2}, {"n": 3}])
        c.eq("async sse", a["sse"], [{"n": 4, "msg": "async sse"}])
    c.done()
