"""Access control over real processes: an ingester and a reader with the same auth settings
(static tokens, HS256, RS256 from a JWKS file, ES256 from a JWKS URL served by a local
aiohttp server), private prefixes and buckets, the internal token. The matrix sends every
kind of credential to every method and surface, through the reader and straight to the
ingester; then private caching, forks of private streams, /_ds3/, CORS, start-up errors,
`ds3 dev`, and the logs (no token may appear in them). Pure rules have unit tests at the end."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from shared.auth.authenticate import Authenticator
from shared.auth.policy import (
    Grant,
    Policy,
    Principal,
    Target,
    fork_source_target,
    grants_from_claims,
    parse_grant,
    target_of,
)
from shared.config import AuthConfig, ConfigError
from shared.errors import Forbidden, Unauthorized
from tests.cluster import Cluster, StoreView, await_for, reader_metrics
from tests.procs import DS3, free_port

TIMEOUT = aiohttp.ClientTimeout(total=20)
SECRET = "hs256-shared-secret-for-tests-0123456789abcdef"
INTERNAL = "internal-token-for-tests-0123456789"
WRONG_INTERNAL = "not-the-internal-token-000"
ISSUER, AUDIENCE = "https://issuer.test", "ds3-tests"
ZERO = "0000000000000000_0000000000000000"

# Every surface the matrix covers: (name, URL path, reads are private)
SURFACES = [
    ("stream", "/v1/stream/pub/x", False),
    ("private stream", "/v1/stream/secret/x", True),
    ("bucket", "/v1/buckets/pubb", False),
    ("private bucket", "/v1/buckets/privb", True),
    ("bucket stream", "/v1/buckets/pubb/s1", False),
    ("private bucket stream", "/v1/buckets/privb/s1", True),
    ("listing", "/v1/buckets/pubb/streams", False),
    ("snapshot", f"/v1/stream/pub/x/snapshot/{ZERO}", False),
    ("private snapshot", f"/v1/stream/secret/x/snapshot/{ZERO}", True),
    ("bucket snapshot", f"/v1/buckets/pubb/s1/snapshot/{ZERO}", False),
    ("private bucket snapshot", f"/v1/buckets/privb/s1/snapshot/{ZERO}", True),
]
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE"]
RIGHT = ["stream:pub/", "stream:secret/", "bucket:pubb", "bucket:privb"]
WRONG = ["stream:other/", "bucket:othr"]
PRIVATE = ["stream:secret/", "bucket:privb"]


# ---------------------------------------------------------------- keys, tokens, a JWKS server


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _claims(grants: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    now = int(time.time())
    out: dict[str, Any] = {"sub": "someone", "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 3600}
    if grants is not None:
        out["ds3"] = {"read": grants, "write": grants}
    out.update(extra)
    return {k: v for k, v in out.items() if v is not None}


@dataclass
class Keys:
    rsa_key: rsa.RSAPrivateKey
    rsa_other: rsa.RSAPrivateKey
    ec_key: ec.EllipticCurvePrivateKey
    ec_other: ec.EllipticCurvePrivateKey

    @classmethod
    def generate(cls) -> Keys:
        return cls(rsa.generate_private_key(65537, 2048), rsa.generate_private_key(65537, 2048),
                   ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1()))

    def rsa_jwks(self) -> dict[str, Any]:
        jwk = RSAAlgorithm.to_jwk(self.rsa_key.public_key(), as_dict=True)
        return {"keys": [{**jwk, "kid": "rsa1", "use": "sig", "alg": "RS256"}]}

    def ec_jwks(self) -> dict[str, Any]:
        jwk = ECAlgorithm.to_jwk(self.ec_key.public_key(), as_dict=True)
        return {"keys": [{**jwk, "kid": "ec1", "use": "sig"}]}

    def hs(self, claims: dict[str, Any], secret: str = SECRET) -> str:
        return jwt.encode(claims, secret, algorithm="HS256")

    def rs(self, claims: dict[str, Any], key: rsa.RSAPrivateKey | None = None) -> str:
        return jwt.encode(claims, key or self.rsa_key, algorithm="RS256", headers={"kid": "rsa1"})

    def es(self, claims: dict[str, Any], key: ec.EllipticCurvePrivateKey | None = None, kid: str = "ec1") -> str:
        return jwt.encode(claims, key or self.ec_key, algorithm="ES256", headers={"kid": kid})

    def hs_with_rsa_public_key(self, claims: dict[str, Any]) -> str:
        """The classic algorithm confusion: HS256 'signed' with the RSA public key as secret
        (pyjwt refuses to make one, so the test builds it by hand)."""
        pem = self.rsa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo)
        head = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa1"}).encode())
        body = _b64(json.dumps(claims).encode())
        sig = hmac.new(pem, f"{head}.{body}".encode(), hashlib.sha256).digest()
        return f"{head}.{body}.{_b64(sig)}"

    @staticmethod
    def unsigned(claims: dict[str, Any]) -> str:
        return jwt.encode(claims, "", algorithm="none")


class JwksServer:
    """A JWK Set on http://127.0.0.1:<port>/jwks.json, served by aiohttp on its own thread
    (the ds3 processes fetch it while the test's loop may be blocked); counts fetches."""

    def __init__(self, jwks: dict[str, Any]) -> None:
        self.jwks = jwks
        self.port = free_port()
        self.fetches = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/jwks.json"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def jwks(request: web.Request) -> web.Response:
            self.fetches += 1
            return web.json_response(self.jwks)

        app = web.Application()
        app.router.add_get("/jwks.json", jwks)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> JwksServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# ---------------------------------------------------------------- the cluster


@dataclass
class AuthCluster:
    cluster: Cluster
    keys: Keys
    jwks: JwksServer
    admin: str  # a static token that may do anything
    creds: dict[str, str | None]  # name -> Authorization header value (None: none sent)

    def tokens(self) -> list[str]:
        """Every credential the tests send (to look for in the logs)."""
        out = [self.admin.split(" ", 1)[1], INTERNAL, WRONG_INTERNAL, SECRET]
        out += [v.split(" ", 1)[1] for v in self.creds.values() if v and v.startswith("Bearer ")]
        return out


STATIC = [
    {"token": "static-admin-token-0123456789", "sub": "admin", "read": ["*"], "write": ["*"]},
    {"token": "static-right-token-0123456789", "sub": "static-right", "read": RIGHT, "write": RIGHT},
    {"token": "static-wrong-token-0123456789", "sub": "static-wrong", "read": WRONG, "write": WRONG},
]


def _credentials(k: Keys) -> dict[str, str | None]:
    now = int(time.time())
    bearer = "Bearer {}".format
    scope_right = " ".join(f"read:{g} write:{g}" for g in RIGHT)
    scope_wrong = " ".join(f"read:{g} write:{g}" for g in WRONG)
    return {
        "none": None,
        "none:basic": "Basic dXNlcjpwYXNzd29yZA==",  # another scheme: no credentials of ours (RFC 6750 3.1)
        # bad: 401 invalid_token
        "bad:garbage": bearer("garbage"),
        "bad:three-parts": bearer("a.b.c"),
        "bad:hs256-signature": bearer(k.hs(_claims(RIGHT), secret="another-secret-that-is-long-enough-000")),
        "bad:rs256-signature": bearer(k.rs(_claims(RIGHT), key=k.rsa_other)),
        "bad:es256-signature": bearer(k.es(_claims(RIGHT), key=k.ec_other)),
        "bad:expired": bearer(k.hs(_claims(RIGHT, exp=now - 3600, iat=now - 7200))),
        "bad:no-exp": bearer(k.hs(_claims(RIGHT, exp=None))),
        "bad:not-yet-valid": bearer(k.rs(_claims(RIGHT, nbf=now + 3600))),
        "bad:wrong-issuer": bearer(k.hs(_claims(RIGHT, iss="https://evil.test"))),
        "bad:wrong-audience": bearer(k.es(_claims(RIGHT, aud="someone-else"))),
        "bad:alg-none": bearer(Keys.unsigned(_claims(RIGHT))),
        "bad:alg-confusion": bearer(k.hs_with_rsa_public_key(_claims(RIGHT))),
        "bad:es256-under-rsa-kid": bearer(k.es(_claims(RIGHT), kid="rsa1")),
        "bad:unknown-kid": bearer(k.es(_claims(RIGHT), kid="nope")),
        "bad:bad-claim": bearer(k.hs(_claims(None, ds3={"read": ["bogus:grant"]}))),
        # valid, without the scope: 403 where it matters
        "wrong:static": bearer("static-wrong-token-0123456789"),
        "wrong:hs256": bearer(k.hs(_claims(None, scope=f"openid {scope_wrong}"))),
        "wrong:rs256": bearer(k.rs(_claims(WRONG))),
        "wrong:es256": bearer(k.es(_claims(WRONG))),
        # valid, with the scope
        "right:static": bearer("static-right-token-0123456789"),
        "right:hs256": bearer(k.hs(_claims(None, scope=f"openid {scope_right}"))),
        "right:rs256": bearer(k.rs(_claims(RIGHT))),
        "right:es256": bearer(k.es(_claims(RIGHT))),
    }


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthCluster]:
    work = tmp_path_factory.mktemp("auth")
    keys = Keys.generate()
    (work / "tokens.json").write_text(json.dumps(STATIC))
    (work / "jwks.json").write_text(json.dumps(keys.rsa_jwks()))
    with JwksServer(keys.ec_jwks()) as jwks:
        access = [
            "--tokens-file", str(work / "tokens.json"), "--jwks-file", str(work / "jwks.json"),
            "--jwks-url", jwks.url, "--jwt-issuer", ISSUER, "--jwt-audience", AUDIENCE,
            "--private", PRIVATE[0], "--private", PRIVATE[1], "--write-rate", "0", "--create-rate", "0",
            "--log-level", "debug",
        ]
        # secrets through the environment, as the README recommends
        env = {"DS3_JWT_SECRET": SECRET, "DS3_INTERNAL_TOKEN": INTERNAL}
        c = Cluster(work, StoreView.local(work / "objects"), seal_bytes=1024, seal_age=0.3,
                    ingester_args=access, reader_args=access)
        c.ingester.env.update(env)
        c.reader.env.update(env)
        with c:
            yield AuthCluster(c, keys, jwks, "Bearer static-admin-token-0123456789", _credentials(keys))


async def _setup(s: aiohttp.ClientSession, base: str, admin: str) -> None:
    h = {"Authorization": admin, "Content-Type": "text/plain"}
    for path in ("/v1/buckets/pubb", "/v1/buckets/privb"):
        async with s.put(base + path, headers={"Authorization": admin}) as r:
            assert r.status in (201, 409), await r.text()
    for path in ("/v1/stream/pub/x", "/v1/stream/secret/x", "/v1/buckets/pubb/s1", "/v1/buckets/privb/s1"):
        async with s.put(base + path, headers=h, data=b"hello") as r:
            assert r.status in (200, 201, 409), f"{path}: {r.status} {await r.text()}"


def _expected(cred: str, method: str, private: bool) -> str:
    needs = method not in ("GET", "HEAD") or private
    if cred.startswith("none"):
        return "401" if needs else "ok"
    if cred.startswith("bad:"):
        return "401-invalid"
    if cred.startswith("wrong:"):
        return "403" if needs else "ok"
    return "ok"


def _outcome(status: int, headers: Any) -> str:
    if status == 401:
        challenge = headers.get("WWW-Authenticate", "")
        assert challenge.startswith('Bearer realm="ds3"'), challenge
        return "401-invalid" if "error=" in challenge else "401"
    if status == 403:
        assert "insufficient_scope" in headers.get("WWW-Authenticate", "")
        return "403"
    return "ok"


@pytest.mark.parametrize("via", ["reader", "ingester"])
async def test_auth_matrix(auth: AuthCluster, via: str) -> None:
    base = auth.cluster.reader.url if via == "reader" else auth.cluster.ingester.url
    wrong: list[str] = []
    checked = 0
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await _setup(s, base, auth.admin)
        # writers last: a DELETE that succeeds must not hide what the others would have seen
        for cred in sorted(auth.creds, key=lambda c: c.startswith("right:")):
            value = auth.creds[cred]
            for name, path, private in SURFACES:
                for method in METHODS:
                    headers = {"Content-Type": "text/plain"}
                    if value is not None:
                        headers["Authorization"] = value
                    body = b"data" if method in ("POST", "PUT") else None
                    async with s.request(method, base + path, headers=headers, data=body) as r:
                        await r.read()
                        got = _outcome(r.status, r.headers)
                        want = _expected(cred, method, private)
                        checked += 1
                        if got != want:
                            wrong.append(f"{cred} {method} {name} ({path}): want {want}, got {r.status}")
                        if got == "ok" and private and method in ("GET", "HEAD") and r.status < 400:
                            cache = r.headers.get("Cache-Control", "")
                            if "public" in cache or "immutable" in cache:
                                wrong.append(f"{cred} {method} {name}: private but Cache-Control {cache!r}")
    assert checked == len(auth.creds) * len(SURFACES) * len(METHODS)
    assert not wrong, f"{len(wrong)} of {checked} wrong:\n  " + "\n  ".join(wrong[:60])


async def test_jwks_url_is_cached(auth: AuthCluster) -> None:
    """The JWKS URL is fetched at start and again only for unknown kids, at most once per
    cooldown: a thousand ES256 requests, and a flood of made-up kids, cost a few fetches."""
    url = auth.cluster.ingester.url + "/v1/stream/pub/x"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        before = auth.jwks.fetches
        for _ in range(50):
            async with s.head(url, headers={"Authorization": auth.creds["right:es256"] or ""}) as r:
                assert r.status in (200, 404)  # (the matrix may have deleted it)
        assert auth.jwks.fetches == before, "a known kid must not fetch the JWK Set"
        for i in range(20):
            bad = auth.keys.es(_claims(RIGHT), kid=f"made-up-{i}")
            async with s.head(url, headers={"Authorization": f"Bearer {bad}"}) as r:
                assert r.status == 401
        assert auth.jwks.fetches - before <= 1, f"{auth.jwks.fetches - before} fetches for made-up kids"
    assert 1 <= auth.jwks.fetches <= 6


async def _sealed(s: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> aiohttp.ClientResponse:
    async def got() -> aiohttp.ClientResponse | None:
        r = await s.get(url, params={"offset": ZERO}, headers=headers)
        await r.read()
        return r if r.status == 200 and "ETag" in r.headers and r.headers["ETag"].count(".") == 3 else None

    found: aiohttp.ClientResponse = await await_for(got, 20, f"a sealed read of {url}")
    return found


async def test_private_streams_are_never_cacheable(auth: AuthCluster) -> None:
    """Sealed ranges of a private stream are served from the object store by the reader, with
    `Cache-Control: private` and `Vary: Authorization`; the same read of a public stream is
    immutable. Every other private response (304, HEAD, the start URL, long-poll, SSE,
    straight from the ingester) is private too."""
    admin = {"Authorization": auth.admin}
    reader, ingester = auth.cluster.reader.url, auth.cluster.ingester.url
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await _setup(s, reader, auth.admin)
        for path in ("/v1/stream/pub/big", "/v1/stream/secret/big", "/v1/buckets/privb/big"):
            async with s.put(reader + path, headers={**admin, "Content-Type": "text/plain"}) as r:
                assert r.status in (200, 201), await r.text()
            for _ in range(3):
                async with s.post(reader + path, headers={**admin, "Content-Type": "text/plain"},
                                  data=b"x" * 800) as r:
                    assert r.status == 204

        public = await _sealed(s, reader + "/v1/stream/pub/big", admin)
        assert "immutable" in public.headers["Cache-Control"] and "public" in public.headers["Cache-Control"]

        for path in ("/v1/stream/secret/big", "/v1/buckets/privb/big"):
            url = reader + path
            sealed_before = reader_metrics(reader)["ds3_reader_sealed_responses_total"]
            r = await _sealed(s, url, admin)
            assert r.headers["Cache-Control"] == "private, no-cache", r.headers["Cache-Control"]
            assert "Authorization" in r.headers.get("Vary", "")
            assert reader_metrics(reader)["ds3_reader_sealed_responses_total"] > sealed_before, \
                "the private sealed range must still come from the object store"
            async with s.get(url, params={"offset": ZERO}) as anon:
                assert anon.status == 401
            async with s.get(url, params={"offset": ZERO},
                             headers={**admin, "If-None-Match": r.headers["ETag"]}) as r304:
                assert r304.status == 304
                assert r304.headers["Cache-Control"] == "private, no-cache"
            checks = [
                ("HEAD", url, {}), ("GET", url, {"offset": "-1"}),
                ("GET", url, {"offset": ZERO, "live": "long-poll"}),
                ("GET", ingester + path, {"offset": ZERO}), ("GET", ingester + path, {"offset": "-1"}),
            ]
            for method, u, params in checks:
                async with s.request(method, u, params=params, headers=admin) as rr:
                    await rr.read()
                    cache = rr.headers.get("Cache-Control", "")
                    assert rr.status in (200, 204), (method, u, params, rr.status)
                    assert "public" not in cache and "immutable" not in cache, (method, u, params, cache)
                    assert cache.startswith("private") or cache == "no-store", (method, u, params, cache)
            async with s.get(url, params={"offset": "-1", "live": "sse"}, headers=admin) as sse:
                assert sse.status == 200
                assert sse.headers["Cache-Control"].startswith("private")
                first = await asyncio.wait_for(sse.content.readuntil(b"\n\n"), 10)
                assert first.startswith(b"event: data"), first


async def test_forking_a_private_stream_needs_read_scope_on_it(auth: AuthCluster) -> None:
    k = auth.keys
    write_only = k.hs(_claims(None, ds3={"write": ["stream:pub/"], "read": ["stream:pub/"]}))
    both = k.hs(_claims(None, ds3={"write": ["stream:pub/"], "read": ["stream:secret/"]}))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await _setup(s, auth.cluster.reader.url, auth.admin)
        for base in (auth.cluster.reader.url, auth.cluster.ingester.url):
            headers = {"Content-Type": "text/plain", "Stream-Forked-From": "/v1/stream/secret/x"}
            async with s.put(f"{base}/v1/stream/pub/fork-{free_port()}",
                             headers={**headers, "Authorization": f"Bearer {write_only}"}) as r:
                assert r.status == 403, await r.text()
                assert "secret/x" in await r.text()
            async with s.put(f"{base}/v1/stream/pub/fork-{free_port()}",
                             headers={**headers, "Authorization": f"Bearer {both}"}) as r:
                assert r.status == 201, await r.text()


async def test_a_prefix_grant_does_not_open_the_stream_named_by_the_prefix(auth: AuthCluster) -> None:
    """A grant on `secret/x/` covers `secret/x/...`, not `secret/x` itself, and neither do
    its extension URLs: `secret/x/snapshot/{offset}` and `secret/x/bootstrap` are `secret/x`'s
    (a prefix grant once let a tenant PUT a snapshot over the stream's history and read a
    private stream whole through its bootstrap; found by QA)."""
    k = auth.keys
    tenant = k.hs(_claims(None, ds3={"write": ["stream:secret/x/"], "read": ["stream:secret/x/"]}))
    owner = k.hs(_claims(None, ds3={"write": ["stream:secret/"], "read": ["stream:secret/"]}))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await _setup(s, auth.cluster.reader.url, auth.admin)
        for base in (auth.cluster.reader.url, auth.cluster.ingester.url):
            stream = f"{base}/v1/stream/secret/x"
            async with s.head(stream, headers={"Authorization": f"Bearer {owner}"}) as r:
                tail = r.headers["Stream-Next-Offset"]
            for method, url, body in [("PUT", f"{stream}/snapshot/{tail}", b"forged"),
                                      ("GET", f"{stream}/snapshot/{tail}", None),
                                      ("GET", f"{stream}/bootstrap", None),
                                      ("GET", f"{stream}?offset=-1", None)]:
                headers = {"Authorization": f"Bearer {tenant}", "Content-Type": "text/plain"}
                async with s.request(method, url, headers=headers, data=body) as r:
                    text = await r.text()
                    assert r.status == 403, (base, method, url, r.status, text)
                    assert "'secret/x'" in text, text  # the refusal names the stream, not its URL's tail
            # the stream's own grant still opens its bootstrap
            async with s.get(f"{stream}/bootstrap", headers={"Authorization": f"Bearer {owner}"}) as r:
                assert r.status == 200, await r.text()
            # a public stream's bootstrap needs no token, whatever private prefixes exist
            async with s.get(f"{base}/v1/stream/pub/x/bootstrap") as r:
                assert r.status == 200, await r.text()


async def test_a_reader_with_the_wrong_internal_token_blames_itself_not_the_client(tmp_path: Path) -> None:
    """The ingester refuses a reader's internal token that is not its own (401 invalid_token).
    Passed on, that told a client with a valid token that its token was invalid, and the
    reader said nothing; now the client gets 503 (the server's configuration), the reader's log
    and /readyz name the internal token (found by QA)."""
    (tmp_path / "tokens.json").write_text(json.dumps(STATIC))
    access = ["--tokens-file", str(tmp_path / "tokens.json"), "--write-rate", "0", "--create-rate", "0"]
    c = Cluster(tmp_path, StoreView.local(tmp_path / "objects"), ingester_args=access, reader_args=access)
    c.ingester.env.update({"DS3_INTERNAL_TOKEN": INTERNAL})
    c.reader.env.update({"DS3_INTERNAL_TOKEN": WRONG_INTERNAL + "-but-long-enough-0123456789"})
    admin = {"Authorization": "Bearer static-admin-token-0123456789", "Content-Type": "text/plain"}
    with c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.put(c.ingester.url + "/v1/stream/pub/w", headers=admin) as r:
                assert r.status == 201, await r.text()  # (the client's token is fine)
            for method, path, body in [("POST", "/v1/stream/pub/w", b"x"),  # the fast lane
                                       ("HEAD", "/v1/stream/pub/w", None),
                                       ("GET", "/v1/stream/pub/w?offset=now", None),  # aiohttp's path
                                       ("PUT", "/v1/stream/pub/w2", None)]:
                async with s.request(method, c.reader.url + path, headers=admin, data=body) as r:
                    text = await r.text()
                    assert r.status == 503 and "Retry-After" in r.headers, (method, path, r.status, text)
                    assert "WWW-Authenticate" not in r.headers, (method, path, r.headers)
                    assert method == "HEAD" or "configuration error" in text, text
            async with s.get(c.reader.url + "/readyz") as r:
                ready = await r.json()
                assert r.status == 503 and "internal token" in ready["checks"]["ingester"], ready
    log = c.reader.log_path.read_text()
    assert "refused this reader's internal token" in log, log[-2000:]


async def test_internal_endpoints_need_the_internal_token(auth: AuthCluster) -> None:
    url = auth.cluster.ingester.url + "/_ds3/touch?path=pub/x"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await _setup(s, auth.cluster.reader.url, auth.admin)
        async with s.post(url) as r:
            assert r.status == 401
        async with s.post(url, headers={"Authorization": auth.admin}) as r:
            assert r.status == 401, "a client token is not the internal token"
        async with s.post(url, headers={"DS3-Internal-Token": WRONG_INTERNAL}) as r:
            assert r.status == 401
            assert "invalid_token" in r.headers["WWW-Authenticate"]
        async with s.post(url, headers={"DS3-Internal-Token": INTERNAL}) as r:
            assert r.status == 204
        # the internal token reads private streams but never writes on its own authority
        async with s.get(auth.cluster.ingester.url + "/v1/stream/secret/x", params={"offset": "-1"},
                         headers={"DS3-Internal-Token": INTERNAL}) as r:
            assert r.status == 200
        async with s.post(auth.cluster.ingester.url + "/v1/stream/pub/x", data=b"x",
                          headers={"DS3-Internal-Token": INTERNAL, "Content-Type": "text/plain"}) as r:
            assert r.status == 401
        # the reader does not take the internal token from clients (nor forward it)
        async with s.get(auth.cluster.reader.url + "/v1/stream/secret/x", params={"offset": "-1"},
                         headers={"DS3-Internal-Token": INTERNAL}) as r:
            assert r.status == 401


async def test_cors_preflight_needs_no_token(auth: AuthCluster) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for base in (auth.cluster.reader.url, auth.cluster.ingester.url):
            for path in ("/v1/stream/secret/x", "/v1/buckets/privb/s1", "/v1/buckets/privb"):
                async with s.options(base + path, headers={
                    "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                }) as r:
                    assert r.status == 204, (base, path, r.status)
                    allowed = [h.strip().lower() for h in r.headers["Access-Control-Allow-Headers"].split(",")]
                    assert "authorization" in allowed
            async with s.get(base + "/v1/stream/secret/x", params={"offset": "-1"}) as r:
                assert "WWW-Authenticate" in r.headers["Access-Control-Expose-Headers"]


async def test_undecodable_credentials_are_refused_not_crashed_on(auth: AuthCluster) -> None:
    """Header bytes that are not UTF-8, huge tokens, odd schemes: 401, never a 500."""
    from tests.test_http import raw_request

    weird: list[dict[str, str | bytes]] = [
        {"Authorization": b"Bearer \xff\xfe\x80abc"},
        {"Authorization": b"Bearer eyJ\xff.eyJ\xfe.sig"},
        {"Authorization": "Bearer " + "a" * 6000},
        {"Authorization": "Bearer"},
        {"Authorization": "bearer   "},
        {"Authorization": "Negotiate abc"},
    ]
    ingester_only: list[dict[str, str | bytes]] = [{"DS3-Internal-Token": b"\xff\xfe"}]
    for proc in (auth.cluster.reader, auth.cluster.ingester):
        for headers in weird + (ingester_only if proc is auth.cluster.ingester else []):
            r = await raw_request(proc.port, "POST", b"/v1/stream/pub/x", {**headers, "Content-Type": "text/plain"},
                                  b"x")
            assert r.status == 401, (proc.args[0], headers, r.status, r.body[:200])


def _hs_by_hand(header: dict[str, Any], claims: dict[str, Any] | list[Any]) -> str:
    """An HS256 token with a correct signature over any header and claims (pyjwt would refuse
    to make most of these)."""
    head, body = _b64(json.dumps(header).encode()), _b64(json.dumps(claims).encode())
    sig = hmac.new(SECRET.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(sig)}"


ODD_VALUES: list[Any] = [["HS256"], {"HS256": 1}, 1, 1.5, True, None, "", "x" * 300, 10**400, -1, [["a"]]]


async def test_tokens_of_the_wrong_shape_are_refused_not_crashed_on(auth: AuthCluster) -> None:
    """An `alg` that is a list or an object (unhashable) was a 500 with a traceback, for
    anyone; an `exp` larger than a float overflowed once verified. Now: 401 invalid_token."""
    good = _claims(RIGHT)
    tokens = [_hs_by_hand({"alg": ["HS256"], "typ": "JWT"}, good), _hs_by_hand({"alg": {"HS256": 1}}, good),
              _hs_by_hand({"alg": "HS256"}, {**good, "exp": "99999999999"})]
    huge_exp = _hs_by_hand({"alg": "HS256"}, {**good, "exp": 10**400})
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        await _setup(s, auth.cluster.ingester.url, auth.admin)
        for proc in (auth.cluster.reader, auth.cluster.ingester):
            for token in tokens:
                async with s.post(proc.url + "/v1/stream/pub/x", data=b"x", headers={
                        "Authorization": f"Bearer {token}", "Content-Type": "text/plain"}) as r:
                    assert r.status == 401, (proc.args[0], token, r.status, await r.text())
                    assert "invalid_token" in r.headers["WWW-Authenticate"]
            async with s.get(proc.url + "/v1/stream/secret/x", params={"offset": "-1"},
                             headers={"Authorization": f"Bearer {huge_exp}"}) as r:
                assert r.status == 200, (proc.args[0], r.status, await r.text())


async def test_every_header_and_claim_of_the_wrong_type_is_a_clean_answer() -> None:
    """Each JWT header parameter and claim set to each JSON type: the token is refused with
    Unauthorized or accepted, never another exception (a 500)."""
    authn = Authenticator(AuthConfig(jwt_secret=SECRET, jwt_issuer=ISSUER, jwt_audience=AUDIENCE))
    good = _claims(RIGHT)
    tokens = {f"header {name}={v!r:.20}": _hs_by_hand({"alg": "HS256", "typ": "JWT", name: v}, good)
              for name in ("alg", "kid", "typ", "crit", "b64", "jku", "x5u", "cty", "jwk") for v in ODD_VALUES}
    tokens |= {f"claim {name}={v!r:.20}": _hs_by_hand({"alg": "HS256"}, {**good, name: v})
               for name in ("exp", "nbf", "iat", "iss", "aud", "sub", "ds3", "scope") for v in [*ODD_VALUES, "123"]}
    tokens["claims are a list"] = _hs_by_hand({"alg": "HS256"}, [good])
    accepted = []
    for case, token in tokens.items():
        try:
            await authn.authenticate(f"Bearer {token}")
            accepted.append(case)
        except Unauthorized:
            pass
    # the values a careful reading of RFC 7519 accepts (times are numbers; sub any string)
    for case in accepted:
        assert case.startswith(("header typ", "header b64", "header jku", "header x5u", "header cty", "header jwk",
                                "header kid=''", "header kid='xxx", "claim nbf", "claim iat", "claim sub",
                                "claim exp=1000", "claim ds3=None", "claim ds3={", "claim scope")), case
    for refused in ("header alg=['HS256']", "header alg={'HS256': 1}", "claim exp='123'", "claim exp=True",
                    "claim nbf='123'", "claim iat=True"):
        assert refused not in accepted


def test_tokens_never_appear_in_the_logs(auth: AuthCluster) -> None:
    """Runs after the tests above (same module): every token they sent, good or bad, and
    the secrets, are absent from both processes' logs (at debug level)."""
    logs = "".join(p.log_path.read_text(errors="replace") for p in (auth.cluster.ingester, auth.cluster.reader))
    assert "auth is on" in logs  # the logs are the right ones, and say auth is on
    leaked = [t[:12] + "..." for t in auth.tokens() if t in logs]
    signatures = [t.rsplit(".", 1)[-1] for t in auth.tokens() if t.count(".") == 2 and len(t) > 40]
    leaked += [sig[:12] + "..." for sig in signatures if sig and sig in logs]
    assert not leaked, f"tokens in the logs: {leaked}"


# ---------------------------------------------------------------- start-up


def _ds3(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DS3_")}
    full_env.update(env or {})
    return subprocess.run([DS3, *args], capture_output=True, text=True, timeout=60, env=full_env, check=False)


@pytest.mark.parametrize(
    ("args", "env", "setting"),
    [
        (["--jwt-secret", "short"], {}, "jwt-secret (DS3_JWT_SECRET)"),
        ([], {"DS3_JWT_SECRET": "short"}, "jwt-secret (DS3_JWT_SECRET)"),
        (["--tokens", "[{\"token\": \"tiny\"}]"], {}, "tokens (DS3_TOKENS)"),
        (["--tokens", "not json"], {}, "tokens (DS3_TOKENS)"),
        (["--tokens-file", "/nonexistent/tokens.json"], {}, "tokens-file (DS3_TOKENS_FILE)"),
        (["--jwks-url", "file:///etc/passwd"], {}, "jwks-url (DS3_JWKS_URL)"),
        (["--private", "stream:secret/"], {}, "private (DS3_PRIVATE)"),
        (["--jwt-secret", SECRET, "--private", "bucket:NO"], {}, "private (DS3_PRIVATE)"),
        (["--write-rate", "-1"], {}, "write-rate (DS3_WRITE_RATE)"),
        (["--trusted-proxies", "not-an-ip"], {}, "trusted-proxies (DS3_TRUSTED_PROXIES)"),
    ],
)
def test_bad_auth_settings_are_refused_at_start(tmp_path: Path, args: list[str], env: dict[str, str],
                                                setting: str) -> None:
    r = _ds3("ingester", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"), *args, env=env)
    assert r.returncode == 2, r.stderr
    assert setting in r.stderr, r.stderr


def test_bad_jwks_file_and_reader_without_internal_token(tmp_path: Path) -> None:
    bad = tmp_path / "jwks.json"
    bad.write_text('{"keys": []}')
    r = _ds3("ingester", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"), "--jwks-file", str(bad))
    assert r.returncode == 2 and "jwks-file (DS3_JWKS_FILE)" in r.stderr, r.stderr
    r = _ds3("reader", "--port", str(free_port()), "--ingester", "http://127.0.0.1:1",
             "--store", (tmp_path / "o").as_uri(), env={"DS3_JWT_SECRET": SECRET})
    assert r.returncode == 2 and "internal-token (DS3_INTERNAL_TOKEN)" in r.stderr, r.stderr


def test_dev_says_auth_is_off(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "dev.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([DS3, "dev", "--port", str(port), "--data-dir", str(tmp_path / "d")],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "ds3 dev ready" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
        time.sleep(0.2)
        text = log.read_text()
        assert "auth is off" in text and "DS3_JWT_SECRET" in text, text
        # and it is zero-config: anyone may write
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/stream/dev-check", method="PUT",
                                     headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 201
    finally:
        proc.terminate()
        proc.wait(20)


# ---------------------------------------------------------------- the rules, unit by unit


def test_targets_decode_like_the_handlers() -> None:
    assert target_of("/v1/stream/a/b%20c") == Target(None, "a/b c")
    assert target_of("/v1/buckets/pubb") == Target("pubb", None)
    assert target_of("/v1/buckets/pubb/") == Target("pubb", None)
    assert target_of("/v1/buckets/pubb/streams") == Target("pubb", None)
    assert target_of("/v1/buckets/pubb/s%2F1") == Target("pubb", "s/1")
    # an extension URL targets its stream (a grant on `chat/` does not cover `chat`'s snapshots)
    assert target_of("/v1/buckets/pubb/s1/snapshot/x") == Target("pubb", "s1")
    assert target_of("/v1/buckets/pubb/s1/bootstrap") == Target("pubb", "s1")
    assert target_of(f"/v1/stream/chat/snapshot/{ZERO}") == Target(None, "chat")
    assert target_of("/v1/stream/chat/snapshot/%FF") == Target(None, "chat")
    assert target_of("/v1/stream/chat/bootstrap") == Target(None, "chat")
    assert target_of("/v1/stream/chat/room/bootstrap") == Target(None, "chat/room")
    assert target_of("/v1/stream/chat/snapshotx") == Target(None, "chat/snapshotx")
    assert target_of("/healthz") is None
    # decoded like a request's URL path, plain or bucketed (plain ones were taken as is)
    assert fork_source_target("/v1/stream/a%20b") == Target(None, "a b")
    assert fork_source_target("/v1/stream/pct%2541") == Target(None, "pct%41")
    assert fork_source_target("/v1/stream/bad%FF") is None  # (refused with a 400 by the ingester)
    assert fork_source_target("/v1/buckets/pubb/a%20b?x") == Target("pubb", "a b")
    assert fork_source_target("elsewhere") is None


def test_grants() -> None:
    assert parse_grant("*") == Grant("all")
    assert parse_grant("stream:chat/*") == parse_grant("stream:chat/") == Grant("stream", prefix="chat/")
    assert parse_grant("bucket:*") == Grant("bucket")
    assert parse_grant("bucket:abcd") == Grant("bucket", "abcd", None)
    assert parse_grant("bucket:abcd/u-") == Grant("bucket", "abcd", "u-")
    for bad in ("", "read", "stream", "bucket:AB", "bucket:abc", "table:x", "bucket:abcd!"):
        with pytest.raises(ValueError):
            parse_grant(bad)
    chat = parse_grant("stream:chat/")
    assert chat.covers(Target(None, "chat/a")) and not chat.covers(Target(None, "chatty"))
    assert not chat.covers(Target("chat", "a"))
    b = parse_grant("bucket:abcd")
    assert b.covers(Target("abcd", None)) and b.covers(Target("abcd", "x")) and not b.covers(Target("abce", "x"))
    bp = parse_grant("bucket:abcd/u-")
    assert bp.covers(Target("abcd", "u-1")) and not bp.covers(Target("abcd", "v-1"))
    assert not bp.covers(Target("abcd", None)), "a prefix grant does not cover the bucket itself"
    assert parse_grant("bucket:*").covers(Target("zzzz", None)) and not parse_grant("bucket:*").covers(
        Target(None, "a"))


def test_claims() -> None:
    read, write = grants_from_claims({"scope": "openid read:stream:a/ write:bucket:abcd profile"})
    assert read == (Grant("stream", prefix="a/"),) and write == (Grant("bucket", "abcd", None),)
    read, write = grants_from_claims({"ds3": {"read": ["*"]}})
    assert read == (Grant("all"),) and write == ()
    for bad in ({"ds3": ["*"]}, {"ds3": {"read": "*"}}, {"scope": ["read:*"]}, {"ds3": {"write": ["nope"]}}):
        with pytest.raises(ValueError):
            grants_from_claims(bad)


def test_policy() -> None:
    policy = Policy.from_config(AuthConfig(jwt_secret=SECRET, private=("stream:secret/", "bucket:abcd/p-")))
    reader = Principal("r", (parse_grant("stream:secret/"),), ())
    writer = Principal("w", (), (parse_grant("stream:pub/"),))
    pub, sec = Target(None, "pub/a"), Target(None, "secret/a")
    assert policy.check("GET", pub, None) is False
    assert policy.check("GET", sec, reader) is True
    assert policy.check("GET", sec, None, internal=True) is True
    with pytest.raises(Unauthorized):
        policy.check("GET", sec, None)
    with pytest.raises(Forbidden):
        policy.check("GET", sec, writer)
    with pytest.raises(Unauthorized):
        policy.check("POST", pub, None, internal=True)
    with pytest.raises(Forbidden):
        policy.check("POST", pub, reader)
    assert policy.check("POST", pub, writer) is False
    with pytest.raises(Forbidden):
        policy.check("PUT", pub, writer, fork_source=sec)
    # a private prefix inside a bucket makes the bucket's listing private too
    assert policy.is_private(Target("abcd", None)) and not policy.is_private(Target("abcd", "q-1"))
    assert policy.is_private(Target("abcd", "p-1"))
    off = Policy.from_config(AuthConfig())
    assert off.check("DELETE", pub, None) is False
    with pytest.raises(ConfigError, match="private"):
        Policy.from_config(AuthConfig(jwt_secret=SECRET, private=("nope",)))
