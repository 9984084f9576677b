"""Bucket namespacing (extensions §1): identifiers, URLs, and the internal stream path. Pure.

    /v1/buckets/{bucket_id}                    create (PUT), metadata (GET), delete (DELETE)
    /v1/buckets/{bucket_id}/streams            the listing (GET)
    /v1/buckets/{bucket_id}/{stream_id}        every base-protocol stream operation

A bucketed stream is an ordinary stream whose internal path (the key of the WAL's `streams`
database, of descriptors, of fork sources) is

    "\\x00b/" + bucket_id + "/" + stream_id

A plain path (/v1/stream/{path}) never contains NUL (protocol.validate_stream_path), so no
plain path can equal a bucketed one, and a bucket's streams are one contiguous key range of
the `streams` database: listing a bucket is a range scan.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import quote, unquote

from shared import protocol as P
from shared.errors import BadRequest

BUCKETS_PREFIX: Final = "/v1/buckets/"
INTERNAL_PREFIX: Final = "\x00b/"
MAX_KEY_BYTES: Final = 122  # a stream id, and `{bucket_id}/{stream_id}`, are at most this long
RESERVED_STREAM_ID: Final = "streams"  # GET /{bucket_id}/streams is the listing
_BUCKET_RE: Final = re.compile(r"\A[a-z0-9_-]{4,64}\Z")


def validate_bucket_id(bucket_id: str) -> str:
    if not _BUCKET_RE.match(bucket_id):
        raise BadRequest(f"invalid bucket id {bucket_id[:80]!r}: must match ^[a-z0-9_-]{{4,64}}$")
    return bucket_id


def validate_stream_id(bucket_id: str, stream_id: str) -> str:
    """A bucket-local stream id (the reserved `streams` included: callers decide)."""
    if stream_id == "":
        raise BadRequest("stream id is empty")
    try:
        size = len(stream_id.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise BadRequest("stream id is not valid UTF-8") from e
    if "/" in stream_id:
        raise BadRequest("stream id must not contain '/'")
    if "\x00" in stream_id:
        raise BadRequest("stream id must not contain a NUL character")
    if ".." in stream_id:
        raise BadRequest("stream id must not contain '..'")
    if size > MAX_KEY_BYTES:
        raise BadRequest(f"stream id is longer than {MAX_KEY_BYTES} bytes")
    if len(bucket_id) + 1 + size > MAX_KEY_BYTES:
        raise BadRequest(f"{{bucket_id}}/{{stream_id}} is longer than {MAX_KEY_BYTES} bytes")
    return stream_id


def bucket_key_prefix(bucket_id: str) -> str:
    """Every internal path of the bucket's streams starts with this (and nothing else does)."""
    return f"{INTERNAL_PREFIX}{bucket_id}/"


def internal_path(bucket_id: str, stream_id: str) -> str:
    return bucket_key_prefix(bucket_id) + stream_id


def split_internal(path: str) -> tuple[str, str] | None:
    """(bucket_id, stream_id) of a bucketed stream's internal path; None for a plain path."""
    if not path.startswith(INTERNAL_PREFIX):
        return None
    bucket_id, _, stream_id = path[len(INTERNAL_PREFIX) :].partition("/")
    return bucket_id, stream_id


def url_path(path: str) -> str:
    """The public URL path (percent-encoded) of a stream's internal path."""
    parts = split_internal(path)
    if parts is None:
        return P.STREAM_PREFIX + quote(path, safe="/")
    # A stream id "." is percent-encoded too: as a bare path segment every URL parser (yarl,
    # browsers, proxies) drops it, and the URL would name the bucket's empty stream id.
    stream_id = "%2E" if parts[1] == "." else quote(parts[1], safe="")
    return f"{BUCKETS_PREFIX}{parts[0]}/{stream_id}"


def _unquote(text: str, what: str) -> str:
    try:
        return unquote(text, errors="strict")
    except UnicodeDecodeError as e:
        raise BadRequest(f"{what} is not valid UTF-8") from e


def parse_url(raw: str) -> tuple[str, str | None]:
    """(bucket_id, stream_id or None) from a raw URL path under /v1/buckets/, validated
    (the reserved stream id is returned as is). The path is split before it is decoded, so
    an encoded '/' (%2F) stays inside the stream id, and is refused there."""
    if not raw.startswith(BUCKETS_PREFIX):
        raise BadRequest(f"not a bucket URL: it must start with {BUCKETS_PREFIX}")
    bucket_raw, slash, stream_raw = raw[len(BUCKETS_PREFIX) :].partition("/")
    bucket_id = validate_bucket_id(_unquote(bucket_raw, "bucket id"))
    if not slash:
        return bucket_id, None
    return bucket_id, validate_stream_id(bucket_id, _unquote(stream_raw, "stream id"))


def stream_path_from_url(raw: str) -> str:
    """The internal path of the stream a /v1/buckets/{bucket_id}/{stream_id} URL names."""
    bucket_id, stream_id = parse_url(raw)
    if stream_id is None:
        raise BadRequest("a stream URL needs a stream id: /v1/buckets/{bucket_id}/{stream_id}")
    if stream_id == RESERVED_STREAM_ID:
        raise BadRequest(f"stream id {RESERVED_STREAM_ID!r} is reserved for the bucket listing")
    return internal_path(bucket_id, stream_id)


def fork_source_path(value: str, max_path_bytes: int) -> str:
    """The internal path a Stream-Forked-From header names: a stream's URL path, plain or
    bucketed, percent-decoded like a request's (a listing's `url` works as it is). A plain path
    used to be taken as is, so `/v1/stream/a%20b` named no stream (found by QA)."""
    return path_of_stream_url(value, max_path_bytes, "Stream-Forked-From")


def path_of_stream_url(value: str, max_path_bytes: int, what: str) -> str:
    """The internal path of the stream a URL path names (`/v1/stream/...` percent-decoded, or
    `/v1/buckets/{b}/{s}`; a query is ignored); BadRequest naming `what` otherwise."""
    if value.startswith(P.STREAM_PREFIX):
        path = P.decode_stream_url(value.split("?", 1)[0], f"{what}: the stream path")
        return P.validate_stream_path(path, max_path_bytes)
    if value.startswith(BUCKETS_PREFIX):
        return stream_path_from_url(value.split("?", 1)[0])
    raise BadRequest(f"{what} must be a stream path starting with {P.STREAM_PREFIX} or {BUCKETS_PREFIX}")
