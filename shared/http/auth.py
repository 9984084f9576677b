"""Access control for aiohttp apps (ingester and reader alike): a middleware that
authenticates the caller and applies the policy (shared/auth/policy.py), and a response hook that
keeps private responses out of shared caches.

A reader checks its callers itself and forwards their Authorization header, so the
ingester checks writes again with the same settings; the reader adds the internal token
(INTERNAL_HEADER), which lets it read private streams for callers it has checked and call
/_ds3/ endpoints, but never write on its own authority."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

from aiohttp import web

from shared import protocol as P
from shared.auth.authenticate import Authenticator
from shared.auth.policy import INTERNAL_PREFIX, Principal, fork_source_target, target_of
from shared.config import AuthConfig
from shared.errors import BadRequest, Unauthorized

log = logging.getLogger("ds3.auth")

AUTH: Final = web.AppKey("ds3_auth", Authenticator)
ACCEPTS_INTERNAL: Final = web.AppKey("ds3_accepts_internal", bool)
INTERNAL_HEADER: Final = "DS3-Internal-Token"
CALLER: Final = web.RequestKey("ds3_caller", Principal)  # the authenticated caller, if any
INTERNAL: Final = web.RequestKey("ds3_internal", bool)  # a reader sent the internal token
PRIVATE: Final = web.RequestKey("ds3_private", bool)  # the response must not be shared
PRIVATE_CACHE: Final = "private, no-cache"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def caller_of(request: web.Request) -> Principal | None:
    return request.get(CALLER)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method == "OPTIONS":  # CORS preflights carry no credentials
        return await handler(request)
    if len(request.headers.getall("Authorization", ())) > 1:
        # Only the first would be checked, and the rest forwarded: a token that is sent is
        # always checked, so which one counts must not be a guess.
        raise BadRequest("send one Authorization header, not several")
    authn = request.app[AUTH]
    # Only the ingester takes the internal token: on a public reader it would be one more
    # credential to guess, and the reader never forwards it.
    presented = request.headers.get(INTERNAL_HEADER) if request.app[ACCEPTS_INTERNAL] else None
    if presented is not None:
        if not authn.is_internal(presented):
            log.warning("a request to %r carried a wrong internal token", request.path)
            raise Unauthorized("invalid internal token", "invalid_token")
        request[INTERNAL] = True
    raw = request.raw_path.split("?", 1)[0]
    if raw.startswith(INTERNAL_PREFIX):
        if (authn.enabled or authn.has_internal_token) and presented is None:
            raise Unauthorized("this endpoint serves ds3 readers: send the internal token")
        return await handler(request)
    if not authn.enabled:  # before parsing the target: this is every request of `ds3 dev`
        return await handler(request)
    target = target_of(raw)
    if target is None:
        return await handler(request)
    caller = await authn.caller(request.headers.get("Authorization"))
    if caller is not None:
        request[CALLER] = caller
    fork = request.headers.get(P.FORKED_FROM) if request.method == "PUT" else None
    private = authn.policy.check(
        request.method, target, caller, internal=request.get(INTERNAL, False),
        fork_source=fork_source_target(fork) if fork is not None else None,
    )
    if private:
        request[PRIVATE] = True
    return await handler(request)


async def private_cache_headers(request: web.Request, response: web.StreamResponse) -> None:
    """A private stream's responses (sealed ranges, 304s, SSE, forwarded ones alike) are never
    `public` or `immutable`: only the caller's own browser may keep them, revalidating."""
    if not request.get(PRIVATE):
        return
    h = response.headers
    cache, vary = private_cache_values(h.get("Cache-Control", ""), h.get("Vary", ""))
    h["Cache-Control"] = cache
    if vary is not None:
        h["Vary"] = vary


def private_cache_values(cache_control: str, vary: str) -> tuple[str, str | None]:
    """A private answer's Cache-Control, and its Vary (None: as it is) given theirs."""
    cache = "no-store" if "no-store" in cache_control else PRIVATE_CACHE
    names = [v.strip() for v in vary.split(",") if v.strip()]
    if "authorization" in (v.lower() for v in names):
        return cache, None
    return cache, ", ".join([*names, "Authorization"])


def private_head(head: bytes) -> bytes:
    """Serialised header lines (b"Name: value\\r\\n" each) made private as
    private_cache_headers makes a response's headers: Cache-Control and Vary replaced in place,
    or added after the rest."""
    lines: list[bytes | None] = list(head.split(b"\r\n")[:-1])
    first: dict[bytes, int] = {}
    values: dict[bytes, str] = {}
    for i, line in enumerate(lines):
        assert line is not None
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name in (b"cache-control", b"vary"):
            if name in first:
                lines[i] = None  # (one of each is left, as a multidict's assignment leaves it)
            else:
                first[name] = i
                values[name] = value.strip().decode("latin-1")
    cache, vary = private_cache_values(values.get(b"cache-control", ""), values.get(b"vary", ""))
    for name, label, new in ((b"cache-control", b"Cache-Control: ", cache), (b"vary", b"Vary: ", vary)):
        if new is None:
            continue
        line = label + new.encode("latin-1")
        if name in first:
            lines[first[name]] = line
        else:
            lines.append(line)
    return b"".join(line + b"\r\n" for line in lines if line is not None)


def private_headers(headers: dict[str, str]) -> dict[str, str]:
    """A copy of `headers` made private as private_cache_headers makes a response's."""
    out = dict(headers)
    names = {k.lower(): k for k in out}
    cache, vary = private_cache_values(out.get(names.get("cache-control", ""), ""), out.get(names.get("vary", ""), ""))
    out[names.get("cache-control", "Cache-Control")] = cache
    if vary is not None:
        out[names.get("vary", "Vary")] = vary
    return out


def install(app: web.Application, config: AuthConfig, *, accepts_internal: bool) -> Authenticator:
    """Add access control to `app` (after errors_middleware, so refusals become 401/403).
    Loading the credential sources happens here: a ConfigError names the bad setting.
    `accepts_internal`: the ingester, which readers call with the internal token."""
    authn = Authenticator(config)
    app[AUTH] = authn
    app[ACCEPTS_INTERNAL] = accepts_internal
    app.middlewares.append(auth_middleware)
    app.on_response_prepare.append(private_cache_headers)

    async def warm(app: web.Application) -> AsyncIterator[None]:
        # Fetch the JWKS URL's keys early, without holding up the start if the provider is slow.
        assert authn.jwt is not None
        task = asyncio.create_task(authn.jwt.warm(), name="ds3-jwks-warm")
        yield
        task.cancel()

    if authn.jwt is not None:
        app.cleanup_ctx.append(warm)
    return authn


def describe(config: AuthConfig) -> str:
    """One line for the start-up log (no secrets)."""
    if not config.enabled:
        return "auth is off: anyone may write; set --tokens-file, --jwt-secret, --jwks-file or --jwks-url to require tokens"
    sources = [name for name, on in (
        ("static tokens", config.tokens_file is not None or config.tokens is not None),
        ("HS256 JWT", config.jwt_secret is not None),
        ("JWKS file", config.jwks_file is not None),
        ("JWKS URL", config.jwks_url is not None),
    ) if on]
    private = ", ".join(config.private) if config.private else "none"
    return f"auth is on ({', '.join(sources)}): writes need a token; private reads: {private}"
