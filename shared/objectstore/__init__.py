"""Object stores: where sealed chunks and descriptors live (design §5).

    store = open_store("s3://bucket/prefix", s3_endpoint="http://minio:9000")
    async with store:                    # or: ... finally: await store.close()
        await store.put("chunks/..", data, if_absent=True)

`open_store` only parses and validates the URL; the S3 client is created on first use (or
on `async with`), once per store, and lives until close().
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote, urlsplit

from shared.config import ConfigError

from .base import DEFAULT_CHUNK_SIZE, ObjectInfo, ObjectStore, StoreCounters, validate_key
from .local import LocalStore

if TYPE_CHECKING:
    from .s3 import S3Options

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "LocalStore",
    "ObjectInfo",
    "ObjectStore",
    "StoreCounters",
    "open_store",
    "validate_key",
]

# S3's bucket naming rules, simplified: 3-63 of lower-case letters, digits, '.', '-'.
_BUCKET_RE: Final = re.compile(r"\A[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]\Z")


def open_store(
    url: str,
    *,
    s3_endpoint: str | None = None,
    region: str | None = None,
    s3_options: S3Options | None = None,
) -> ObjectStore:
    """A store named by URL: `s3://bucket[/prefix]` or `file:///absolute/path`.
    Raises ConfigError for anything else."""
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ConfigError(f"object store URL {url!r}: no query or fragment allowed")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"object store URL {url!r}: file URLs name a local path (file:///abs/path)")
        path = unquote(parts.path)
        if not path.startswith("/") or path.rstrip("/") == "":
            raise ConfigError(f"object store URL {url!r}: needs an absolute directory other than /")
        return LocalStore(Path(path), url=url)
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET_RE.match(bucket):
            raise ConfigError(f"object store URL {url!r}: {bucket!r} is not a valid bucket name")
        prefix = unquote(parts.path).strip("/")
        if prefix:
            try:
                validate_key(prefix)
            except ValueError:
                raise ConfigError(f"object store URL {url!r}: invalid key prefix {prefix!r}") from None
        from .s3 import S3Store  # imported here: botocore takes a moment to import

        return S3Store(bucket, prefix, endpoint=s3_endpoint, region=region, options=s3_options, url=url)
    raise ConfigError(f"object store URL {url!r}: the scheme must be s3:// or file://")
