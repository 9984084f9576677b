"""Durable Streams protocol rules shared by the ingester and the reader: header names,
header and path validation, content types, cursors. Pure: no aiohttp, no lmdb."""

from __future__ import annotations

import functools
import random
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final
from urllib.parse import unquote

from shared.errors import BadRequest

STREAM_PREFIX: Final = "/v1/stream/"

# Header names (HTTP headers are case-insensitive; these are the canonical spellings).
NEXT_OFFSET: Final = "Stream-Next-Offset"
UP_TO_DATE: Final = "Stream-Up-To-Date"
SNAPSHOT_OFFSET: Final = "Stream-Snapshot-Offset"  # extensions §2.4
CLOSED: Final = "Stream-Closed"
CURSOR: Final = "Stream-Cursor"
TTL: Final = "Stream-TTL"
EXPIRES_AT: Final = "Stream-Expires-At"
SEQ: Final = "Stream-Seq"
SSE_ENCODING: Final = "Stream-SSE-Data-Encoding"
FORKED_FROM: Final = "Stream-Forked-From"
FORK_OFFSET: Final = "Stream-Fork-Offset"
FORK_SUB_OFFSET: Final = "Stream-Fork-Sub-Offset"
PRODUCER_ID: Final = "Producer-Id"
PRODUCER_EPOCH: Final = "Producer-Epoch"
PRODUCER_SEQ: Final = "Producer-Seq"
PRODUCER_EXPECTED_SEQ: Final = "Producer-Expected-Seq"
PRODUCER_RECEIVED_SEQ: Final = "Producer-Received-Seq"

DEFAULT_CONTENT_TYPE: Final = "application/octet-stream"
MAX_SAFE_INTEGER: Final = 2**53 - 1
MAX_TTL_SECONDS: Final = 100 * 365 * 24 * 3600

CORS_ALLOW_HEADERS: Final = ", ".join(
    [
        "Content-Type", "Authorization", "If-None-Match", "Last-Event-ID", "Cache-Control", "X-Request-Id",
        SEQ, TTL, EXPIRES_AT, CLOSED, PRODUCER_ID, PRODUCER_EPOCH, PRODUCER_SEQ,
        FORKED_FROM, FORK_OFFSET, FORK_SUB_OFFSET,
    ]
)
# Every answer but the console's pages: a stream's bytes are untrusted content (spec 10.3), and
# a browser opening one as a page runs it sandboxed, without script, in an origin of its own.
UNTRUSTED_CONTENT_CSP: Final = "default-src 'none'; sandbox"
CORS_EXPOSE_HEADERS: Final = ", ".join(
    [
        NEXT_OFFSET, CURSOR, UP_TO_DATE, CLOSED, TTL, EXPIRES_AT, SSE_ENCODING, SNAPSHOT_OFFSET,
        PRODUCER_EPOCH, PRODUCER_SEQ, PRODUCER_EXPECTED_SEQ, PRODUCER_RECEIVED_SEQ,
        "ETag", "Content-Type", "Content-Encoding", "Vary", "Location", "Retry-After", "WWW-Authenticate",
        "X-Request-Id",
    ]
)
CORS_ALLOW_METHODS: Final = "GET, POST, PUT, DELETE, HEAD, OPTIONS"
# Request headers that carry one value: sent twice, which one counts would be a guess (400).
SINGLE_VALUE_HEADERS: Final = (
    SEQ, TTL, EXPIRES_AT, CLOSED, PRODUCER_ID, PRODUCER_EPOCH, PRODUCER_SEQ, FORKED_FROM, FORK_OFFSET, FORK_SUB_OFFSET,
)

DECIMAL_RE: Final = re.compile(r"\A(0|[1-9][0-9]*)\Z")
_DIGITS_RE: Final = re.compile(r"\A[0-9]+\Z")
# Segments of visible characters, none of them "." or "..", no empty segment.
# (lone surrogates excluded: they are header bytes that were not UTF-8, see is_utf8)
_SEGMENT: Final = r"(?!\.\.?(?:/|\Z))[^\x00-\x1f\x7f/\ud800-\udfff]+"
_PATH_OK_RE: Final = re.compile(rf"\A{_SEGMENT}(?:/{_SEGMENT})*\Z")
_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")
_HEADER_TEXT_RE: Final = re.compile(r"\A[\t\x20-\x7e]*\Z")
_MEDIA_TYPE_RE: Final = re.compile(r"\A[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+\Z")
_RFC3339_RE: Final = re.compile(
    r"\A\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-](?:[01]\d|2[0-3]):[0-5]\d)\Z", re.ASCII
)


# --- paths -------------------------------------------------------------------------------


def decode_stream_url(raw: str, what: str = "stream path") -> str:
    """The stream path a plain stream URL path (`/v1/stream/...`, no query) names, percent-
    decoded (requests and Stream-Forked-From alike); BadRequest naming `what` if that is not
    UTF-8."""
    try:
        return unquote(raw[len(STREAM_PREFIX) :], errors="strict")
    except UnicodeDecodeError as e:
        raise BadRequest(f"{what} is not valid UTF-8") from e


def validate_stream_path(path: str, max_bytes: int) -> str:
    """Check the part of the URL after /v1/stream/ and return it unchanged."""
    if not path:
        raise BadRequest("stream path is empty")
    if len(path.encode("utf-8", "surrogatepass")) > max_bytes:
        raise BadRequest(f"stream path is longer than {max_bytes} bytes")
    if _PATH_OK_RE.match(path):  # the common case, checked in one pass
        return path
    for segment in path.split("/"):
        if segment == "":
            raise BadRequest("stream path has an empty segment")
        if segment in (".", ".."):
            raise BadRequest("stream path segments '.' and '..' are not allowed")
    if "\x00" in path:
        raise BadRequest("stream path contains a NUL character")
    if _CONTROL_RE.search(path):
        raise BadRequest("stream path contains a control character")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest("stream path is not valid UTF-8") from e
    return path


# --- content types -----------------------------------------------------------------------


# Content types are few and every append compares or checks one: remember the answers (bounded,
# since clients choose the strings).
@functools.lru_cache(maxsize=256)
def etag_matches(if_none_match: str | None, etag: str | None) -> bool:
    """Whether an If-None-Match header matches `etag` (RFC 9110 13.1.2: the weak comparison,
    so `W/"x"` matches `"x"`; `*` matches any current representation)."""
    if if_none_match is None or not etag:
        return False
    want = etag.removeprefix("W/")
    for tag in if_none_match.split(","):
        tag = tag.strip()
        if tag == "*" or tag.removeprefix("W/") == want:
            return True
    return False


def media_type(content_type: str | None) -> str:
    """`Application/JSON; charset=utf-8` -> `application/json` (for comparisons only)."""
    if not content_type:
        return ""
    return content_type.split(";", 1)[0].strip().lower()


@functools.lru_cache(maxsize=256)
def is_valid_content_type(content_type: str) -> bool:
    # the whole value is stored and echoed: printable ASCII only, parameters included
    return bool(_MEDIA_TYPE_RE.match(media_type(content_type))) and bool(_HEADER_TEXT_RE.match(content_type))


def is_utf8(text: str) -> bool:
    """aiohttp decodes header bytes that are not UTF-8 to lone surrogates; those cannot be stored."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_json(content_type: str | None) -> bool:
    return media_type(content_type) == "application/json"


def is_text_for_sse(content_type: str | None) -> bool:
    mt = media_type(content_type)
    return mt.startswith("text/") or mt == "application/json"


# --- headers -----------------------------------------------------------------------------


def flag_true(value: str | None) -> bool:
    """Stream-Closed: present only when exactly `true` (case-insensitive); else ignored."""
    return value is not None and value.strip().lower() == "true"


def parse_ttl(value: str) -> int:
    if not DECIMAL_RE.match(value):
        raise BadRequest(
            "invalid Stream-TTL: must be a non-negative decimal integer without sign, "
            "leading zeros, decimal point or exponent"
        )
    # (the length is compared before int(): 4300+ digits raise; a long one is simply too large)
    if len(value) > len(str(MAX_TTL_SECONDS)) or int(value) > MAX_TTL_SECONDS:
        raise BadRequest(f"invalid Stream-TTL: at most {MAX_TTL_SECONDS} seconds")
    return int(value)


def parse_expires_at(value: str) -> float:
    """RFC 3339 timestamp -> epoch seconds."""
    if not _RFC3339_RE.match(value.strip()):
        raise BadRequest("invalid Stream-Expires-At: must be an RFC 3339 timestamp")
    text = value.strip().replace("z", "Z").replace("t", "T")
    try:
        dt = datetime.fromisoformat(text)
    except ValueError as e:
        raise BadRequest(f"invalid Stream-Expires-At: {e}") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def format_rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_safe_int(name: str, value: str) -> int:
    if not _DIGITS_RE.match(value):
        raise BadRequest(f"invalid {name}: must be a non-negative integer")
    if len(value.lstrip("0")) > 16:  # 2^53-1 has 16 digits; int() of 4300+ digits raises ValueError
        raise BadRequest(f"invalid {name}: must be at most 2^53-1")
    n = int(value)
    if n > MAX_SAFE_INTEGER:
        raise BadRequest(f"invalid {name}: must be at most 2^53-1")
    return n


@dataclass(frozen=True, slots=True)
class ProducerHeaders:
    producer_id: str
    epoch: int
    seq: int


def parse_producer(pid: str | None, epoch: str | None, seq: str | None) -> ProducerHeaders | None:
    given = [v is not None for v in (pid, epoch, seq)]
    if not any(given):
        return None
    if not all(given):
        raise BadRequest("Producer-Id, Producer-Epoch and Producer-Seq must be sent together")
    assert pid is not None and epoch is not None and seq is not None
    if pid == "":
        raise BadRequest("invalid Producer-Id: must not be empty")
    if not is_utf8(pid):
        raise BadRequest("invalid Producer-Id: not valid UTF-8")
    if len(pid.encode()) > 256:
        raise BadRequest("invalid Producer-Id: at most 256 bytes")
    return ProducerHeaders(pid, parse_safe_int("Producer-Epoch", epoch), parse_safe_int("Producer-Seq", seq))


# --- cursors (protocol §8.1) ---------------------------------------------------------------

CURSOR_EPOCH: Final = datetime(2024, 10, 9, tzinfo=UTC).timestamp()
CURSOR_INTERVAL_S: Final = 20


# Longer cursors are answered without int() (Python refuses over 4300 digits; a request line
# may hold 8 KiB of them): see response_cursor.
_CURSOR_MAX_DIGITS: Final = 1000


def response_cursor(client_cursor: str | None, now: float | None = None) -> str:
    """Interval number since the cursor epoch; never at or behind the client's cursor (§8.1: a
    cursor at or ahead of the current interval MUST be answered with a strictly greater one,
    whatever its size: a 20-digit one used to get the current interval back)."""
    now = time.time() if now is None else now
    current = int((now - CURSOR_EPOCH) // CURSOR_INTERVAL_S)
    if client_cursor is None or not _DIGITS_RE.match(client_cursor):
        return str(current)
    digits = client_cursor.lstrip("0") or "0"
    if len(digits) > _CURSOR_MAX_DIGITS:
        return "1" + "0" * len(digits)  # 10^len: greater than any number of len digits
    theirs = int(digits)
    if theirs < current:
        return str(current)
    jitter_s = random.randint(1, 3600)
    return str(theirs + max(1, -(-jitter_s // CURSOR_INTERVAL_S)))


def tail_cache_control(max_age: int) -> str:
    """Cache-Control of an answer that says "nothing more yet" (an empty page at the tail, a
    long-poll's 204): shared caches may keep it `max_age` seconds (--tail-max-age) so a crowd
    at the tail costs the origin one request per that long; 0: never stored."""
    return f"public, max-age={max_age}" if max_age > 0 else "no-store"
