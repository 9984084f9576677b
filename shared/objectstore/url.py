"""What a store URL means: the one parser behind `open_store` (the async servers) and
`pipeline.store.open_sync_store` (Spark), so the two can never disagree on a URL.

    parse_store_url("s3://bucket/some/prefix")  -> S3StoreURL(bucket="bucket", prefix="some/prefix/")
    parse_store_url("file:///var/lib/ds3/obj")  -> FileStoreURL(root=Path("/var/lib/ds3/obj"))

Parsing is pure (no I/O, no clients, no directories made): callers build their own store
from the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final, Literal
from urllib.parse import unquote, urlsplit

from shared.config import ConfigError

from .base import TEMP_PREFIX, validate_key

# S3's bucket naming rules, simplified: 3-63 of lower-case letters, digits, '.', '-'.
_BUCKET_RE: Final = re.compile(r"\A[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]\Z")
_FORMS: Final = "s3://bucket[/prefix] or file:///absolute/path"


class StoreURLError(ConfigError):
    """A store URL names no object store; the message quotes the URL and the bad part.
    A ConfigError, so the CLI reports it like any other bad setting."""

    def __init__(self, url: str, problem: str) -> None:
        super().__init__(f"object store URL {url!r}: {problem}")
        self.url = url


@dataclass(frozen=True, slots=True)
class S3StoreURL:
    scheme: ClassVar[Literal["s3"]] = "s3"
    url: str  # as given; stores report it back unchanged
    bucket: str
    prefix: str  # "" or "some/prefix/": keys live under it, so it ends in "/"


@dataclass(frozen=True, slots=True)
class FileStoreURL:
    scheme: ClassVar[Literal["file"]] = "file"
    url: str  # as given; stores report it back unchanged
    root: Path  # absolute, never "/"


# Two types rather than one with optional fields: callers narrow with isinstance and then
# have exactly the fields that scheme has (no bucket on a file store, no root on S3).
StoreURL = S3StoreURL | FileStoreURL


def parse_store_url(url: str) -> StoreURL:
    """The store `url` names: `s3://bucket[/prefix]` or `file:///absolute/path`
    (`file://localhost/...` too). Percent-escapes in the path are decoded. Raises
    StoreURLError naming the bad part for anything else."""
    parts = urlsplit(url)
    # Nothing reads a query or fragment, so one is most likely a typo or a pasted
    # presigned URL; refusing it beats silently ignoring it.
    if parts.query:
        raise StoreURLError(url, f"a query ('?{parts.query}') is not allowed")
    if parts.fragment:
        raise StoreURLError(url, f"a fragment ('#{parts.fragment}') is not allowed")
    if parts.scheme == "file":
        return _file(url, parts.netloc, unquote(parts.path))
    if parts.scheme == "s3":
        return _s3(url, parts.netloc, unquote(parts.path))
    got = f"got {parts.scheme + '://'!r}" if parts.scheme else "it has none"
    raise StoreURLError(url, f"the scheme must be s3:// or file:// ({got}); use {_FORMS}")


def _file(url: str, host: str, path: str) -> FileStoreURL:
    if host not in ("", "localhost"):
        raise StoreURLError(url, f"file URLs name a local path (file:///abs/path), not a host ({host!r})")
    if not path.startswith("/"):
        raise StoreURLError(url, f"the directory must be an absolute path (file:///abs/path), not {path!r}")
    if path.rstrip("/") == "":
        raise StoreURLError(url, "the directory must not be / itself")
    return FileStoreURL(url, Path(path))


def _s3(url: str, bucket: str, path: str) -> S3StoreURL:
    if not bucket:
        raise StoreURLError(url, "the bucket name is missing (s3://bucket[/prefix])")
    if not _BUCKET_RE.match(bucket):
        raise StoreURLError(url, f"{bucket!r} is not a valid bucket name (3-63 lower-case letters, "
                                 "digits, '.' and '-', starting and ending with a letter or digit)")
    prefix = path.strip("/")
    if prefix:
        # The prefix is glued in front of every key, so it must obey the key rules too:
        # otherwise a "a/../b" prefix would mean different objects on S3 and on disk.
        try:
            validate_key(prefix)
        except ValueError:
            raise StoreURLError(url, f"the key prefix {prefix!r} is invalid (no empty, '.' or '..' "
                                     f"segments, backslashes, NUL or names starting {TEMP_PREFIX!r})"
                                ) from None
    return S3StoreURL(url, bucket, prefix + "/" if prefix else "")
