"""Access control: who may read and write which streams. Pure, apart from reading the token
file at start; signature checks are pyjwt's (shared/auth/jwt_verify.py), the HTTP glue is
shared/http/auth.py.

Grants name what a token may touch, in the `ds3` claim of a JWT, a `scope` string, a static
token's entry, and the `--private` setting alike:

    *                   everything: every stream, every bucket (bucket create/delete included)
    stream:<prefix>     plain streams /v1/stream/<path> whose path starts with <prefix>
                        ("stream:chat/" covers chat/a and chat/b/c; "stream:" every plain stream)
    bucket:<id>         the bucket <id> (create, metadata, listing, delete) and all its streams
    bucket:<id>/<pfx>   the streams of bucket <id> whose id starts with <pfx> (not the bucket)
    bucket:*            every bucket and bucketed stream

A trailing `*` on a prefix is allowed and changes nothing ("stream:chat/*" == "stream:chat/").
Snapshot URLs ({stream}/snapshot/{offset}) belong to their stream: prefixes match them too.

Claims: {"ds3": {"read": [grants], "write": [grants]}} and/or an OAuth-style
"scope": "read:<grant> write:<grant> ..." (other scope words are ignored). Write does not
imply read.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import unquote

from shared import buckets as B
from shared import extensions
from shared import protocol as P
from shared.config import AuthConfig, ConfigError
from shared.errors import BadRequest, Forbidden, Unauthorized

READ_METHODS: Final = frozenset({"GET", "HEAD"})
INTERNAL_PREFIX: Final = "/_ds3/"
_BUCKET_ID_RE: Final = re.compile(r"\A[a-z0-9_-]{4,64}\Z")
MIN_TOKEN_CHARS: Final = 16


# ---------------------------------------------------------------- what a request acts on


@dataclass(frozen=True, slots=True)
class Target:
    """A plain stream (bucket None, name its path), a bucket (name None), or a stream in a
    bucket (name its id, plus any /snapshot/... suffix). Names are percent-decoded the way
    the handlers decode them, so a grant sees what the handler will act on."""

    bucket: str | None
    name: str | None

    def describe(self) -> str:
        if self.bucket is None:
            return f"stream {self.name!r}"
        return f"bucket {self.bucket!r}" if self.name is None else f"stream {self.name!r} of bucket {self.bucket!r}"


def _decode(text: str) -> str:
    # Invalid UTF-8 gets U+FFFD here; the handler refuses such paths with 400 anyway.
    return unquote(text, errors="replace")


def target_of(raw_path: str) -> Target | None:
    """The target of a request's raw URL path (no query); None for other routes. An extension
    URL ({stream}/snapshot/{offset}, {stream}/bootstrap) targets its stream: a grant on the
    prefix `chat/` must not open `chat`'s snapshots, nor a private prefix hide a public
    stream's bootstrap."""
    try:
        raw_path = extensions.split(raw_path)[0]
    except BadRequest:  # a snapshot offset that is not UTF-8: still its stream's (the handler says 400)
        raw_path = raw_path.rpartition("/")[0].rpartition("/")[0]
    if raw_path.startswith(P.STREAM_PREFIX):
        return Target(None, _decode(raw_path[len(P.STREAM_PREFIX) :]))
    if raw_path.startswith(B.BUCKETS_PREFIX):
        bucket_raw, _, rest = raw_path[len(B.BUCKETS_PREFIX) :].partition("/")
        if rest in ("", B.RESERVED_STREAM_ID):  # the bucket itself, or its listing
            return Target(_decode(bucket_raw), None)
        return Target(_decode(bucket_raw), _decode(rest))
    return None


def fork_source_target(value: str) -> Target | None:
    """The target a Stream-Forked-From header names, decoded as shared.buckets.fork_source_path
    decodes it (percent-decoded; None where that refuses it)."""
    if value.startswith(P.STREAM_PREFIX):
        try:
            return Target(None, P.decode_stream_url(value.split("?", 1)[0]))
        except BadRequest:
            return None
    if value.startswith(B.BUCKETS_PREFIX):
        return target_of(value.split("?", 1)[0])
    return None


# ---------------------------------------------------------------- grants


@dataclass(frozen=True, slots=True)
class Grant:
    kind: Literal["all", "stream", "bucket"]
    bucket: str | None = None  # kind bucket: the id, None for every bucket
    prefix: str | None = None  # stream path / stream id prefix; None: the whole bucket

    def covers(self, t: Target) -> bool:
        if self.kind == "all":
            return True
        if self.kind == "stream":
            return t.bucket is None and t.name is not None and t.name.startswith(self.prefix or "")
        if t.bucket is None or (self.bucket is not None and t.bucket != self.bucket):
            return False
        return self.prefix is None or (t.name is not None and t.name.startswith(self.prefix))

    def touches_bucket(self, t: Target) -> bool:
        """Whether this grant names anything in t's bucket (a private listing would show it)."""
        return self.kind == "all" or (
            self.kind == "bucket" and t.bucket is not None and self.bucket in (None, t.bucket)
        )


def parse_grant(text: str) -> Grant:
    """One grant (module docstring); ValueError with the reason when malformed."""
    if not isinstance(text, str):
        raise ValueError(f"a grant must be a string, not {type(text).__name__}")
    if text == "*":
        return Grant("all")
    kind, colon, rest = text.partition(":")
    if not colon or kind not in ("stream", "bucket"):
        raise ValueError(f"grant {text[:80]!r}: expected *, stream:<prefix> or bucket:<id>[/<prefix>]")
    if kind == "stream":
        return Grant("stream", prefix=rest.removesuffix("*"))
    if rest == "*":
        return Grant("bucket")
    bucket_id, slash, prefix = rest.partition("/")
    if not _BUCKET_ID_RE.match(bucket_id):
        raise ValueError(f"grant {text[:80]!r}: bucket id must match ^[a-z0-9_-]{{4,64}}$ (or be *)")
    return Grant("bucket", bucket=bucket_id, prefix=prefix.removesuffix("*") if slash else None)


def parse_grants(items: Any, where: str) -> tuple[Grant, ...]:
    if items is None:
        return ()
    if not isinstance(items, list):
        raise ValueError(f"{where} must be a list of grants")
    return tuple(parse_grant(x) for x in items)


def grants_from_claims(claims: Mapping[str, Any]) -> tuple[tuple[Grant, ...], tuple[Grant, ...]]:
    """(read, write) grants from a `ds3` object and/or a `scope` string."""
    read: list[Grant] = []
    write: list[Grant] = []
    ds3 = claims.get("ds3")
    if ds3 is not None:
        if not isinstance(ds3, dict):
            raise ValueError("the ds3 claim must be an object {\"read\": [...], \"write\": [...]}")
        read += parse_grants(ds3.get("read"), "ds3.read")
        write += parse_grants(ds3.get("write"), "ds3.write")
    scope = claims.get("scope")
    if scope is not None:
        if not isinstance(scope, str):
            raise ValueError("the scope claim must be a space-separated string")
        for word in scope.split():
            action, colon, grant = word.partition(":")
            if colon and action in ("read", "write"):
                (read if action == "read" else write).append(parse_grant(grant))
    return tuple(read), tuple(write)


# ---------------------------------------------------------------- who is asking


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. `subject` names it for rate limits (never a token)."""

    subject: str
    read: tuple[Grant, ...]
    write: tuple[Grant, ...]

    def may(self, action: Literal["read", "write"], t: Target) -> bool:
        return any(g.covers(t) for g in (self.read if action == "read" else self.write))


def _sha256(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class StaticTokens:
    """Bearer tokens from a JSON list (file or DS3_TOKENS):

        [{"token": "...", "sub": "ci", "read": ["*"], "write": ["stream:ci/"]},
         {"token_sha256": "<hex of sha256(token)>", "sub": "web", "scope": "read:bucket:public"}]

    Only the SHA-256 of each token is kept and a lookup hashes the presented token first, so
    neither the table nor the lookup's timing (it depends on the digest, which the caller
    cannot steer) reveals a token."""

    def __init__(self, entries: Iterable[tuple[bytes, Principal]]) -> None:
        self._by_digest = dict(entries)

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, token: str) -> Principal | None:
        return self._by_digest.get(_sha256(token))

    @classmethod
    def parse(cls, text: str, setting: str) -> StaticTokens:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{setting}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            data = data.get("tokens")
        if not isinstance(data, list):
            raise ConfigError(f"{setting}: expected a JSON list of token entries (or {{\"tokens\": [...]}})")
        entries: list[tuple[bytes, Principal]] = []
        for i, item in enumerate(data):
            try:
                entries.append(_static_entry(item, i))
            except ValueError as e:
                raise ConfigError(f"{setting}: entry {i}: {e}") from None
        if len({d for d, _ in entries}) != len(entries):
            raise ConfigError(f"{setting}: the same token is listed twice")
        return cls(entries)


def _static_entry(item: Any, index: int) -> tuple[bytes, Principal]:
    if not isinstance(item, dict):
        raise ValueError("must be an object with token (or token_sha256), sub, read, write")
    unknown = set(item) - {"token", "token_sha256", "sub", "read", "write", "scope"}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}")
    token, hexdigest = item.get("token"), item.get("token_sha256")
    if (token is None) == (hexdigest is None):
        raise ValueError("give exactly one of token and token_sha256")
    if token is not None:
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or not token.isascii() or " " in token:
            raise ValueError(f"token must be at least {MIN_TOKEN_CHARS} ASCII characters without spaces")
        digest = _sha256(token)
    else:
        if not isinstance(hexdigest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", hexdigest):
            raise ValueError("token_sha256 must be 64 hex digits")
        digest = bytes.fromhex(hexdigest)
    sub = item.get("sub", f"token-{index}")
    if not isinstance(sub, str) or not sub:
        raise ValueError("sub must be a non-empty string")
    read = parse_grants(item.get("read"), "read")
    write = parse_grants(item.get("write"), "write")
    scope_read, scope_write = grants_from_claims({"scope": item.get("scope")})
    return digest, Principal(f"sub:{sub}", read + scope_read, write + scope_write)


def load_static_tokens(config: AuthConfig) -> StaticTokens:
    entries: list[tuple[bytes, Principal]] = []
    if config.tokens_file is not None:
        path: Path = config.tokens_file
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"tokens-file (DS3_TOKENS_FILE): cannot read {path}: {e.strerror}") from None
        entries += StaticTokens.parse(text, "tokens-file (DS3_TOKENS_FILE)")._by_digest.items()
    if config.tokens is not None:
        entries += StaticTokens.parse(config.tokens, "tokens (DS3_TOKENS)")._by_digest.items()
    return StaticTokens(entries)


# ---------------------------------------------------------------- the decision


@dataclass(frozen=True, slots=True)
class Policy:
    enabled: bool  # a credential source is configured: writes need a token
    private: tuple[Grant, ...]  # reads these cover need a token with read scope

    @classmethod
    def from_config(cls, config: AuthConfig) -> Policy:
        private = []
        for text in config.private:
            try:
                private.append(parse_grant(text))
            except ValueError as e:
                raise ConfigError(f"private (DS3_PRIVATE): {e}") from None
        return cls(config.enabled, tuple(private))

    def is_private(self, t: Target) -> bool:
        if t.name is None:  # bucket metadata and listing show every stream's name
            return any(g.touches_bucket(t) for g in self.private)
        return any(g.covers(t) for g in self.private)

    def check(
        self, method: str, t: Target, caller: Principal | None, *, internal: bool = False,
        fork_source: Target | None = None,
    ) -> bool:
        """Raise Unauthorized / Forbidden unless `caller` may do this; return whether the
        response is private (must not be stored by shared caches). `internal`: the request
        comes from a reader holding the internal token, which reads anything on behalf of
        callers it has checked itself, but never writes on its own authority."""
        if method in READ_METHODS:
            if not self.is_private(t):
                return False
            if internal or (caller is not None and caller.may("read", t)):
                return True
            _refuse(caller, f"reading {t.describe()} needs a token with read scope for it")
        if not self.enabled:
            return False
        if caller is None or not caller.may("write", t):
            _refuse(caller, f"writing {t.describe()} needs a token with write scope for it")
        assert caller is not None
        # A fork reads its source: creating one must not expose a private source to a writer.
        if fork_source is not None and self.is_private(fork_source) and not caller.may("read", fork_source):
            raise Forbidden(f"forking {fork_source.describe()} needs a token with read scope for it")
        return self.is_private(t)


def _refuse(caller: Principal | None, why: str) -> None:
    if caller is None:
        raise Unauthorized(f"authorization required: {why}")
    raise Forbidden(f"forbidden: {why}")
