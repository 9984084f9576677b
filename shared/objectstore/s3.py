"""ObjectStore on S3 or an S3-compatible service (MinIO), through aiobotocore.

One aiobotocore client per store, created on first use and kept for the life of the process:
a client owns an HTTP connection pool, so one per request would pay TLS + TCP set-up every
time and leak sockets under load.

Endpoint, credentials and region follow botocore's usual chain (AWS_ENDPOINT_URL_S3 /
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID..., ~/.aws/config) unless given explicitly. With a custom
endpoint the store uses path-style addressing, which MinIO and moto need.

Conditional writes are S3's own: put(if_absent=True) sends If-None-Match: *, put(if_match=etag)
sends If-Match (AWS since November 2024, MinIO; moto enforces both since 5.1.5 — the pinned
5.2.5 does). 412 PreconditionFailed, and 404 NoSuchKey for If-Match on a missing key,
become PreconditionFailed. 409 ConditionalRequestConflict (another conditional write of the key
in flight) is retried a few times, which yields the real outcome; if it persists, our write did
not happen and is reported as PreconditionFailed too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import inspect
import os
import re
import time
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self
from urllib.parse import parse_qs, urlsplit, urlunsplit

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession, get_session
from aiohttp.helpers import get_env_proxy_for_url
from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.exceptions import (
    BotoCoreError,
    ChecksumError,
    ClientError,
    ConnectionError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.utils import percent_encode
from yarl import URL

from shared.errors import ObjectNotFound, ObjectStoreError, ObjectStoreUnavailable, PreconditionFailed

from .base import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_LIST_PAGE_SIZE,
    ObjectInfo,
    StoreCounters,
    check_chunk_size,
    check_put_conditions,
    check_range,
    validate_key,
    validate_prefix,
)
from .open_body import OpenBody

if TYPE_CHECKING:  # the stubs are a dev dependency: needed by mypy only
    from aiobotocore.session import ClientCreatorContext
    from types_aiobotocore_s3.client import S3Client
    from types_aiobotocore_s3.type_defs import ListObjectsV2RequestTypeDef, PutObjectRequestTypeDef

_NOT_FOUND_CODES: Final = frozenset({"NoSuchKey", "NotFound", "404"})
_THROTTLE_CODES: Final = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                                    "ServiceUnavailable", "InternalError", "RequestTimeTooSkewed"})
# Failures of the transport rather than answers from S3: retrying later may succeed.
_TRANSPORT_ERRORS: Final = (ConnectionError, HTTPClientError, IncompleteReadError, ChecksumError,
                            aiohttp.ClientError, asyncio.TimeoutError, OSError)
# Object reads (get(), stream(): a reader's chunk heads, descriptors and relayed bodies) go
# over a plain aiohttp session to a presigned URL: a botocore request costs ~1.7 ms of CPU per
# GET, presigning ~0.15 ms and the plain request ~0.4 ms (scripts/bench_catchup.py), and the
# session's larger read buffer hands out fewer, larger pieces.
_PRESIGN_SECONDS: Final = 900  # how long a presigned URL is valid
_PRESIGN_REUSE: Final = 60.0  # how long one is used again (well within its validity)
_PRESIGNED_MAX: Final = 4096  # URLs kept for reuse at most
_STREAM_READ_BUFSIZE: Final = 1024 * 1024
_ERROR_CODE: Final = re.compile(rb"<Code>([^<]{1,64})</Code>")
# S3 answers 409 ConditionalRequestConflict while another conditional write of the same key
# is in flight; retrying then yields the real outcome (success or 412).
_CONFLICT_RETRIES: Final = 5
# Object writes of at most this many bytes that are not If-Match (the log's segments, which an
# append in `--durability store` waits for; small chunks and blobs) go to a presigned URL over
# the same aiohttp session as reads: a botocore put_object cost 2.4 ms of CPU against moto, a
# presigned PUT 1.3 ms (0.19 of it presigning; scripts/bench_durability.py). Larger bodies and
# If-Match writes (the ownership and cluster records) keep botocore's path. The URL is signed
# with botocore's own SigV4 query signer, without the client's request machinery (endpoint
# rules, events, serialisation: 0.19 ms a URL, most of what the PUT still cost us); the URL of
# the bucket and the signing region are taken once from a URL the client presigned.
_PRESIGNED_PUT_MAX: Final = 1024 * 1024
_PROBE_KEY: Final = "_ds3/presign-probe"  # (never written: only presigned, to learn the URL layout)


@dataclass(frozen=True, slots=True)
class S3Options:
    """Client tuning. Defaults suit a server: short connect timeout, a few retries (botocore's
    'standard' mode: 5xx, throttling, connection errors), a pool sized for many readers."""

    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    attempts: int = 3  # total, first try included
    max_pool_connections: int = 64
    path_style: bool | None = None  # None: path-style iff a custom endpoint is configured
    list_page_size: int = DEFAULT_LIST_PAGE_SIZE  # smaller only to exercise pagination in tests


class _RangeNotSatisfiable(ObjectStoreError):
    """416: the range starts at or past the object's end. get() turns it into b""."""


class _WriteConflict(ObjectStoreError):
    """409 ConditionalRequestConflict: a concurrent conditional write of the same key."""


# Outcomes the caller asked about, not failures: not counted as errors.
_ANSWERS: Final = (ObjectNotFound, PreconditionFailed, _RangeNotSatisfiable, _WriteConflict)


_loader: Any = None


def _new_session() -> AioSession:
    """A session per store (credentials are resolved and cached per session), but one shared
    botocore data loader: parsing the S3 service model costs ~0.2 s per session otherwise."""
    global _loader
    session = get_session()
    if _loader is None:
        _loader = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _loader)
    return session


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


class S3Store:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str | None = None,
        options: S3Options | None = None,
        url: str | None = None,
    ) -> None:
        opts = options or S3Options()
        if opts.list_page_size < 1 or opts.list_page_size > DEFAULT_LIST_PAGE_SIZE:
            raise ValueError(f"list_page_size must be in 1..{DEFAULT_LIST_PAGE_SIZE}")
        self.bucket = bucket
        # Keys live under "<prefix>/"; callers never see the prefix.
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = url or f"s3://{bucket}/{self.prefix}"
        self.counters = StoreCounters()
        self.options = opts
        self._endpoint = endpoint
        self._region = region
        self._session = _new_session()
        self._lock = asyncio.Lock()
        self._ctx: ClientCreatorContext[S3Client] | None = None
        self._s3: S3Client | None = None
        self._http: aiohttp.ClientSession | None = None  # get() and stream(): presigned GETs
        self._presigned_urls: dict[str, tuple[URL, float]] = {}
        self._put_base: tuple[str, str] | None = None  # (URL of keys, signing region): _presign_put
        self._proxies: dict[tuple[str, str | None, int | None], tuple[URL | None, str | None]] = {}  # _with_proxy
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
        await self._client()  # connect eagerly: configuration errors show at start-up
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            ctx, self._ctx, self._s3 = self._ctx, None, None
            http, self._http = self._http, None
            if http is not None:
                await http.close()
            if ctx is not None:
                await ctx.__aexit__(None, None, None)

    async def _client(self) -> S3Client:
        if self._s3 is not None:
            return self._s3
        async with self._lock:
            if self._closed:
                raise RuntimeError("object store is closed")
            if self._s3 is None:
                o = self.options
                path_style = o.path_style
                if path_style is None:
                    path_style = bool(self._endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
                                      or os.environ.get("AWS_ENDPOINT_URL"))
                config = AioConfig(
                    connect_timeout=o.connect_timeout,
                    read_timeout=o.read_timeout,
                    retries={"total_max_attempts": o.attempts, "mode": "standard"},
                    max_pool_connections=o.max_pool_connections,
                    s3={"addressing_style": "path"} if path_style else None,
                    # SigV4 for presigned URLs too (botocore may presign with V2, which S3
                    # refuses for KMS-encrypted objects and newer regions)
                    signature_version="s3v4",
                )
                ctx = self._session.create_client(
                    "s3", endpoint_url=self._endpoint, region_name=self._region, config=config
                )
                with self._errors(self.bucket):
                    self._s3 = await ctx.__aenter__()
                self._ctx = ctx
            return self._s3

    # ------------------------------------------------------------ errors
    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Convert botocore / aiohttp errors into the domain's, counting the real failures."""
        try:
            yield
        except ClientError as exc:
            converted = self._client_error(key, exc)
            if not isinstance(converted, _ANSWERS):
                self.counters.errors += 1
            raise converted from exc
        except _TRANSPORT_ERRORS as exc:
            self.counters.errors += 1
            raise ObjectStoreUnavailable(f"object store unreachable ({self.url}): {exc}") from exc
        except BotoCoreError as exc:  # no credentials, bad configuration, ...
            self.counters.errors += 1
            raise ObjectStoreError(f"object store error ({self.url}): {exc}") from exc

    def _client_error(self, key: str, exc: ClientError) -> Exception:
        return self._answer_error(key, _status(exc), _code(exc))

    def _answer_error(self, key: str, status: int, code: str) -> Exception:
        if code == "NoSuchBucket":
            return ObjectStoreError(f"bucket {self.bucket!r} does not exist ({self.url})")
        if status == 404 or code in _NOT_FOUND_CODES:
            return ObjectNotFound(key)
        if status == 412 or code == "PreconditionFailed":
            return PreconditionFailed(key)
        if status == 416:
            return _RangeNotSatisfiable(f"range not satisfiable: {key}")
        if status == 409 and code == "ConditionalRequestConflict":
            return _WriteConflict(f"concurrent conditional write: {key}")
        if status >= 500 or status == 429 or code in _THROTTLE_CODES:
            return ObjectStoreUnavailable(f"object store unavailable ({self.url}): {status} {code}")
        return ObjectStoreError(f"object store refused {key!r} ({self.url}): {status} {code}")

    def _key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    # ------------------------------------------------------------ writes
    async def put(
        self,
        key: str,
        data: bytes,
        *,
        content_type: str | None = None,
        if_absent: bool = False,
        if_match: str | None = None,
        durable: bool = True,  # (an acknowledged S3 PUT is durable: nothing to defer)
    ) -> str:
        check_put_conditions(if_absent, if_match)
        if if_match is None and len(data) <= _PRESIGNED_PUT_MAX:
            return await self._put_presigned(key, data, content_type, if_absent)
        req: PutObjectRequestTypeDef = {"Bucket": self.bucket, "Key": self._key(key), "Body": data}
        if content_type is not None:
            req["ContentType"] = content_type
        if if_absent:
            req["IfNoneMatch"] = "*"
        if if_match is not None:
            req["IfMatch"] = f'"{if_match.strip(chr(34))}"'
        s3 = await self._client()
        for attempt in range(_CONFLICT_RETRIES + 1):
            self.counters.puts += 1
            try:
                with self._errors(key):
                    resp = await s3.put_object(**req)
                break
            except _WriteConflict:
                if attempt == _CONFLICT_RETRIES:
                    # Every attempt was refused for a concurrent conditional write: ours did
                    # not happen, and someone else was changing the object meanwhile.
                    raise PreconditionFailed(key, "lost to concurrent conditional writes") from None
                await asyncio.sleep(0.05 * 2**attempt)
            except ObjectNotFound:
                if if_match is None:
                    raise
                # S3 answers If-Match on a missing key with 404 NoSuchKey: no such version.
                raise PreconditionFailed(key, f"no object (expected version {if_match})") from None
            except PreconditionFailed:
                if if_match is None:
                    raise
                raise PreconditionFailed(key, f"object is not version {if_match}") from None
        self.counters.bytes_out += len(data)
        return resp["ETag"].strip('"')

    async def _put_presigned(self, key: str, data: bytes, content_type: str | None, if_absent: bool) -> str:
        """put() of a small body to a presigned URL on the aiohttp session. The URL signs
        If-None-Match (so S3 refuses the request without it), the content type and the body's
        MD5 (S3 refuses other bytes: BadDigest), as botocore's put_object would send them.
        Retries as botocore's standard mode does (transport errors, 5xx, throttling: up to
        `attempts` in all) and 409 ConditionalRequestConflict as put() does."""
        k = self._key(key)
        s3 = await self._client()
        http = self._http_session()
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode("ascii")
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": k, "ContentMD5": md5}
        headers = {"Content-MD5": md5, "Accept-Encoding": "identity"}
        if content_type is not None:
            params["ContentType"] = headers["Content-Type"] = content_type
        if if_absent:
            params["IfNoneMatch"] = headers["If-None-Match"] = "*"
        with self._errors(key):
            url = await self._presign_put(s3, k, params, headers)
        attempts, attempt, conflicts = max(1, self.options.attempts), 0, 0
        while True:
            attempt += 1
            self.counters.puts += 1
            try:
                # (no Content-Type of aiohttp's own when none is given: botocore sends none)
                async with http.put(url, data=data, skip_auto_headers=("Content-Type",),
                                    **self._with_proxy(url, headers)) as resp:
                    said = await resp.read()
                    status, etag = resp.status, resp.headers.get("ETag", "")
            except _TRANSPORT_ERRORS as exc:
                await self._retry_or_give_up(attempt, attempts, exc)
                continue
            if status == 200:
                self.counters.bytes_out += len(data)
                return etag.strip('"')
            found = _ERROR_CODE.search(said)
            error = self._answer_error(key, status, found.group(1).decode("ascii", "replace") if found else "")
            if isinstance(error, _WriteConflict):
                if conflicts == _CONFLICT_RETRIES:
                    raise PreconditionFailed(key, "lost to concurrent conditional writes") from None
                await asyncio.sleep(0.05 * 2**conflicts)
                conflicts += 1
                attempt -= 1  # an answer, not a failure of the store
                continue
            if isinstance(error, ObjectStoreUnavailable) and attempt < attempts:
                await asyncio.sleep(0.05 * 2**attempt)
                continue
            if not isinstance(error, _ANSWERS):
                self.counters.errors += 1
            raise error

    async def _presign_put(self, s3: S3Client, k: str, params: dict[str, Any], headers: dict[str, str]) -> URL:
        """A presigned PUT URL of object `k` signing `headers` (but Accept-Encoding)."""
        base = self._put_base
        if base is None:
            probe = self._key(_PROBE_KEY)
            raw = await s3.generate_presigned_url(
                "put_object", Params={"Bucket": self.bucket, "Key": probe}, ExpiresIn=_PRESIGN_SECONDS)
            parts = urlsplit(raw)
            quoted = percent_encode(probe, safe="/~")
            credential = parse_qs(parts.query).get("X-Amz-Credential", [""])[0].split("/")
            if parts.path.endswith("/" + quoted) and len(credential) == 5:
                base = (urlunsplit((parts.scheme, parts.netloc, parts.path[:-len(quoted)], "", "")), credential[2])
            else:  # a layout we do not know: let the client presign every URL
                base = ("", "")
            self._put_base = base
        # The credentials the client signs with (aiobotocore's accessor is private: without
        # it, or without credentials, the client presigns, and says what is missing).
        getter = getattr(s3, "_get_credentials", None)
        credentials = getter() if base[0] and getter is not None else None
        if credentials is None:
            raw = await s3.generate_presigned_url("put_object", Params=params, ExpiresIn=_PRESIGN_SECONDS)
            return URL(raw, encoded=True)
        frozen = credentials.get_frozen_credentials()
        if inspect.isawaitable(frozen):
            frozen = await frozen
        request = AWSRequest(method="PUT", url=base[0] + percent_encode(k, safe="/~"),
                             headers={h: v for h, v in headers.items() if h != "Accept-Encoding"})
        S3SigV4QueryAuth(frozen, "s3", base[1], expires=_PRESIGN_SECONDS).add_auth(request)
        return URL(str(request.url), encoded=True)

    async def delete(self, key: str, *, durable: bool = True) -> None:  # (durable: always)
        k = self._key(key)
        s3 = await self._client()
        self.counters.deletes += 1
        with self._errors(key):
            await s3.delete_object(Bucket=self.bucket, Key=k)  # S3 answers 204 for a missing key

    async def sync(self, keys: Collection[str]) -> None:
        """Nothing to do: every acknowledged write is durable in S3."""

    async def delete_prefix(self, prefix: str) -> int:
        validate_prefix(prefix)
        s3 = await self._client()
        deleted = 0
        after: str | None = None
        while True:
            # List one page, delete it, list again after its last key: no continuation token
            # is held across the deletes, so this is correct on every S3 implementation.
            keys = [i.key async for i in self.list(prefix, after, self.options.list_page_size)]
            if not keys:
                return deleted
            self.counters.deletes += 1
            with self._errors(prefix):
                resp = await s3.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self.prefix + k} for k in keys], "Quiet": True},
                )
            if errors := resp.get("Errors"):
                self.counters.errors += 1
                first = errors[0]
                raise ObjectStoreError(f"delete_prefix {prefix!r}: {len(errors)} keys not deleted, "
                                       f"e.g. {first.get('Key')}: {first.get('Code')}")
            deleted += len(keys)
            if len(keys) < self.options.list_page_size:
                return deleted
            after = keys[-1]

    # ------------------------------------------------------------ reads
    def _range(self, lo: int, hi: int | None) -> dict[str, Any]:
        if lo == 0 and hi is None:
            return {}
        return {"Range": f"bytes={lo}-{'' if hi is None else hi - 1}"}

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        k = self._key(key)
        lo, hi = check_range(start, end)
        if hi == lo:
            await self.head(key)  # an empty range still says whether the object exists
            return b""
        self.counters.gets += 1
        resp = await self._open(key, k, lo, hi)
        if resp is None:
            return b""  # start at or past the end: an empty slice, as in Python
        try:
            with self._errors(key):
                data = await resp.read()
        finally:
            resp.release()
        self.counters.bytes_in += len(data)
        return data

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        k = self._key(key)
        s3 = await self._client()
        self.counters.gets += 1
        with self._errors(key):
            resp = await s3.get_object(Bucket=self.bucket, Key=k)
            async with resp["Body"] as body:
                data = await body.read()
        self.counters.bytes_in += len(data)
        return data, resp["ETag"].strip('"')

    async def stream(
        self,
        key: str,
        start: int | None = None,
        end: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        check_chunk_size(chunk_size)
        body = await self.open_body(key, start, end)
        if body is None:
            return
        try:
            async for piece in body.pieces(chunk_size):
                yield piece
        finally:
            body.close()

    async def open_body(self, key: str, start: int | None = None, end: int | None = None) -> OpenBody | None:
        """A ranged GET with its status and headers in and its body still to read (stream()
        without the first wait), or None for an empty range (one at or past the end)."""
        k = self._key(key)
        lo, hi = check_range(start, end)
        if hi == lo:
            await self.head(key)
            return None
        self.counters.gets += 1
        resp = await self._open(key, k, lo, hi)
        return None if resp is None else OpenBody(self, key, resp)

    async def _open(self, key: str, k: str, lo: int, hi: int | None) -> aiohttp.ClientResponse | None:
        """A presigned GET of the range, its status line and headers read: the response with
        its body to read, or None for 416 (a range starting at or past the end). Transport
        failures, 5xx and throttling are retried like botocore's standard mode does; a 403 to
        a URL presigned earlier is asked again with a fresh one (credentials may have changed)."""
        s3 = await self._client()
        http = self._http_session()
        headers = {"Accept-Encoding": "identity", **self._range(lo, hi)}
        attempts = max(1, self.options.attempts)
        attempt, fresh = 0, False
        while True:
            attempt += 1
            url, reused = await self._presigned(s3, key, k, fresh)
            try:
                resp = await http.get(url, **self._with_proxy(url, headers))
            except _TRANSPORT_ERRORS as exc:
                await self._retry_or_give_up(attempt, attempts, exc)
                continue
            if resp.status in (200, 206):
                return resp
            try:
                with self._errors(key):
                    said = await resp.content.read(64 * 1024)
            finally:
                resp.release()
            if resp.status == 403 and reused:
                fresh = True
                attempt -= 1  # not the store's failure: ours, with an old URL
                continue
            found = _ERROR_CODE.search(said)
            error = self._answer_error(key, resp.status, found.group(1).decode("ascii", "replace") if found else "")
            if isinstance(error, _RangeNotSatisfiable):
                return None
            if isinstance(error, ObjectStoreUnavailable) and attempt < attempts:
                await asyncio.sleep(0.05 * 2**attempt)
                continue
            if not isinstance(error, _ANSWERS):
                self.counters.errors += 1
            raise error

    async def _presigned(self, s3: S3Client, key: str, k: str, fresh: bool) -> tuple[URL, bool]:
        """A presigned GET URL of object `k` (any range of it: Range is not signed), reused for
        _PRESIGN_REUSE seconds: presigning costs more than a GET's own request. (url, reused)."""
        now = time.monotonic()
        hit = self._presigned_urls.get(k)
        if hit is not None and not fresh and now < hit[1]:
            return hit[0], True
        with self._errors(key):
            raw = await s3.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": k}, ExpiresIn=_PRESIGN_SECONDS)
        url = URL(raw, encoded=True)
        if len(self._presigned_urls) >= _PRESIGNED_MAX:
            self._presigned_urls.clear()
        self._presigned_urls[k] = (url, now + _PRESIGN_REUSE)
        return url, False

    async def _retry_or_give_up(self, attempt: int, attempts: int, exc: BaseException) -> None:
        """After a transport error on a presigned request: back off before the next attempt, or
        give up (ObjectStoreUnavailable) after the last."""
        if attempt < attempts:
            await asyncio.sleep(0.05 * 2**attempt)
            return
        self.counters.errors += 1
        raise ObjectStoreUnavailable(f"object store unreachable ({self.url}): {exc}") from exc

    def _http_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("object store is closed")
        if self._http is None:
            o = self.options
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=o.max_pool_connections),
                timeout=aiohttp.ClientTimeout(sock_connect=o.connect_timeout, sock_read=o.read_timeout),
                auto_decompress=False, read_bufsize=_STREAM_READ_BUFSIZE,
                skip_auto_headers=("User-Agent",),
            )
        return self._http

    def _with_proxy(self, url: URL, headers: dict[str, str]) -> dict[str, Any]:
        """A presigned request's arguments: its `headers`, and the environment's proxy for `url`
        (HTTP_PROXY / HTTPS_PROXY / NO_PROXY, as botocore's own requests use; looked up once
        per origin). aiohttp's trust_env looked it up, and ~/.netrc, on every request, each in a
        worker thread: two thread hops per segment PUT and per GET, a sixth of the ingester's
        CPU in `--durability store`; and a netrc login added an Authorization header, which S3
        refuses beside a presigned URL's."""
        origin = (url.scheme, url.host, url.port)
        found = self._proxies.get(origin)
        if found is None:
            try:
                env_proxy, auth = get_env_proxy_for_url(url)
            except LookupError:
                found = (None, None)
            else:
                found = (env_proxy, None if auth is None else auth.encode())
            self._proxies[origin] = found
        proxy, login = found
        if proxy is None:
            return {"headers": headers}
        if login is None:
            return {"headers": headers, "proxy": proxy}
        if url.scheme == "https":  # the proxy's login goes with the tunnel's CONNECT
            return {"headers": headers, "proxy": proxy, "proxy_headers": {"Proxy-Authorization": login}}
        return {"headers": {**headers, "Proxy-Authorization": login}, "proxy": proxy}

    async def map_range(self, key: str, start: int, end: int) -> None:
        return None  # no local files: read with stream()

    async def head(self, key: str) -> ObjectInfo:
        k = self._key(key)
        s3 = await self._client()
        self.counters.heads += 1
        with self._errors(key):
            resp = await s3.head_object(Bucket=self.bucket, Key=k)
        return ObjectInfo(
            key=key,
            size=resp["ContentLength"],
            etag=resp["ETag"].strip('"'),
            content_type=resp.get("ContentType"),
            last_modified=resp["LastModified"].timestamp(),
        )

    async def list(
        self, prefix: str = "", start_after: str | None = None, limit: int | None = None
    ) -> AsyncIterator[ObjectInfo]:
        validate_prefix(prefix)
        if limit is not None and limit <= 0:
            return
        s3 = await self._client()
        page = self.options.list_page_size
        req: ListObjectsV2RequestTypeDef = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        if start_after is not None:
            req["StartAfter"] = self.prefix + start_after
        strip = len(self.prefix)
        left = limit
        while True:
            req["MaxKeys"] = page if left is None else min(page, left)
            self.counters.lists += 1
            with self._errors(prefix):
                resp = await s3.list_objects_v2(**req)
            for obj in resp.get("Contents", []):
                yield ObjectInfo(
                    key=obj["Key"][strip:],
                    size=obj["Size"],
                    etag=obj["ETag"].strip('"'),
                    last_modified=obj["LastModified"].timestamp(),
                )
                if left is not None:
                    left -= 1
                    if left == 0:
                        return
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return
            req["ContinuationToken"] = token
