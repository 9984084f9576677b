"""The fast lanes with auth on (shared/http/lane.py Lane.authorized), against real processes:
an ingester with its lane and one without (DS3_FAST_LANE=0), each with a reader in front of
it (the first with its lane, the second without), all four with the same static tokens, HS256
secret, private prefix and internal token. Every request goes to both sides byte for byte:
status, headers and body must match, and the lane must have taken exactly the requests it can
judge at once (a known token or none; private streams' answers with their private cache
headers); the rest, refusals included, are aiohttp's."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import procs
from tests.rawhttp import STREAM_OFFSET, exchange, parsed, post, put

SECRET = "hs256-shared-secret-for-lane-tests-0123456789"
INTERNAL = "internal-token-for-lane-tests-0123456789"
ADMIN = "Authorization: Bearer lane-admin-token-0123456789"
RIGHT = "Authorization: Bearer lane-right-token-0123456789"
WRONG = "Authorization: Bearer lane-wrong-token-0123456789"
STATIC = [
    {"token": "lane-admin-token-0123456789", "sub": "admin", "read": ["*"], "write": ["*"]},
    {"token": "lane-right-token-0123456789", "sub": "right", "read": ["stream:pub/", "stream:secret/"],
     "write": ["stream:pub/", "stream:secret/"]},
    {"token": "lane-wrong-token-0123456789", "sub": "wrong", "read": ["stream:other/"], "write": ["stream:other/"]},
]
TEXT = "Content-Type: text/plain"
RID = "X-Request-Id: lane-auth-0123456789"


def hs256(claims: dict[str, object]) -> str:
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." + b64(json.dumps(claims).encode())
    sig = hmac.new(SECRET.encode(), signing.encode(), hashlib.sha256).digest()
    return f"{signing}.{b64(sig)}"


class Side:
    def __init__(self, ingester: procs.Proc, reader: procs.Proc) -> None:
        self.ingester, self.reader = ingester, reader


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Side, Side]]:
    root = tmp_path_factory.mktemp("laneauth")
    (root / "tokens.json").write_text(json.dumps(STATIC))
    access = ["--tokens-file", str(root / "tokens.json"), "--private", "stream:secret/", "--write-rate", "0",
              "--create-rate", "0", "--log-format", "json", "--access-log", "--jwt-leeway", "0"]
    made = []
    for name in ("fast", "slow"):
        store = f"file://{root / name / 'objects'}"
        ing = procs.ingester(root / name / "wal", "--store", store, *access)
        rd = procs.reader(root / name / "reader", ing.url, store, *access)
        for p in (ing, rd):
            p.env.update({"DS3_JWT_SECRET": SECRET, "DS3_INTERNAL_TOKEN": INTERNAL})
            if name == "slow":
                p.env["DS3_FAST_LANE"] = "0"
        made.append(Side(ing, rd))
    started: list[procs.Proc] = []
    try:
        for side in made:
            for p in (side.ingester, side.reader):
                p.start()
                started.append(p)
        yield made[0], made[1]
    finally:
        for p in reversed(started):
            p.stop()


def _metric(p: procs.Proc, name: str) -> float:
    with urllib.request.urlopen(f"{p.url}/metrics", timeout=5) as r:
        m = re.search(rf"^{name} (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def lane_taken(p: procs.Proc, reader: bool) -> float:
    """Requests the process's lane answered (`reader` kept for the call sites' clarity)."""
    return _metric(p, "ds3_http_fast_lane_requests_total")


def head(path: str, *headers: str) -> bytes:
    return (f"HEAD {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode("latin-1")


def _normal(answer: bytes, suffix: str) -> tuple[int, dict[str, str], bytes]:
    status, headers, body = parsed(answer)
    if "etag" in headers:
        headers["etag"] = re.sub(r'^"\d+\.', '"SID.', headers["etag"])
    return (status, {k: STREAM_OFFSET.sub(b"O", v.replace(suffix, "").encode()).decode() for k, v in headers.items()},
            STREAM_OFFSET.sub(b"O", body.replace(suffix.encode(), b"")))


def _jwt(scope: str) -> str:
    """A new token each call (its jti), not yet verified by any server."""
    now = int(time.time())
    return "Authorization: Bearer " + hs256({"sub": "jwt-user", "scope": scope, "exp": now + 600, "iat": now,
                                             "jti": str(time.monotonic_ns())})

# (name, the request for a stream path (its suffix added), whether the lane takes it, the status)
CASES: list[tuple[str, object, bool, int]] = [
    ("append, a token that may", lambda p: post(f"/v1/stream/pub/{p}", b"x", TEXT, RIGHT, RID), True, 204),
    ("append, the admin token", lambda p: post(f"/v1/stream/pub/{p}", b"x", TEXT, ADMIN, RID), True, 204),
    ("append, no token", lambda p: post(f"/v1/stream/pub/{p}", b"x", TEXT, RID), False, 401),
    ("append, a token that may not", lambda p: post(f"/v1/stream/pub/{p}", b"x", TEXT, WRONG, RID), False, 403),
    ("append, an unknown token", lambda p: post(f"/v1/stream/pub/{p}", b"x", TEXT,
                                                "Authorization: Bearer nobody-0123456789", RID), False, 401),
    ("append, basic auth", lambda p: post(f"/v1/stream/pub/{p}", b"x", TEXT,
                                          "Authorization: Basic dXNlcjpwYXNzd29yZA==", RID), False, 401),
    ("append, an empty bearer", lambda p: post(f"/v1/stream/pub/{p}", b"x", TEXT, "Authorization: Bearer ", RID),
     False, 401),
    ("append to a private stream", lambda p: post(f"/v1/stream/secret/{p}", b"x", TEXT, RIGHT, RID), True, 204),
    ("append to a private stream, refused", lambda p: post(f"/v1/stream/secret/{p}", b"x", TEXT, WRONG, RID),
     False, 403),
    ("a private stream's append conflicts", lambda p: post(f"/v1/stream/secret/{p}", b"x", "Content-Type: text/html",
                                                            RIGHT, RID), True, 409),
    ("head, public, no token", lambda p: head(f"/v1/stream/pub/{p}", RID), True, 200),
    ("head, public, a token that may not", lambda p: head(f"/v1/stream/pub/{p}", WRONG, RID), True, 200),
    ("head, public, an unknown token", lambda p: head(f"/v1/stream/pub/{p}", "Authorization: Bearer nobody-1", RID),
     False, 401),
    ("head, private, no token", lambda p: head(f"/v1/stream/secret/{p}", RID), False, 401),
    ("head, private, a token that may", lambda p: head(f"/v1/stream/secret/{p}", RIGHT, RID), True, 200),
    # two Authorization headers: only the first was checked (a token that is sent is always checked)
    ("head, private, two tokens", lambda p: head(f"/v1/stream/secret/{p}", RIGHT, "Authorization: Bearer nope", RID),
     False, 400),
    ("append, two tokens", lambda p: post(f"/v1/stream/pub/{p}", b"x", TEXT, RIGHT, WRONG, RID), False, 400),
]


def _setup(port: int, suffix: str) -> None:
    for path in (f"/v1/stream/pub/{suffix}", f"/v1/stream/secret/{suffix}"):
        assert parsed(exchange(port, put(path, TEXT, ADMIN))[0])[0] == 201
        assert parsed(exchange(port, post(path, b"first", TEXT, ADMIN))[0])[0] == 204


@pytest.mark.parametrize("via", ["reader", "ingester"])
@pytest.mark.parametrize(("make", "taken", "status"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_lanes_judge_auth_as_aiohttp_does(sides: tuple[Side, Side], via: str, make: object, taken: bool,
                                              status: int) -> None:
    answers = []
    for side, suffix in zip(sides, ("zzfast", "zzslow"), strict=True):
        p = side.reader if via == "reader" else side.ingester
        name = f"{via}-{len(CASES)}-{suffix}-{time.monotonic_ns()}"
        _setup(p.port, name)
        request = make(name)  # type: ignore[operator]
        before = lane_taken(p, via == "reader")
        raw = exchange(p.port, request, bodiless=request.startswith(b"HEAD"))[0]
        assert b"\r\nX-Request-Id: lane-auth-0123456789\r\n" in raw
        if side is sides[0]:
            assert lane_taken(p, via == "reader") - before == (1 if taken else 0)
        answers.append(_normal(raw.replace(name.encode(), b"NAME"), name))
    assert answers[0][0] == status, answers[0]
    assert answers[0] == answers[1]
    if b"/secret/" in make("x") and status < 400:  # type: ignore[operator]
        assert answers[0][1]["cache-control"] in ("private, no-cache", "no-store")
        assert "Authorization" in answers[0][1]["vary"]


@pytest.mark.parametrize("via", ["reader", "ingester"])
def test_a_target_in_absolute_form_is_served_and_judged_as_its_path(sides: tuple[Side, Side], via: str) -> None:
    """RFC 9112 §3.2.2: a server must accept a request target in absolute form
    (`POST http://host/v1/stream/x`). It got 404 (every handler read the raw target); it is now
    the request for its path, auth's scopes and private streams included."""
    p = sides[0].reader if via == "reader" else sides[0].ingester
    name = f"abs-{via}-{time.monotonic_ns()}"
    _setup(p.port, name)

    def get(path: str, *headers: str) -> bytes:
        head = f"GET {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
        return head.encode("latin-1")

    public = f"http://127.0.0.1:{p.port}/v1/stream/pub/{name}"
    assert parsed(exchange(p.port, post(public, b"+ok", TEXT, RIGHT))[0])[0] == 204
    assert parsed(exchange(p.port, post(public, b"+no", TEXT, WRONG))[0])[0] == 403
    assert parsed(exchange(p.port, get(public + "?offset=-1"))[0])[::2] == (200, b"first+ok")
    secret = f"HTTP://elsewhere.example/v1/stream/secret/{name}?offset=-1"
    assert parsed(exchange(p.port, get(secret))[0])[0] == 401
    assert parsed(exchange(p.port, get(secret, WRONG))[0])[0] == 403
    assert parsed(exchange(p.port, get(secret, RIGHT))[0])[::2] == (200, b"first")


@pytest.mark.parametrize("via", ["reader", "ingester"])
def test_an_upgrade_request_is_answered_and_harms_no_other(sides: tuple[Side, Side], via: str) -> None:
    """A request with Upgrade (curl --http2 sends `Upgrade: h2c`) pipelined after an append the
    lane forwards: both are answered, in order. (Found by QA: httptools' HttpParserUpgrade escaped
    the lane, the connection got no answer, and in the reader it killed the pooled upstream
    connection, so other clients' stored appends were answered 503.)"""
    p = sides[0].reader if via == "reader" else sides[0].ingester
    name = f"upgrade-{via}-{time.monotonic_ns()}"
    _setup(p.port, name)
    path = f"/v1/stream/pub/{name}"
    upgrade = (f"GET {path}?offset=-1 HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
               "Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n").encode()
    answers = exchange(p.port, post(path, b"+up", TEXT, RIGHT) + upgrade, answers=2)
    assert [parsed(a)[0] for a in answers] == [204, 200]
    assert parsed(answers[1])[2] == b"first+up"
    assert parsed(exchange(p.port, post(path, b"+after", TEXT, RIGHT))[0])[0] == 204


@pytest.mark.parametrize("headers", [
    [],
    [("Cache-Control", "public, max-age=60")],
    [("Cache-Control", "no-store")],
    [("Cache-Control", "public, immutable"), ("Vary", "Accept-Encoding")],
    [("Vary", "authorization"), ("X-A", "1")],
    [("Cache-Control", "a"), ("X-B", "2"), ("Cache-Control", "b"), ("Vary", "Origin")],
])
async def test_private_header_rewrites_match_the_aiohttp_hook(headers: list[tuple[str, str]]) -> None:
    """The lanes' private_head / private_headers give what private_cache_headers gives a response."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from shared.http.auth import PRIVATE, private_cache_headers, private_head, private_headers

    request = make_mocked_request("GET", "/v1/stream/secret/x")
    request[PRIVATE] = True
    response = web.Response(headers=headers)
    await private_cache_headers(request, response)
    want = [(k.lower(), v) for k, v in response.headers.items() if k.lower() != "content-type"]
    head = b"".join(f"{k}: {v}\r\n".encode() for k, v in headers)
    got = [(k.decode().lower(), v.decode()) for k, _, v in
           (line.partition(b": ") for line in private_head(head).split(b"\r\n")[:-1])]
    assert got == want
    if len({k.lower() for k, _ in headers}) == len(headers):  # (a dict has no repeats)
        assert [(k.lower(), v) for k, v in private_headers(dict(headers)).items()] == want


@pytest.mark.parametrize("via", ["reader", "ingester"])
def test_a_jwt_takes_the_lane_once_it_was_verified(sides: tuple[Side, Side], via: str) -> None:
    """The first append with a JWT is verified on aiohttp's path; the next ones, the same token
    remembered, take the lane; a JWT without the scope is refused on aiohttp's path."""
    fast = sides[0].reader if via == "reader" else sides[0].ingester
    name = f"jwt-{via}-{time.monotonic_ns()}"
    _setup(fast.port, name)
    path = f"/v1/stream/pub/{name}"
    counts = [lane_taken(fast, via == "reader")]
    token = _jwt("read:stream:pub/ write:stream:pub/")
    for _ in range(3):
        assert parsed(exchange(fast.port, post(path, b"j", TEXT, token))[0])[0] == 204
        counts.append(lane_taken(fast, via == "reader"))
    assert [b - a for a, b in itertools.pairwise(counts)] == [0, 1, 1]
    refused = exchange(fast.port, post(path, b"j", TEXT, _jwt("read:stream:pub/")))[0]
    assert parsed(refused)[0] == 403
    assert lane_taken(fast, via == "reader") == counts[-1]


def test_a_wrong_internal_token_is_refused_by_the_ingester_and_not_taken(sides: tuple[Side, Side]) -> None:
    fast, slow = sides[0].ingester, sides[1].ingester
    answers = []
    for p, suffix in ((fast, "zzfast"), (slow, "zzslow")):
        name = f"internal-{suffix}"
        _setup(p.port, name)
        before = lane_taken(p, False)
        raw = exchange(p.port, post(f"/v1/stream/pub/{name}", b"x", TEXT, RIGHT, RID,
                                    "DS3-Internal-Token: not-the-token-0000"))[0]
        assert lane_taken(p, False) == before
        answers.append(_normal(raw, name))
    assert answers[0][0] == 401
    assert answers[0] == answers[1]
    good = exchange(fast.port, post("/v1/stream/pub/internal-zzfast", b"x", TEXT, RIGHT,
                                    f"DS3-Internal-Token: {INTERNAL}"))[0]
    assert parsed(good)[0] == 204


def test_rate_limits_count_a_token_s_subject_on_the_lane(tmp_path: Path) -> None:
    """Two connections from one address with one token share the token's write budget."""
    (tmp_path / "tokens.json").write_text(json.dumps(STATIC))
    ing = procs.ingester(tmp_path / "wal", "--tokens-file", str(tmp_path / "tokens.json"), "--write-rate", "1",
                         "--write-burst", "3", "--create-rate", "0")
    ing.start()
    try:
        _setup_plain = put("/v1/stream/pub/limited", TEXT, ADMIN)
        assert parsed(exchange(ing.port, _setup_plain)[0])[0] == 201
        before = lane_taken(ing, False)
        statuses = [parsed(exchange(ing.port, post("/v1/stream/pub/limited", b"x", TEXT, RIGHT))[0])[0]
                    for _ in range(5)]
        assert statuses[:3] == [204, 204, 204] and statuses[3:] == [429, 429]
        assert lane_taken(ing, False) - before == 5
        # the admin token is a subject of its own: its budget is untouched
        assert parsed(exchange(ing.port, post("/v1/stream/pub/limited", b"x", TEXT, ADMIN))[0])[0] == 204
    finally:
        ing.stop()


def test_the_lanes_log_the_token_s_subject(sides: tuple[Side, Side]) -> None:
    """An append the lanes take is logged with its caller's subject, as aiohttp's path logs it."""
    name = f"logged-{time.monotonic_ns()}"
    fast = sides[0]
    _setup(fast.reader.port, name)
    rid = f"X-Request-Id: lane-logged-{time.monotonic_ns()}"
    before = lane_taken(fast.ingester, False)
    assert parsed(exchange(fast.reader.port, post(f"/v1/stream/pub/{name}", b"x", TEXT, RIGHT, rid))[0])[0] == 204
    assert lane_taken(fast.ingester, False) == before + 1
    want = rid.split(": ")[1]
    for p in (fast.reader, fast.ingester):
        deadline = time.monotonic() + 10
        lines: list[dict[str, object]] = []
        while not lines and time.monotonic() < deadline:
            lines = [json.loads(line) for line in p.log_path.read_text().splitlines()
                     if want in line and '"ds3.access"' in line]
            time.sleep(0.05)
        assert lines and lines[0]["sub"] == "sub:right", (p.args[0], lines)  # (as aiohttp logs it)


@pytest.mark.parametrize("via", ["reader", "ingester"])
def test_a_jwt_that_expires_is_refused_though_the_lane_knew_it(sides: tuple[Side, Side], via: str) -> None:
    fast = sides[0].reader if via == "reader" else sides[0].ingester
    name = f"expiring-{via}-{time.monotonic_ns()}"
    _setup(fast.port, name)
    now = int(time.time())
    token = "Authorization: Bearer " + hs256({"sub": "brief", "scope": "write:stream:pub/", "exp": now + 2,
                                              "iat": now, "jti": name})
    path = f"/v1/stream/pub/{name}"
    assert parsed(exchange(fast.port, post(path, b"j", TEXT, token))[0])[0] == 204  # verified (aiohttp's)
    before = lane_taken(fast, via == "reader")
    assert parsed(exchange(fast.port, post(path, b"j", TEXT, token))[0])[0] == 204  # the lane's
    assert lane_taken(fast, via == "reader") == before + 1
    time.sleep(max(0.0, now + 2 - time.time()) + 0.2)
    answer = exchange(fast.port, post(path, b"j", TEXT, token))[0]
    assert parsed(answer)[0] == 401 and "invalid_token" in parsed(answer)[1]["www-authenticate"]
    assert lane_taken(fast, via == "reader") == before + 1
