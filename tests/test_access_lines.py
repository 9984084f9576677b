"""shared.logs.access_line: an access log line written without a LogRecord is the line the
installed formatter makes of the record (text and JSON), and logging's own path takes over
whenever logging is configured otherwise."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared import logs

ROOT = Path(__file__).resolve().parent.parent

FIELDS = {"request_id": "f1eld5", "method": "POST", "path": "/v1/stream/a", "route": "stream", "status": 204,
          "duration_ms": 1.234, "bytes": 0, "client": "127.0.0.1"}
CASES = [  # (format, service, request id in the context, fields, created)
    ("text", None, None, FIELDS, 1_700_000_000.0),
    ("text", None, "ctx-7", FIELDS, 1_700_000_000.9995),
    ("text", None, None, {**FIELDS, "request_id": None}, 1_700_000_001.123),
    ("json", None, None, FIELDS, 1_700_000_000.0),
    ("json", "reader-1", "ctx-7", FIELDS, 1_700_000_000.9995),
    ("json", "reader-1", None, {**FIELDS, "sub": "alice", "path": "/v1/stream/\\x00odd"}, 1_700_000_001.123),
]


@pytest.mark.parametrize(("fmt", "service", "ctx", "fields", "created"), CASES)
def test_the_line_is_what_the_formatter_makes_of_the_record(
    fmt: str, service: str | None, ctx: str | None, fields: dict[str, Any], created: float
) -> None:
    formatter = logs.JsonFormatter(service) if fmt == "json" else logs.TextFormatter()
    args = (fields["method"], fields["path"], fields["status"], fields["duration_ms"], fields["bytes"])
    record = logging.LogRecord("ds3.access", logging.INFO, __file__, 1, "%s %s %d %.1fms %dB", args, None)
    record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0
    record.fields = fields
    msg = record.getMessage()
    token = logs.set_request_id(ctx)
    try:
        for _ in range(2):  # (the second time from the formatter's cached second)
            assert formatter.access(created, msg, fields) == formatter.format(record)
    finally:
        logs.reset_request_id(token)


CHILD = r"""
import io, logging, sys
from shared import logs
from shared.http.access import log_access
logs.setup("info", sys.argv[1], access_log=True, service="t")
fast = logs.access_line("probe 1", {"request_id": "r0"})
log_access("r1", "POST", "/v1/stream/a", "stream", 204, 0.0012, 0, "127.0.0.1")
other = io.StringIO()
logging.getLogger().addHandler(logging.StreamHandler(other))  # e.g. a test's capture handler
slow = logs.access_line("probe 2", {"request_id": "r2"})
log_access("r3", "GET", "/v1/stream/a", "stream", 200, 0.0021, 5, "127.0.0.1")
logging.getLogger().removeHandler(logging.getLogger().handlers[1])
logging.getLogger("ds3.access").setLevel(logging.WARNING)
off = logs.access_line("probe 3", {"request_id": "r4"})
logging.getLogger().handlers[0].flush()
print(fast, slow, off, other.getvalue().strip())
"""


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_logging_configured_otherwise_gets_the_record(fmt: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, fmt], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    fast, slow, off, other = done.stdout.split(" ", 3)
    assert (fast, slow, off) == ("True", "False", "False")
    assert other.strip() == "GET /v1/stream/a 200 2.1ms 5B"  # the record reached the other handler too
    lines = done.stderr.splitlines()
    assert len(lines) == 3, lines  # probe 1, r1 (fast), r3 (through logging); nothing when the level is off
    if fmt == "json":
        got = [json.loads(line) for line in lines]
        assert [(g["msg"], g.get("request_id")) for g in got] == [
            ("probe 1", "r0"), ("POST /v1/stream/a 204 1.2ms 0B", "r1"), ("GET /v1/stream/a 200 2.1ms 5B", "r3")]
        assert list(got[1]) == list(got[2])  # the same fields in the same order either way
    else:
        assert [line.split(" INFO ds3.access ")[1] for line in lines] == [
            "probe 1 [request_id=r0]", "POST /v1/stream/a 204 1.2ms 0B [request_id=r1]",
            "GET /v1/stream/a 200 2.1ms 5B [request_id=r3]"]
