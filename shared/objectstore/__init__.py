"""Object stores: where sealed chunks and descriptors live (design §5).

    store = open_store("s3://bucket/prefix", s3_endpoint="http://minio:9000")
    async with store:                    # or: ... finally: await store.close()
        await store.put("chunks/..", data, if_absent=True)

`open_store` only parses and validates the URL (parse_store_url, shared with the
Spark pipeline's synchronous stores); the S3 client is created on first use (or
on `async with`), once per store, and lives until close().
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import DEFAULT_CHUNK_SIZE, MappedRange, ObjectInfo, ObjectStore, StoreCounters, validate_key
from .local import LocalStore
from .url import FileStoreURL, S3StoreURL, StoreURL, StoreURLError, parse_store_url

if TYPE_CHECKING:
    from .s3 import S3Options

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FileStoreURL",
    "LocalStore",
    "MappedRange",
    "ObjectInfo",
    "ObjectStore",
    "S3StoreURL",
    "StoreCounters",
    "StoreURL",
    "StoreURLError",
    "open_store",
    "parse_store_url",
    "validate_key",
]


def open_store(
    url: str,
    *,
    s3_endpoint: str | None = None,
    region: str | None = None,
    s3_options: S3Options | None = None,
) -> ObjectStore:
    """A store named by URL: `s3://bucket[/prefix]` or `file:///absolute/path`.
    Raises StoreURLError (a ConfigError) for anything else; see parse_store_url."""
    parsed = parse_store_url(url)
    if isinstance(parsed, FileStoreURL):
        return LocalStore(parsed.root, url=url)
    from .s3 import S3Store  # imported here: botocore takes a moment to import

    return S3Store(parsed.bucket, parsed.prefix, endpoint=s3_endpoint, region=region, options=s3_options,
                   url=url)
