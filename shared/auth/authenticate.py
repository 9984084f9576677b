"""Authentication: an Authorization header becomes a Principal (static tokens first, then
JWT), or Unauthorized. Verified JWTs are remembered briefly by the SHA-256 of the token, so
a client's stream of appends costs one signature check a minute, not one per request."""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import TYPE_CHECKING, Final

from shared.auth.policy import Policy, Principal, StaticTokens, grants_from_claims, load_static_tokens
from shared.config import AuthConfig
from shared.errors import Unauthorized

if TYPE_CHECKING:
    from shared.auth.jwt_verify import JwtVerifier

CACHE_SECONDS: Final = 60.0
CACHE_MAX: Final = 10_000


class Authenticator:
    def __init__(self, config: AuthConfig) -> None:
        """Loads and checks every credential source now: a ConfigError names the setting."""
        self.policy = Policy.from_config(config)
        self.static: StaticTokens = load_static_tokens(config)
        self.jwt: JwtVerifier | None = None  # None: no JWT accepted (and pyjwt never imported)
        if config.accepts_jwt:
            from shared.auth.jwt_verify import JwtVerifier  # (pyjwt with cryptography: ~60 ms)

            self.jwt = JwtVerifier(config)
        self._internal = config.internal_token.encode() if config.internal_token else None
        self._cache: dict[bytes, tuple[Principal, float | int]] = {}

    @property
    def enabled(self) -> bool:
        return self.policy.enabled

    @property
    def has_internal_token(self) -> bool:
        return self._internal is not None

    def is_internal(self, presented: str) -> bool:
        # (header values may hold undecodable bytes as surrogates: they just do not match)
        return self._internal is not None and hmac.compare_digest(presented.encode("utf-8", "replace"),
                                                                  self._internal)

    def known_caller(self, header: str) -> Principal | None:
        """The caller a well-formed bearer header names if that is known without waiting (a
        static token, or a JWT verified in the last minute); None otherwise (a JWT to verify,
        or a header authenticate() refuses). The fast lanes take only requests it names."""
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        found = self.static.lookup(token)
        if found is not None or self.jwt is None:
            return found
        hit = self._cache.get(hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest())
        return hit[0] if hit is not None and hit[1] > time.time() else None

    async def caller(self, header: str | None) -> Principal | None:
        """The caller an Authorization header names. None for no header, or another scheme than
        Bearer (a browser's or a proxy's Basic): no credentials of ours, as if none were sent
        (RFC 6750 3.1: the 401 of a write then carries no error code, and public reads are
        served; it answered 401 invalid_request, public reads included: found by QA).
        Unauthorized for a bearer token that names nobody."""
        if header is None or header.strip().partition(" ")[0].lower() != "bearer":
            return None
        return await self.authenticate(header)

    async def authenticate(self, header: str) -> Principal:
        """The caller an `Authorization` header names; Unauthorized when it names nobody."""
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise Unauthorized("authorization must be a bearer token (Authorization: Bearer <token>)",
                               "invalid_request")
        token = token.strip()
        if not token:
            raise Unauthorized("invalid token: empty", "invalid_token")
        found = self.static.lookup(token)
        if found is not None:
            return found
        if self.jwt is None:
            raise Unauthorized("invalid token: unknown", "invalid_token")
        key = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        now = time.time()
        hit = self._cache.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        claims = await self.jwt.verify(token)
        try:
            read, write = grants_from_claims(claims)
        except ValueError as e:
            raise Unauthorized(f"invalid token: {e}", "invalid_token") from None
        sub = claims.get("sub")
        # Without a subject, rate limits fall back to the client's address (see limits).
        principal = Principal(f"sub:{sub}" if isinstance(sub, str) and sub else "", read, write)
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()
        # (exp is a number, maybe an int too large for a float: compared, never converted)
        self._cache[key] = (principal, min(claims["exp"], now + CACHE_SECONDS))
        return principal
