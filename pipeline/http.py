"""A small blocking Durable Streams client for Spark tasks and jobs (stdlib http.client, one
keep-alive connection per client): catch-up reads of the unsealed tail, appends with
idempotent-producer headers, stream creation, snapshot publication.

Executors are plain Python workers, so no event loop and no aiohttp here."""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from pipeline.rows import Page
from shared import protocol as P

RETRY_STATUSES = frozenset({502, 503, 504})


class HTTPError(RuntimeError):
    def __init__(self, method: str, url: str, status: int, body: bytes) -> None:
        super().__init__(f"{method} {url}: HTTP {status} {body[:300].decode('utf-8', 'replace')}")
        self.status = status
        self.body = body


class Unreachable(ConnectionError):
    """No answer from the server at all (refused, reset, timed out), after the retries."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes


class Client:
    """Requests against one base URL (`http://host:port`, a reader or an ingester)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 60.0, attempts: int = 6) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.base = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.attempts = attempts
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout)
        return self._conn

    def request(self, method: str, target: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> Response:
        """One request (target: path and query below the base URL). Connection errors and
        502/503/504 are retried with backoff; every request this client sends is safe to
        repeat (reads, PUT create, and appends that carry producer headers)."""
        url = self._prefix + target
        delay = 0.1
        for attempt in range(self.attempts):
            try:
                conn = self._connection()
                conn.request(method, url, body=body, headers={**self._auth, **(headers or {})})
                r = conn.getresponse()
                data = r.read()
                resp = Response(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if attempt == self.attempts - 1:
                    raise Unreachable(f"{method} {self.base}{target}: no answer from the server ({e!r})") from e
            else:
                if resp.status not in RETRY_STATUSES or attempt == self.attempts - 1:
                    return resp
                retry_after = resp.headers.get("retry-after", "")
                delay = max(delay, float(retry_after)) if retry_after.isdigit() else delay
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ stream operations
    def tail_offset(self, url_path: str) -> str:
        r = self.request("HEAD", url_path)
        if r.status != 200:
            raise HTTPError("HEAD", self.base + url_path, r.status, r.body)
        return r.headers[P.NEXT_OFFSET.lower()]

    def snapshot_offset(self, url_path: str) -> str | None:
        """The offset of the stream's latest snapshot (extensions §2), None without one."""
        r = self.request("HEAD", url_path)
        if r.status != 200:
            raise HTTPError("HEAD", self.base + url_path, r.status, r.body)
        found = r.headers.get(P.SNAPSHOT_OFFSET.lower())
        return None if found in (None, "", "-1") else found

    def snapshot(self, url_path: str, offset: str) -> bytes:
        """The body of the snapshot published at `offset` (404 once a newer one superseded it)."""
        target = f"{url_path}/snapshot/{quote(offset, safe='')}"
        r = self.request("GET", target)
        if r.status != 200:
            raise HTTPError("GET", self.base + target, r.status, r.body)
        return r.body

    def catch_up(self, url_path: str, offset: str, stop_position: int | None = None,
                 max_pages: int = 1_000_000) -> Iterator[Page]:
        """Catch-up pages from `offset` until Stream-Up-To-Date, or until a page reaches
        `stop_position`."""
        for _ in range(max_pages):
            target = f"{url_path}?offset={quote(offset, safe='')}"
            r = self.request("GET", target)
            if r.status != 200:
                raise HTTPError("GET", self.base + target, r.status, r.body)
            nxt = r.headers[P.NEXT_OFFSET.lower()]
            if r.body or nxt != offset:
                yield Page(offset, nxt, r.body)
            if r.headers.get(P.UP_TO_DATE.lower(), "").lower() == "true":
                return
            if stop_position is not None and int(nxt.split("_")[1]) >= stop_position:
                return
            if nxt == offset:
                raise HTTPError("GET", self.base + target, r.status, b"no progress and not up to date")
            offset = nxt
        raise HTTPError("GET", self.base + url_path, 0, b"catch-up read did not reach the tail")

    def create(self, url_path: str, content_type: str) -> None:
        r = self.request("PUT", url_path, headers={"Content-Type": content_type})
        if r.status not in (200, 201, 204):
            raise HTTPError("PUT", self.base + url_path, r.status, r.body)

    def append(self, url_path: str, body: bytes, content_type: str,
               producer: tuple[str, int, int] | None = None) -> Response:
        headers = {"Content-Type": content_type}
        if producer is not None:
            pid, epoch, seq = producer
            headers |= {P.PRODUCER_ID: pid, P.PRODUCER_EPOCH: str(epoch), P.PRODUCER_SEQ: str(seq)}
        return self.request("POST", url_path, body=body, headers=headers)

