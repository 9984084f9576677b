"""Endpoints under a stream URL (extensions §2-3), and the bootstrap's multipart framing.

    {stream_url}/snapshot             GET: 307 to the latest snapshot
    {stream_url}/snapshot/{offset}    PUT publish, GET read, DELETE
    {stream_url}/bootstrap            GET: the snapshot and every retained message after it

On the plain surface a stream path may hold '/', so a path whose last segments read like
these names the endpoint, never a stream: such stream names are reserved.

The bootstrap body (RFC 2046 §5.1.1), as written here:

    --B CRLF Content-Type: t CRLF CRLF <snapshot bytes>         the first part
    CRLF --B CRLF Content-Type: t CRLF CRLF <message bytes>     one per retained message
    CRLF --B-- CRLF                                             the end

The CRLF before each delimiter belongs to the delimiter, so part bodies are the stored
bytes, unchanged. B is 'ds3-' and 32 random hex digits: parts are streamed, so the boundary
cannot be checked against them in advance; 128 random bits make a collision unrealistic.

Pure module: no aiohttp, lmdb or object store.
"""

from __future__ import annotations

import secrets
from typing import Final, NamedTuple
from urllib.parse import unquote

from shared import offsets
from shared.buckets import BUCKETS_PREFIX
from shared.errors import BadRequest
from shared.protocol import STREAM_PREFIX

SNAPSHOT: Final = "snapshot"
BOOTSTRAP: Final = "bootstrap"
MULTIPART_PREFIX: Final = "multipart/mixed; boundary="
EMPTY_SNAPSHOT_TYPE: Final = "application/octet-stream"
# A snapshot's Content-Type is kept with its object (S3: a request header, 8 KiB with the rest;
# the local store: an extended attribute, a few KiB on ext4), so it is capped well below both.
MAX_SNAPSHOT_CONTENT_TYPE: Final = 1024



class Endpoint(NamedTuple):
    kind: str  # SNAPSHOT or BOOTSTRAP
    offset: str | None  # the {snapshot_offset} segment, percent-decoded (snapshot only)


def split(raw_path: str) -> tuple[str, Endpoint | None]:
    """(the stream's raw URL path, the extension endpoint or None) for a raw request path."""
    stream, slash, last = raw_path.rpartition("/")
    if not slash:
        return raw_path, None
    if last in (BOOTSTRAP, SNAPSHOT) and _names_stream(stream):
        return stream, Endpoint(last, None)
    parent, slash, segment = stream.rpartition("/")
    if slash and segment == SNAPSHOT and _names_stream(parent):
        try:
            return parent, Endpoint(SNAPSHOT, unquote(last, errors="strict"))
        except UnicodeDecodeError as e:
            raise BadRequest("snapshot offset is not valid UTF-8") from e
    return raw_path, None


def _names_stream(raw: str) -> bool:
    """Whether `raw` can be a stream's URL path: /v1/stream/{path} or /v1/buckets/{b}/{s}."""
    if raw.startswith(STREAM_PREFIX):
        return len(raw) > len(STREAM_PREFIX)
    if raw.startswith(BUCKETS_PREFIX):
        bucket, slash, stream = raw[len(BUCKETS_PREFIX) :].partition("/")
        return bool(bucket) and bool(slash) and bool(stream) and "/" not in stream
    return False


def snapshot_offset(text: str | None) -> offsets.Offset:
    """The {snapshot_offset} of a snapshot URL: a concrete offset (not -1 or now)."""
    if text is None:
        raise BadRequest("a snapshot URL needs an offset: {stream_url}/snapshot/{offset}")
    if text in ("-1", "now"):  # (offsets.parse's own message would offer them)
        raise BadRequest(f"invalid snapshot offset {text!r}: a snapshot names the concrete offset it covers up "
                         "to (16 digits '_' 16 digits, a Stream-Next-Offset), not -1 or now")
    try:
        return offsets.parse(text)
    except offsets.OffsetSyntaxError as e:
        raise BadRequest(f"invalid snapshot offset: {e}") from e


# --- multipart/mixed ----------------------------------------------------------------------


def new_boundary() -> str:
    return "ds3-" + secrets.token_hex(16)


def content_type(boundary: str) -> str:
    return MULTIPART_PREFIX + boundary


def first_part_head(boundary: str, part_type: str) -> bytes:
    return f"--{boundary}\r\nContent-Type: {part_type}\r\n\r\n".encode("latin-1")


def part_head(boundary: str, part_type: str) -> bytes:
    """The delimiter and headers that start every part after the first."""
    return b"\r\n" + first_part_head(boundary, part_type)


def closing(boundary: str) -> bytes:
    return f"\r\n--{boundary}--\r\n".encode("latin-1")


def part_body(stored: bytes, json_mode: bool) -> bytes:
    """A stored message as a bootstrap part: JSON messages lose their stored ',' delimiter
    (shared/jsonmode.py); other bytes go unchanged."""
    return stored[:-1] if json_mode and stored.endswith(b",") else stored


def valid_boundary(text: str) -> bool:
    """A boundary this server generated (the reader passes its own to the ingester)."""
    return len(text) == 36 and text.startswith("ds3-") and all(c in "0123456789abcdef" for c in text[4:])
