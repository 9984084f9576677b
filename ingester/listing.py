"""ds3's own listings (not part of the Durable Streams protocol, so outside /v1/), for the
console (reader/console/, served by reader/console_http.py) and for operators:

    GET /ds3/streams?prefix=&after=&limit=   plain streams (/v1/stream/{path}), in path order
    GET /ds3/buckets?prefix=&after=&limit=   buckets, in id order

Paged and bounded like the bucket listing (ingester/buckets.py): one read transaction on the
read pool, a range scan of `streams` (or `buckets`) from max(prefix, after) that stops at the
first key without the prefix, decodes at most `limit` + 1 entries it shows, and passes over at
most MAX_SKIPPED it does not show (streams whose TTL ran out; streams and buckets the caller may
not read: private ones, when auth is on). When that budget runs out, the page ends early with
`has_more` true, so a page can hold fewer than `limit` entries (even none) and the caller goes
on from `next_cursor`. `limit` is 1..1000 (default 1000); invalid UTF-8 in the query, a
repeated parameter or a bad limit is 400.

`next_cursor` is the last name the page shows when it ends there. When it ends on an entry it
does not show, the cursor must not name it (a private stream's name, to an anonymous caller):
it is then sealed, `~` and base64url of the key encrypted with AES-GCM under a random secret
the WAL keeps (`sys` key `cursor_secret`, made on the first listing), so only this server can
read it. `after` takes either: a sealed cursor it can open, else a plain name.

Bucketed streams are keyed `\\x00b/...` and plain paths never start with a control character
(protocol.validate_stream_path), so the plain-stream scan starts at b"\\x01" at the lowest and
never walks over bucketed keys.

Visibility follows the read rules (shared/auth/policy.py): a stream or bucket that is private (a
--private grant covers it) is listed only for a caller whose token may read it. Readers
forward the caller's Authorization header; a bad token is 401 as on every other route."""

from __future__ import annotations

import base64
import binascii
import os
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Final
from urllib.parse import quote

import lmdb
from aiohttp import web
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ingester import buckets
from ingester.bucket_http import json_response, parse_limit
from ingester.records import StreamMeta
from ingester.service import SERVICE, IngesterService
from ingester.wal import WalEnv
from shared import protocol as P
from shared.auth.policy import Principal, Target
from shared.http.auth import AUTH
from shared.http.handlers import one_param, preflight, strict_query

STREAMS_PATH: Final = "/ds3/streams"
BUCKETS_PATH: Final = "/ds3/buckets"
MAX_SKIPPED: Final = 10_000  # entries a page may pass over without showing them
PLAIN_LOW: Final = b"\x01"  # bucketed streams' keys start with NUL (sorting first); plain paths never do
SEALED_MARK: Final = "~"  # a sealed cursor starts with it (a plain `after` may too: it must also open)
CURSOR_SECRET: Final = b"cursor_secret"  # in `sys`: the AES-256-GCM key of sealed cursors
CURSOR_AAD: Final = b"ds3 listing cursor"
NONCE_BYTES: Final = 12

Visible = Callable[[Target], bool]
_secrets: weakref.WeakKeyDictionary[WalEnv, AESGCM] = weakref.WeakKeyDictionary()


async def cursor_cipher(svc: IngesterService) -> AESGCM:
    """The WAL's cursor key (made, durably, by the first listing that needs it)."""
    found = _secrets.get(svc.wal)
    if found is None:
        found = _secrets[svc.wal] = AESGCM(await svc.committer.submit(partial(_cursor_secret, svc.wal)))
    return found


def _cursor_secret(wal: WalEnv, txn: lmdb.Transaction) -> bytes:
    secret = txn.get(CURSOR_SECRET, db=wal.sys)
    if secret is None:
        secret = os.urandom(32)
        txn.put(CURSOR_SECRET, secret, db=wal.sys)
    return bytes(secret)


def seal_cursor(cipher: AESGCM, key: bytes) -> str:
    nonce = os.urandom(NONCE_BYTES)
    token = base64.urlsafe_b64encode(nonce + cipher.encrypt(nonce, key, CURSOR_AAD)).rstrip(b"=")
    return SEALED_MARK + token.decode("ascii")


def after_key(cipher: AESGCM, after: str | None) -> bytes | None:
    """Where a page starts (exclusive): the key a sealed cursor holds, or `after` itself."""
    if after is None:
        return None
    if after.startswith(SEALED_MARK) and after.isascii():
        token = after[1:]
        try:
            sealed = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            return cipher.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], CURSOR_AAD)
        except (binascii.Error, ValueError, InvalidTag):
            pass  # not one of ours: a name that starts with the mark
    return after.encode("utf-8", "surrogatepass")


async def visibility(request: web.Request) -> Visible:
    """Whether the caller may see a target's name: public reads, or a token that may read it.
    With auth on, a token that is sent is checked (Unauthorized for a bad one); with auth off
    every name is shown and tokens are ignored, as on every other route."""
    authn = request.app[AUTH]
    if not authn.enabled:
        return lambda _t: True
    caller: Principal | None = await authn.caller(request.headers.get("Authorization"))
    policy = authn.policy

    def visible(t: Target) -> bool:
        return not policy.is_private(t) or (caller is not None and caller.may("read", t))

    return visible


def _page_bounds(prefix: str | None, after: bytes | None, low_floor: bytes) -> tuple[bytes, bytes, bytes | None]:
    """(the prefix as bytes, where the scan starts, the key to skip up to (inclusive) or None)."""
    low = (prefix or "").encode("utf-8", "surrogatepass")
    start, skip = max(low, low_floor), None
    if after is not None and after >= start:
        start = skip = after
    return low, start, skip


Seal = Callable[[bytes], str]  # a cursor for a key the page does not show


def list_plain_streams(
    txn: lmdb.Transaction, wal: WalEnv, *, prefix: str | None, after: bytes | None, limit: int, now: float,
    touches: dict[str, float], last_writes: dict[str, float], visible: Visible, seal: Seal,
) -> dict[str, Any]:
    def describe(key: bytes, raw: Any) -> dict[str, Any] | None:
        path = key.decode("utf-8", "replace")
        if not visible(Target(None, path)):
            return None
        meta = StreamMeta.decode(raw)
        if meta.moved_to is not None:
            return None  # a frozen copy: its new owner lists it
        if not meta.soft_deleted and meta.expired(now, touches.get(meta.path)):
            if meta.refcount == 0:
                return None  # gone: reads answer 404, and the writer removes it shortly
            meta.soft_deleted = True  # expired, but forks read it
        entry = buckets.stream_entry(txn, wal, meta, path, now, last_writes)
        del entry["stream_id"]
        return {"path": path, "url": P.STREAM_PREFIX + quote(path, safe="/"), **entry}

    streams, cursor = _page(txn.cursor(wal.streams), _page_bounds(prefix, after, PLAIN_LOW), limit, describe, seal)
    return {"prefix": prefix, "stream_count": len(streams), "streams": streams,
            "next_cursor": cursor, "has_more": cursor is not None}


def list_buckets(
    txn: lmdb.Transaction, wal: WalEnv, *, prefix: str | None, after: bytes | None, limit: int, visible: Visible,
    seal: Seal,
) -> dict[str, Any]:
    def describe(key: bytes, raw: Any) -> dict[str, Any] | None:
        bucket_id = key.decode("utf-8", "replace")
        return buckets.BucketMeta.decode(raw).describe(bucket_id) if visible(Target(bucket_id, None)) else None

    found, cursor = _page(txn.cursor(wal.buckets), _page_bounds(prefix, after, b""), limit, describe, seal)
    return _buckets_page(prefix, found, cursor is not None, cursor)


def _page(
    cur: lmdb.Cursor, bounds: tuple[bytes, bytes, bytes | None], limit: int,
    describe: Callable[[bytes, Any], dict[str, Any] | None], seal: Seal,
) -> tuple[list[dict[str, Any]], str | None]:
    """One page of a listing: the entries `describe` shows (None: hidden), at most `limit`,
    passing over at most MAX_SKIPPED hidden ones; and the cursor to go on from, or None: the
    last name shown, or a sealed one when the page ends on a hidden entry."""
    found: list[dict[str, Any]] = []
    skipped, last_key, last_hidden = 0, b"", False
    for key, raw in buckets.scan_range(cur, *bounds):
        if len(found) == limit or skipped >= MAX_SKIPPED:
            return found, seal(last_key) if last_hidden else last_key.decode("utf-8", "replace")
        last_key = key
        entry = describe(key, raw)
        last_hidden = entry is None
        if entry is None:
            skipped += 1
        else:
            found.append(entry)
    return found, None


def _buckets_page(prefix: str | None, found: list[dict[str, Any]], has_more: bool, cursor: str | None) -> dict[str, Any]:
    return {"prefix": prefix, "bucket_count": len(found), "buckets": found, "next_cursor": cursor,
            "has_more": has_more}


def not_allowed(method: str) -> web.Response:
    return web.Response(status=405, text=f"method {method} is not allowed on a listing\n",
                        headers={"Allow": "GET, HEAD, OPTIONS"})


async def handle(request: web.Request) -> web.StreamResponse:
    if request.method == "OPTIONS":
        return preflight()
    if request.method not in ("GET", "HEAD"):
        return not_allowed(request.method)
    svc: IngesterService = request.app[SERVICE]
    query = strict_query(request)
    prefix = one_param(query, "prefix")
    limit = parse_limit(one_param(query, "limit"))
    visible = await visibility(request)
    cipher = await cursor_cipher(svc)
    after = after_key(cipher, one_param(query, "after"))
    wal = svc.wal
    listing_streams = request.path == STREAMS_PATH

    def seal(key: bytes) -> str:
        return seal_cursor(cipher, key)

    def page(txn: lmdb.Transaction) -> dict[str, Any]:
        if listing_streams:
            return list_plain_streams(
                txn, wal, prefix=prefix, after=after, limit=limit, now=time.time(),
                touches=svc.store.touches, last_writes=svc.store.last_writes, visible=visible, seal=seal,
            )
        return list_buckets(txn, wal, prefix=prefix, after=after, limit=limit, visible=visible, seal=seal)

    return json_response(200, await svc.read_stored(page))


def add_routes(app: web.Application) -> None:
    for path in (STREAMS_PATH, BUCKETS_PATH):
        app.router.add_route("*", path, handle)
