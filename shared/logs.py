"""Logging for every ds3 command: text (for people) or JSON, one object per line (for log
pipelines), and the request id of the request being handled.

    {"ts": "2025-01-01T12:00:00.123Z", "level": "info", "logger": "ds3.access",
     "msg": "POST /v1/stream/a 204 1.9ms 0B", "request_id": "5f0c...", "method": "POST", ...}

The request id lives in a context variable set by shared.http.access for the duration of a
request, so every record logged while handling it (by any module) carries it, and tasks a
request starts (an SSE upstream subscription) inherit it."""

from __future__ import annotations

import contextvars
import logging
import random
import re
import sys
import threading
import time
from typing import Any, Final

import orjson

FORMATS: Final = ("text", "json")
ACCESS_LOGGER: Final = "ds3.access"  # one line per request (shared/http/access.py)
REQUEST_ID_HEADER: Final = "X-Request-Id"
# An incoming id is kept only when it is short and plain: it is logged and forwarded, so it
# must not be able to carry log injection (newlines, quotes) or bloat every line.
_SANE_ID: Final = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("ds3_request_id", default=None)


def request_id() -> str | None:
    """The id of the request this code runs for, if any."""
    return _request_id.get()


def set_request_id(value: str | None) -> contextvars.Token[str | None]:
    return _request_id.set(value)


def reset_request_id(token: contextvars.Token[str | None]) -> None:
    _request_id.reset(token)


def accept_request_id(incoming: str | None) -> str:
    """The caller's X-Request-Id when it is sane, else a new random one (64 bits, hex)."""
    if incoming is not None and _SANE_ID.fullmatch(incoming):
        return incoming
    # Not secret, only distinct: the PRNG costs ~0.2 us where os.urandom costs ~15 us here.
    return f"{random.getrandbits(64):016x}"


def printable(text: str, limit: int = 512) -> str:
    """`text` cut to `limit` characters with control characters escaped: paths and other
    request-supplied strings must not forge log lines."""
    text = text[:limit]
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, service (which process: `ds3 dev` writes both
    to one stream), ingester_id (a cluster member's), logger, msg, request_id (when handling one), the fields passed as
    `extra={"fields": {...}}` (the access log's), and exc (the traceback) when there is one."""

    def __init__(self, service: str | None = None, ingester_id: str | None = None) -> None:
        super().__init__()
        self.service = service
        self._ids = {"ingester_id": ingester_id} if ingester_id else {}  # a cluster member's
        self._second = -1
        self._stamp = ""

    def _ts(self, created: float) -> str:
        second = int(created)
        if second != self._second:  # strftime once a second: the access log is hot
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self._ts(record.created),
            "level": record.levelname.lower(),
            **({"service": self.service} if self.service else {}),
            **self._ids,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = _request_id.get()
        if rid is not None:
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return orjson.dumps(out, default=str).decode()

    def access(self, created: float, msg: str, fields: dict[str, Any]) -> str:
        """format() of an access record (logger ds3.access, INFO, fields that name the
        request id) without the record."""
        out: dict[str, Any] = {"ts": self._ts(created), "level": "info"}
        if self.service:
            out["service"] = self.service
        out.update(self._ids)
        out["logger"] = ACCESS_LOGGER
        out["msg"] = msg
        rid = _request_id.get()
        if rid is not None:
            out["request_id"] = rid
        out.update(fields)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """The classic line, with the request id appended when there is one."""

    def __init__(self, tag: str | None = None) -> None:
        # tag: which of several like processes wrote the line (a cluster member's id: ds3 dev
        # runs several ingesters into one terminal)
        super().__init__(f"%(asctime)s %(levelname)s {'[' + tag + '] ' if tag else ''}%(name)s %(message)s")
        self._second = -1
        self._stamp = ""

    def formatMessage(self, record: logging.LogRecord) -> str:  # before any traceback
        line = super().formatMessage(record)
        rid = _request_id.get()
        if rid is None:  # a line logged off the request's context names it in its fields (the fast lanes)
            fields = getattr(record, "fields", None)
            rid = fields.get("request_id") if isinstance(fields, dict) else None
        return line if rid is None else f"{line} [request_id={rid}]"

    def access(self, created: float, msg: str, fields: dict[str, Any]) -> str:
        """format() of an access record (logger ds3.access, INFO) without the record: the
        default asctime (local time, milliseconds as LogRecord computes them), the time
        formatted once a second."""
        second = int(created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", self.converter(created))
        rid = _request_id.get()
        if rid is None:
            rid = fields.get("request_id")
        line = f"{self._stamp},{int((created - second) * 1000):03d} INFO {ACCESS_LOGGER} {msg}"
        return line if rid is None else f"{line} [request_id={rid}]"


class BatchingStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler that writes access log lines (logger `batched`) in batches: at most
    FLUSH_SECONDS late, or when FLUSH_BYTES are waiting; every other line is written at once
    (with those waiting before it, in order). An access log line per request written on its
    own costs a write system call each (about half of a line's 10-20 us, more into a pipe); a
    process killed outright loses at most FLUSH_SECONDS of access lines."""

    FLUSH_SECONDS = 0.2
    FLUSH_BYTES = 64 * 1024

    def __init__(self, stream: Any, batched: str = ACCESS_LOGGER) -> None:
        super().__init__(stream)
        self.batched = batched
        self._pending: list[str] = []
        self._pending_bytes = 0
        self._flusher = threading.Thread(target=self._flush_periodically, name="ds3-log-flush", daemon=True)
        self._flusher.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        with self.lock:  # type: ignore[union-attr]
            self._pending.append(line)
            self._pending_bytes += len(line)
            urgent = (record.name != self.batched or record.levelno >= logging.WARNING
                      or self._pending_bytes >= self.FLUSH_BYTES)
        if urgent:
            self.flush()

    def write_access(self, line: str) -> None:
        """An access line already formatted (access_line): batched like the records of `batched`."""
        with self.lock:  # type: ignore[union-attr]
            self._pending.append(line + self.terminator)
            self._pending_bytes += len(line) + 1
            urgent = self._pending_bytes >= self.FLUSH_BYTES
        if urgent:
            self.flush()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            if self._pending:
                lines, self._pending, self._pending_bytes = self._pending, [], 0
                try:
                    self.stream.write("".join(lines))
                except Exception:  # a closed or broken stderr: nothing else to tell it to
                    return
            if self.stream and hasattr(self.stream, "flush"):
                try:
                    self.stream.flush()
                except Exception:
                    return

    def _flush_periodically(self) -> None:
        while True:
            time.sleep(self.FLUSH_SECONDS)
            if self._pending:
                self.flush()


def setup(level: str, fmt: str = "text", *, access_log: bool = True, service: str | None = None,
          ingester_id: str | None = None) -> None:
    """Configure the root logger for a ds3 process (stderr, in batches: BatchingStreamHandler).
    `access_log=False` silences ds3.access (one line per request) whatever the level."""
    # Neither format names the caller, thread or process: skip looking them up for every record
    # (the logging docs' "Optimization"; findCaller alone was ~5 us of a ~9 us access log line).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    global _installed
    handler = BatchingStreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service, ingester_id) if fmt == "json" else TextFormatter(ingester_id))
    _installed = handler
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)  # Python warnings become records too: no stray non-JSON lines
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # ds3.access logs requests
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET if access_log else logging.WARNING)


_installed: BatchingStreamHandler | None = None  # setup()'s handler
_access = logging.getLogger(ACCESS_LOGGER)


def access_line(msg: str, fields: dict[str, Any]) -> bool:
    """Write an INFO line of ds3.access straight to the handler setup() installed, as its
    formatter formats the record, without making one: a line per request costs ~1.5 us instead
    of logging's ~6 (LogRecord, handler chain, Formatter; 13% of a reader's CPU when forwarding
    appends). False when logging is not as setup() left it (another handler, a filter, the
    level): the caller then logs the record as usual."""
    h = _installed
    if h is None:
        return False
    root = logging.root
    handlers = root.handlers
    if (len(handlers) != 1 or handlers[0] is not h or h.filters or root.filters or _access.handlers
            or _access.filters or not _access.propagate or _access.disabled or h.level > logging.INFO
            or not _access.isEnabledFor(logging.INFO)):
        return False
    fmt = h.formatter
    if not isinstance(fmt, JsonFormatter | TextFormatter):
        return False
    h.write_access(fmt.access(time.time(), msg, fields))
    return True


class RepeatedWarnings:
    """Warnings that repeat per request in a known state (a standby's or a fenced ingester's
    503s, a reader whose ingester is down: one per request, hundreds a second) logged once per
    `interval` seconds per kind; the next line of a kind counts the ones left out meanwhile.
    The per-request 503s stay countable in metrics and the access log."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when last logged, left out since)

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        at, left_out = self._last.get(kind, (-self.interval, 0))
        if now - at < self.interval:
            self._last[kind] = (at, left_out + 1)
            return
        if len(self._last) >= 1024:  # (kinds are a handful; never grow without bound)
            self._last.clear()
        self._last[kind] = (now, 0)
        if left_out:
            self.logger.warning(msg + " (and %d more like it in the last %.0f s, not logged)", *args, left_out,
                                now - at)
        else:
            self.logger.warning(msg, *args)
