"""Synchronous object-store access for Spark: the driver plans with it, executors read chunks.

The servers use `shared.objectstore` (aiobotocore on an event loop); Spark tasks are plain
threads in Python workers, where an event loop per task would only add cost and risk. So the
pipeline has its own small, blocking readers over the same key layout:

    store = open_sync_store("s3://bucket/prefix", endpoint_url="http://minio:9000")
    store = open_sync_store("file:///var/lib/ds3/objects")
    store.get(key, start, end); store.list(prefix)

Errors are the servers' (shared.errors): ObjectNotFound for a missing key, ObjectStoreError
(ObjectStoreUnavailable for an unreachable endpoint or a 5xx) naming the problem, never a
botocore exception: `ds3 pipeline` prints them as one line. `check_store` asks the store once,
with few retries, so that a wrong endpoint, bucket or credentials fail a job in seconds rather
than after the clients' retries (about a minute for an endpoint nobody listens on).

A store is picklable (only its settings travel; the boto3 client is created on first use in
each process), so it can ride inside Spark input partitions.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shared.errors import ObjectNotFound, ObjectStoreError, ObjectStoreUnavailable
from shared.objectstore.base import TEMP_PREFIX, check_range
from shared.objectstore.url import FileStoreURL, StoreURLError, parse_store_url

# URLs are parsed by the servers' own parser, so a URL means the same store here as in
# `ds3 ingester --store`. StoreURLError is re-exported: pipeline.options catches it.
__all__ = ["Listed", "LocalSyncStore", "S3SyncStore", "StoreURLError", "SyncStore", "check_store", "open_sync_store"]


@dataclass(frozen=True, slots=True)
class Listed:
    key: str  # relative to the store URL
    size: int


class SyncStore(Protocol):
    url: str

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes [start, end) (end exclusive; None: to the end). ObjectNotFound;
        ValueError for a range with start > end or a negative bound."""

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[Listed]:
        """Every object under `prefix`, in key order, after `start_after` when given."""


@dataclass
class LocalSyncStore:
    """A `file://` store: one plain file per key under root (see shared.objectstore.local)."""

    url: str
    root: Path

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        lo, hi = check_range(start, end)  # (start > end read to the end of the file)
        try:
            with open(self.root / key, "rb") as f:
                f.seek(lo)
                return f.read() if hi is None else f.read(hi - lo)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None

    def locate(self, key: str, expires: int) -> str:
        """Where another process reads `key` from: a file:// URL (`expires` does not apply)."""
        return (self.root / key).resolve().as_uri()

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[Listed]:
        found: list[Listed] = []
        base, _, name_prefix = prefix.rpartition("/")
        top = self.root / base if base else self.root
        if not top.is_dir():
            return iter(())
        for dirpath, dirs, files in os.walk(top):
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            if dirpath == str(top) and name_prefix:
                dirs[:] = [d for d in dirs if d.startswith(name_prefix)]
            for f in files:
                key = rel_dir + f
                if f.startswith(TEMP_PREFIX) or not key.startswith(prefix):
                    continue
                if start_after is not None and key <= start_after:
                    continue
                try:
                    found.append(Listed(key, os.path.getsize(os.path.join(dirpath, f))))
                except FileNotFoundError:
                    continue  # deleted while we looked
        found.sort(key=lambda o: o.key)
        return iter(found)


_CLIENTS: dict[tuple[str | None, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _new_client(endpoint: str | None, region: str | None, access_key_id: str | None,
                secret_access_key: str | None, session_token: str | None, *, probe: bool = False) -> Any:
    import boto3  # type: ignore[import-untyped]
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"} if endpoint else {},
        retries={"max_attempts": 2, "mode": "standard"} if probe else {"max_attempts": 8, "mode": "adaptive"},
        max_pool_connections=32,
        connect_timeout=5 if probe else 60,  # (botocore's default: 60)
        read_timeout=20 if probe else 60,
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=region, config=config, aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key, aws_session_token=session_token,
    )


@dataclass
class S3SyncStore:
    """An `s3://bucket/prefix` store through boto3. Path-style addressing with a custom
    endpoint (MinIO, moto), as the servers do."""

    url: str
    bucket: str
    prefix: str  # "" or "some/prefix/"
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    _client: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in self.__dataclass_fields__}
        state["_client"] = None  # clients do not pickle; each process makes its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def _settings(self) -> tuple[str | None, ...]:
        endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return (endpoint, self.region, self.access_key_id, self.secret_access_key, self.session_token)

    def client(self) -> Any:
        if self._client is None:
            key = self._settings()
            with _CLIENTS_LOCK:  # one client per process and settings: each unpickled store would
                client = _CLIENTS.get(key)  # otherwise build its own (about 90 ms: a session loads
                if client is None:  # the S3 service model), once per Spark partition
                    client = _CLIENTS[key] = _new_client(*key)
            self._client = client
        return self._client

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        lo, hi = check_range(start, end)
        if hi == lo:  # no byte asked for ("bytes=5-4" is no range: S3 would send the whole object)
            return b""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self.prefix + key}
        if start is not None or end is not None:
            kw["Range"] = f"bytes={lo}-{'' if hi is None else hi - 1}"
        try:
            obj = self.client().get_object(**kw)
            return bytes(obj["Body"].read())
        except Exception as e:
            converted = self._error(key, e)
            if converted is e:
                raise
            raise converted from e

    def locate(self, key: str, expires: int) -> str:
        """Where another process reads `key` from without credentials: a presigned GET URL,
        valid for `expires` seconds."""
        return str(self.client().generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self.prefix + key}, ExpiresIn=expires))

    def list(self, prefix: str, start_after: str | None = None) -> Iterator[Listed]:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        if start_after is not None:
            kw["StartAfter"] = self.prefix + start_after
        strip = len(self.prefix)
        pages = iter(self.client().get_paginator("list_objects_v2").paginate(**kw))
        while True:
            try:
                page = next(pages, None)
            except Exception as e:
                converted = self._error(prefix, e)
                if converted is e:
                    raise
                raise converted from e
            if page is None:
                return
            for o in page.get("Contents", []):
                yield Listed(o["Key"][strip:], int(o["Size"]))

    def check(self) -> None:
        """One listing of at most one key, with one retry: ObjectStoreError (naming the
        problem: bucket, credentials, endpoint) unless the store answers."""
        client = _new_client(*self._settings(), probe=True)
        try:
            client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except Exception as e:
            converted = self._error(self.prefix or "/", e)
            if converted is e:
                raise
            raise converted from e
        finally:
            client.close()

    def _error(self, key: str, e: Exception) -> Exception:
        """A botocore error as the servers' (shared.objectstore.s3 says the same)."""
        from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
        from botocore.exceptions import ConnectionError as TransportError

        endpoint = self._settings()[0]
        where = f"{self.url}{f' at {endpoint}' if endpoint else ''}"
        if isinstance(e, ClientError):
            error = e.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            said = str(error.get("Message") or "").strip()
            said = f" ({said})" if said else ""
            if code in ("NoSuchKey", "404", "NotFound"):
                return ObjectNotFound(key)
            if code == "NoSuchBucket":
                return ObjectStoreError(f"object store {where}: S3 bucket {self.bucket!r} does not exist")
            if code in _CREDENTIAL_CODES or status == 403:
                return ObjectStoreError(f"object store {where} refused the credentials: {status} {code}{said}")
            if status >= 500 or status == 429:
                return ObjectStoreUnavailable(f"object store {where} unavailable: {status} {code}{said}")
            return ObjectStoreError(f"object store {where} refused {key!r}: {status} {code}{said}")
        if isinstance(e, TransportError | HTTPClientError):
            return ObjectStoreUnavailable(f"object store {where} unreachable: {e}")
        if isinstance(e, BotoCoreError):  # no credentials, a bad region or endpoint, ...
            return ObjectStoreError(f"object store {where}: {e}")
        return e


_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                               "InvalidToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed"})


def check_store(store: SyncStore) -> None:
    """Whether the store answers (S3: one quick request; ObjectStoreError naming the problem).
    A `file://` store: its directory is checked when the options are parsed."""
    check = getattr(store, "check", None)
    if check is not None:
        check()


def open_sync_store(
    url: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    session_token: str | None = None,
) -> LocalSyncStore | S3SyncStore:
    """The store a URL names, as `ds3 ingester --store` accepts it (parse_store_url; raises
    StoreURLError). Credentials and region default to the standard AWS variables and files
    (resolved where the client is made)."""
    parsed = parse_store_url(url)
    if isinstance(parsed, FileStoreURL):
        return LocalSyncStore(url, parsed.root)
    return S3SyncStore(
        url, parsed.bucket, parsed.prefix, endpoint_url=endpoint_url,
        region=region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
        access_key_id=access_key_id, secret_access_key=secret_access_key, session_token=session_token,
    )
