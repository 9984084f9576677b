"""JWT verification with pyjwt: HS256 with a shared secret, RS256 / ES256 with public keys
from a JWK Set file or URL. Every signature check is pyjwt's; this module only picks the
key (by the token's `kid`) and the one algorithm that key may sign with, so a token cannot
choose its own algorithm (no `none`, no HS256 signed with an RSA public key)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Final

import jwt
from jwt import PyJWK, PyJWKClient, PyJWKSet

from shared.config import AuthConfig, ConfigError
from shared.errors import Unauthorized, Unavailable

log = logging.getLogger("ds3.auth")
ASYMMETRIC: Final = frozenset({"RS256", "ES256"})
REFETCH_COOLDOWN: Final = 30.0  # an unknown kid refetches a JWKS URL at most this often


def _invalid(why: str) -> Unauthorized:
    return Unauthorized(f"invalid token: {why[:200]}", "invalid_token")


def index_keys(jwks: PyJWKSet) -> dict[str | None, PyJWK]:
    """Signing keys by kid (None for a key without one), RS256 / ES256 keys only."""
    out: dict[str | None, PyJWK] = {}
    for k in jwks.keys:
        use = k._jwk_data.get("use") if isinstance(k._jwk_data, dict) else None
        if k.algorithm_name in ASYMMETRIC and use in (None, "sig"):
            out[k.key_id] = k
    return out


def pick_key(keys: dict[str | None, PyJWK], kid: Any) -> PyJWK | None:
    if kid is not None:
        return keys.get(kid) if isinstance(kid, str) else None
    return next(iter(keys.values())) if len(keys) == 1 else None  # no kid: only if unambiguous


def load_jwks_file(config: AuthConfig) -> dict[str | None, PyJWK]:
    setting = "jwks-file (DS3_JWKS_FILE)"
    assert config.jwks_file is not None
    try:
        keys = index_keys(PyJWKSet.from_json(config.jwks_file.read_text(encoding="utf-8")))
    except OSError as e:
        raise ConfigError(f"{setting}: cannot read {config.jwks_file}: {e.strerror}") from None
    except (ValueError, jwt.PyJWTError) as e:
        raise ConfigError(f"{setting}: not a usable JWK Set ({e})") from None
    if not keys:
        raise ConfigError(f"{setting}: no RS256 or ES256 signing key in {config.jwks_file}")
    return keys


class JwksUrlKeys:
    """Public keys from a JWKS URL. PyJWKClient fetches them (in a worker thread: it blocks);
    they are kept for `ttl` seconds, and a token naming an unknown kid refetches at most once
    per REFETCH_COOLDOWN, so made-up kids cannot make the server hammer the identity
    provider. If a refetch fails the keys already known stay in use."""

    def __init__(self, url: str, ttl: float) -> None:
        self.url = url
        self.ttl = ttl
        self._client = PyJWKClient(url, cache_jwk_set=False, timeout=5)
        self._keys: dict[str | None, PyJWK] = {}
        self._fetched = -math.inf  # monotonic time of the last successful fetch
        self._attempted = -math.inf  # ... and of the last attempt
        self._lock = asyncio.Lock()

    async def key(self, kid: Any) -> PyJWK | None:
        now = time.monotonic()
        found = pick_key(self._keys, kid)
        stale = now - self._fetched > self.ttl
        # With no keys at all (the provider was down at start) retry every second, else at
        # most once per cooldown: for an unknown kid, and for a set past its lifetime.
        min_interval = 1.0 if not self._keys else REFETCH_COOLDOWN
        if (found is None or stale) and now - self._attempted >= min_interval:
            await self.refresh(now)
            found = pick_key(self._keys, kid)
        if found is None and not self._keys:
            raise Unavailable("cannot check the token: the signing keys (JWKS URL) are unavailable", 5)
        return found

    async def refresh(self, asked_at: float) -> None:
        async with self._lock:
            if self._attempted >= asked_at:
                return  # another request refreshed while this one waited
            self._attempted = time.monotonic()
            try:
                jwks = await asyncio.to_thread(self._client.get_jwk_set, True)
                keys = index_keys(jwks)
            except (jwt.PyJWTError, ValueError, OSError) as e:
                log.warning("fetching the JWK Set from %s failed: %s", self.url, e)
                return
            self._keys = keys
            self._fetched = time.monotonic()
            log.info("loaded %d signing key(s) from %s", len(keys), self.url)


class JwtVerifier:
    def __init__(self, config: AuthConfig) -> None:
        self.secret = config.jwt_secret
        self.issuer = config.jwt_issuer
        self.audience = config.jwt_audience
        self.leeway = config.jwt_leeway
        self.file_keys = load_jwks_file(config) if config.jwks_file is not None else None
        self.url_keys = JwksUrlKeys(config.jwks_url, config.jwks_cache_seconds) if config.jwks_url else None

    async def warm(self) -> None:
        """Fetch the JWKS URL's keys at start (a failure is logged; requests retry)."""
        if self.url_keys is not None:
            await self.url_keys.refresh(time.monotonic())

    async def verify(self, token: str) -> dict[str, Any]:
        """The token's claims, or Unauthorized("invalid_token"). Requires `exp`."""
        try:
            header = jwt.get_unverified_header(token)
        except (jwt.PyJWTError, ValueError):  # ValueError: bytes that are not UTF-8
            raise _invalid("not a JWT") from None
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str):  # (a list or object would not even be hashable)
            raise _invalid("its alg header must be a string")
        key: Any
        if alg == "HS256" and self.secret is not None:
            key, algorithm = self.secret, "HS256"
        elif alg in ASYMMETRIC and (self.file_keys is not None or self.url_keys is not None):
            found = pick_key(self.file_keys, kid) if self.file_keys is not None else None
            if found is None and self.url_keys is not None:
                found = await self.url_keys.key(kid)
            if found is None:
                raise _invalid("no signing key matches its kid")
            key, algorithm = found.key, found.algorithm_name
        else:
            raise _invalid(f"algorithm {str(alg)[:20]!r} is not accepted here")
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key, algorithms=[algorithm], audience=self.audience, issuer=self.issuer,
                leeway=self.leeway, options={"require": ["exp"]},
            )
        except jwt.ExpiredSignatureError:
            raise _invalid("the token has expired") from None
        except (jwt.PyJWTError, ValueError) as e:
            raise _invalid(str(e)) from None
        for name in ("exp", "nbf", "iat"):  # pyjwt also takes "123" or true; RFC 7519 wants numbers
            if name in claims and not is_numeric_date(claims[name]):
                raise _invalid(f"the {name} claim must be a number of seconds")
        return claims


def is_numeric_date(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)  # (may exceed a float: never converted)
