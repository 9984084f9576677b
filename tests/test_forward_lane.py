"""The reader's forwarding lane (reader/forwardlane.py) against real processes: one ingester,
and two readers in front of it, one with the lane and one without (DS3_FAST_LANE=0: aiohttp
serves and forwards everything). Every request goes to both readers byte for byte; status,
headers and body must match (Date aside; the request id is the client's, so it matches too).
Then what only raw sockets show: pipelined appends and HEADs in order, bytes cut anywhere,
a client that leaves mid-body, an ingester that is down, keep-alive upstream connections."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import procs
from tests.rawhttp import (
    MIX_BYTES,
    STREAM_OFFSET,
    assert_every_mix_cut_answered_as,
    delete,
    exchange,
    mix_shape,
    parsed,
    pipeline,
    post,
    put,
    put_body,
    read_all,
)


class Tier:
    def __init__(self, ingester: procs.Proc, fast: procs.Proc, slow: procs.Proc) -> None:
        self.ingester, self.fast, self.slow = ingester, fast, slow


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tier]:
    root = tmp_path_factory.mktemp("forwardlane")
    store = f"file://{root / 'objects'}"
    ing = procs.ingester(root / "wal", "--store", store, "--write-rate", "0", "--max-body-bytes", "100000")
    fast = procs.reader(root / "fast", ing.url, store, "--write-rate", "0", "--max-body-bytes", "100000")
    slow = procs.reader(root / "slow", ing.url, store, "--write-rate", "0", "--max-body-bytes", "100000")
    slow.env["DS3_FAST_LANE"] = "0"
    started: list[procs.Proc] = []
    try:
        for p in (ing, fast, slow):
            p.start()
            started.append(p)
        yield Tier(ing, fast, slow)
    finally:
        for p in reversed(started):
            p.stop()


def metric(p: procs.Proc, name: str) -> float:
    with urllib.request.urlopen(f"{p.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else -1.0


def lane_count(p: procs.Proc) -> float:
    return metric(p, "ds3_http_fast_lane_requests_total")


def head(path: str, *headers: str) -> bytes:
    return (f"HEAD {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode("latin-1")


RID = "X-Request-Id: parity-0123456789"
TEXT = "Content-Type: text/plain"

# (name, setup requests, the request compared): each reader gets its own stream (a name suffix)
CASES: list[tuple[str, list[bytes], bytes]] = [
    ("plain", [put("/v1/stream/p1", TEXT)], post("/v1/stream/p1", b"abc", TEXT, RID)),
    ("json", [put("/v1/stream/j1", "Content-Type: application/json")],
     post("/v1/stream/j1", b'[{"a":1},{"b":2}]', "Content-Type: application/json", RID)),
    ("json invalid", [put("/v1/stream/j3", "Content-Type: application/json")],
     post("/v1/stream/j3", b"{nope", "Content-Type: application/json", RID)),
    ("missing stream", [], post("/v1/stream/absent", b"x", TEXT, RID)),
    ("content type mismatch", [put("/v1/stream/m1", TEXT)], post("/v1/stream/m1", b"x", "Content-Type: text/html", RID)),
    ("no content type", [put("/v1/stream/m2", TEXT)], post("/v1/stream/m2", b"x", RID)),
    ("empty body", [put("/v1/stream/e1", TEXT)], post("/v1/stream/e1", b"", TEXT, RID)),
    ("close", [put("/v1/stream/c1", TEXT)], post("/v1/stream/c1", b"last", TEXT, "Stream-Closed: true", RID)),
    ("append to closed", [put("/v1/stream/c2", TEXT, "Stream-Closed: true")], post("/v1/stream/c2", b"x", TEXT, RID)),
    ("producer new", [put("/v1/stream/pr1", TEXT)],
     post("/v1/stream/pr1", b"x", TEXT, "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 0", RID)),
    ("producer duplicate", [put("/v1/stream/pr2", TEXT),
                            post("/v1/stream/pr2", b"x", TEXT, "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 0")],
     post("/v1/stream/pr2", b"x", TEXT, "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 0", RID)),
    ("producer gap", [put("/v1/stream/pr3", TEXT)],
     post("/v1/stream/pr3", b"x", TEXT, "Producer-Id: w", "Producer-Epoch: 0", "Producer-Seq: 5", RID)),
    ("producer stale epoch", [put("/v1/stream/pr5", TEXT),
                              post("/v1/stream/pr5", b"x", TEXT, "Producer-Id: w", "Producer-Epoch: 3", "Producer-Seq: 0")],
     post("/v1/stream/pr5", b"x", TEXT, "Producer-Id: w", "Producer-Epoch: 1", "Producer-Seq: 0", RID)),
    ("producer bad headers", [put("/v1/stream/pr4", TEXT)], post("/v1/stream/pr4", b"x", TEXT, "Producer-Id: w", RID)),
    ("repeated Stream-Seq", [put("/v1/stream/rs", TEXT)],
     post("/v1/stream/rs", b"x", TEXT, "Stream-Seq: b", "Stream-Seq: a", RID)),
    ("stream seq regression", [put("/v1/stream/s1", TEXT), post("/v1/stream/s1", b"x", TEXT, "Stream-Seq: b")],
     post("/v1/stream/s1", b"x", TEXT, "Stream-Seq: a", RID)),
    ("bad path segment", [], post("/v1/stream/a//b", b"x", TEXT, RID)),
    ("over the body limit", [put("/v1/stream/big", "Content-Type: application/octet-stream")],
     post("/v1/stream/big", b"x" * 100_001, "Content-Type: application/octet-stream", RID)),
    ("at the body limit", [put("/v1/stream/big2", "Content-Type: application/octet-stream")],
     post("/v1/stream/big2", b"y" * 100_000, "Content-Type: application/octet-stream", RID)),
    ("a client's internal token", [put("/v1/stream/it", TEXT)],
     post("/v1/stream/it", b"x", TEXT, "DS3-Internal-Token: guess", RID)),
    ("forwarded for", [put("/v1/stream/ff", TEXT)],
     post("/v1/stream/ff", b"x", TEXT, "X-Forwarded-For: 203.0.113.9", RID)),
    ("unknown headers pass", [put("/v1/stream/uh", TEXT)],
     post("/v1/stream/uh", b"x", TEXT, "X-Custom: 1", "Accept-Encoding: gzip", "Connection: keep-alive", RID)),
    ("no request id", [put("/v1/stream/nr", TEXT)], post("/v1/stream/nr", b"x", TEXT)),
    ("a bad request id", [put("/v1/stream/br", TEXT)], post("/v1/stream/br", b"x", TEXT, "X-Request-Id: a b")),
    ("escaped path", [put("/v1/stream/e%20s", TEXT)], post("/v1/stream/e%20s", b"x", TEXT, RID)),
    ("head", [put("/v1/stream/h1", TEXT), post("/v1/stream/h1", b"abc", TEXT)], head("/v1/stream/h1", RID)),
    ("head json", [put("/v1/stream/h2", "Content-Type: application/json")], head("/v1/stream/h2", RID)),
    ("head closed", [put("/v1/stream/h3", TEXT, "Stream-Closed: true")], head("/v1/stream/h3", RID)),
    ("head ttl", [put("/v1/stream/h4", TEXT, "Stream-TTL: 3600")], head("/v1/stream/h4", RID)),
    ("head missing", [], head("/v1/stream/h-absent", RID)),
    ("head bad path", [], head("/v1/stream/a//b", RID)),
    ("head with If-None-Match", [put("/v1/stream/h5", TEXT)], head("/v1/stream/h5", 'If-None-Match: "x"', RID)),
    # creates and deletes (the lane's since 2026-11-26; a fork's create stays aiohttp's)
    ("create", [], put("/v1/stream/c-new", TEXT, RID)),
    ("create json", [], put("/v1/stream/c-json", "Content-Type: application/json", RID)),
    ("create, no content type", [], put("/v1/stream/c-none", RID)),
    ("create with data", [], put_body("/v1/stream/c-data", b"hello", TEXT, RID)),
    ("create json with data", [], put_body("/v1/stream/c-jdata", b'[{"a":1},{"b":2}]', "Content-Type: application/json", RID)),
    ("create json with bad data", [], put_body("/v1/stream/c-jbad", b"{nope", "Content-Type: application/json", RID)),
    ("create again, same", [put("/v1/stream/c-same", TEXT)], put("/v1/stream/c-same", TEXT, RID)),
    ("create again, other type", [put("/v1/stream/c-other", TEXT)], put("/v1/stream/c-other", "Content-Type: application/json", RID)),
    ("create closed", [], put("/v1/stream/c-closed", TEXT, "Stream-Closed: true", RID)),
    ("create with ttl", [], put("/v1/stream/c-ttl", TEXT, "Stream-TTL: 3600", RID)),
    ("create with expiry", [], put("/v1/stream/c-exp", TEXT, "Stream-Expires-At: 2099-01-01T00:00:00Z", RID)),
    ("create with ttl and expiry", [], put("/v1/stream/c-both", TEXT, "Stream-TTL: 60",
                                           "Stream-Expires-At: 2099-01-01T00:00:00Z", RID)),
    ("create with a bad ttl", [], put("/v1/stream/c-badttl", TEXT, "Stream-TTL: soon", RID)),
    ("create, invalid content type", [], put("/v1/stream/c-badct", "Content-Type: not a type", RID)),
    ("create, fork offset alone", [], put("/v1/stream/c-fo", TEXT, "Stream-Fork-Offset: 0000000000000000_0000000000000000", RID)),
    ("create a fork", [put("/v1/stream/c-src", TEXT), post("/v1/stream/c-src", b"abc", TEXT)],
     put("/v1/stream/c-fork", TEXT, "Stream-Forked-From: /v1/stream/c-src", RID)),
    ("create over the body limit", [], put_body("/v1/stream/c-big", b"x" * 100_001, TEXT, RID)),
    ("create, bad path segment", [], put("/v1/stream/a//b", TEXT, RID)),
    ("delete", [put("/v1/stream/d1", TEXT)], delete("/v1/stream/d1", RID)),
    ("delete missing", [], delete("/v1/stream/absent", RID)),
    ("delete twice", [put("/v1/stream/d2", TEXT), delete("/v1/stream/d2")], delete("/v1/stream/d2", RID)),
]


def _named(request: bytes, suffix: str) -> bytes:
    """`request` on the stream of one reader (its path with `suffix` added)."""
    first, rest = request.split(b"\r\n", 1)
    method, target, version = first.split(b" ")
    if target.endswith((b"/absent", b"/h-absent", b"a//b")):
        return request
    return b" ".join((method, target + suffix.encode(), version)) + b"\r\n" + rest


def _normal(answer: bytes, suffix: str) -> tuple[int, dict[str, str], bytes]:
    status, headers, body = parsed(answer)
    if "etag" in headers:  # names the stream's internal id
        headers["etag"] = re.sub(r'^"\d+\.', '"SID.', headers["etag"])
    if "stream-cursor" in headers:  # a 20 s interval's number: two answers may straddle a boundary
        assert headers["stream-cursor"].isdigit()
        headers["stream-cursor"] = "C"
    return (status, {k: STREAM_OFFSET.sub(b"O", v.replace(suffix, "").encode()).decode() for k, v in headers.items()},
            STREAM_OFFSET.sub(b"O", body.replace(suffix.encode(), b"")))


@pytest.mark.parametrize(("setup", "request_"), [(s, r) for _, s, r in CASES], ids=[c[0] for c in CASES])
def test_the_lane_forwards_as_aiohttp_does(tier: Tier, setup: list[bytes], request_: bytes) -> None:
    answers = []
    for p, suffix in ((tier.fast, "_zzfast"), (tier.slow, "_zzslow")):
        for r in setup:
            assert parsed(exchange(p.port, _named(r, suffix))[0])[0] < 300
        raw = exchange(p.port, _named(request_, suffix), bodiless=request_.startswith(b"HEAD"))[0]
        if RID.encode() in request_:
            assert b"\r\nX-Request-Id: parity-0123456789\r\n" in raw
        answers.append(_normal(raw, suffix))
    assert answers[0][0] == answers[1][0]
    assert sorted(answers[0][1].items()) == sorted(answers[1][1].items())
    assert answers[0][2] == answers[1][2]


def test_plain_requests_take_the_lane_and_upstream_connections_are_reused(tier: Tier) -> None:
    fast = tier.fast
    exchange(fast.port, put("/v1/stream/reuse", TEXT))
    before = lane_count(fast)
    with socket.create_connection(("127.0.0.1", fast.port)) as s:
        for i in range(200):
            s.sendall(post("/v1/stream/reuse", b"%d," % i, TEXT) if i % 2 == 0 else head("/v1/stream/reuse"))
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += s.recv(65536)
            assert buf.startswith((b"HTTP/1.1 204", b"HTTP/1.1 200")), buf[:200]
    assert lane_count(fast) - before == 200
    assert 1 <= metric(fast, "ds3_reader_lane_upstream_connections") <= 4
    assert read_all(fast.port, "/v1/stream/reuse") == b"".join(b"%d," % i for i in range(0, 200, 2))
    assert lane_count(tier.slow) == 0


def test_many_clients_appends_share_one_upstream_connection(tier: Tier) -> None:
    """24 clients appending at once: their appends go down the pipe (reader/upstream.py), not a
    connection each, and every client's appends land in its order."""
    fast = tier.fast
    paths = [f"/v1/stream/pipe-client-{i}" for i in range(24)]
    for path in paths:
        exchange(fast.port, put(path, TEXT))
    errors: list[BaseException] = []

    def client(path: str) -> None:
        try:
            with socket.create_connection(("127.0.0.1", fast.port), timeout=30) as s:
                for i in range(40):
                    s.sendall(post(path, b"%d," % i, TEXT))
                    buf = b""
                    while b"\r\n\r\n" not in buf:
                        buf += s.recv(65536)
                    assert buf.startswith(b"HTTP/1.1 204"), buf[:200]
        except BaseException as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(path,)) for path in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert metric(fast, "ds3_reader_lane_upstream_connections") <= 4
    expected = b"".join(b"%d," % i for i in range(40))
    assert all(read_all(fast.port, path) == expected for path in paths)


@pytest.mark.parametrize("n", [30, 2000])
def test_pipelined_appends_and_heads_are_answered_in_order(tier: Tier, n: int) -> None:
    """(aiohttp's path is slow with long pipelines: it is compared on 30.)"""
    for p in (tier.fast, tier.slow) if n <= 30 else (tier.fast,):
        path = f"/v1/stream/pipe-{n}-{p.port}"
        exchange(p.port, put(path, TEXT))
        burst = b"".join(post(path, b"%d," % i, TEXT) + (head(path) if i % 10 == 9 else b"") for i in range(n))
        answers = pipeline(p.port, [burst], n + n // 10)
        statuses = [parsed(a)[0] for a in answers]
        assert statuses == [204 if (i + 1) % 11 else 200 for i in range(len(answers))]
        assert read_all(p.port, path) == b"".join(b"%d," % i for i in range(n))
        offsets = [parsed(a)[1]["stream-next-offset"] for a in answers]
        assert offsets == sorted(offsets)


def test_a_pipelined_mix_cut_at_every_position_is_answered_as_by_aiohttp(tier: Tier) -> None:
    assert_every_mix_cut_answered_as(tier.slow.port, tier.fast.port)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=1, max_value=MIX_BYTES - 1), max_size=8, unique=True))
def test_a_pipelined_mix_cut_anywhere_is_answered_as_by_aiohttp(tier: Tier, cuts: list[int]) -> None:
    assert mix_shape(tier.slow.port, cuts, pause=0.001) == mix_shape(tier.fast.port, cuts, pause=0.001)


def test_a_client_that_leaves_mid_body_stores_nothing(tier: Tier) -> None:
    fast = tier.fast
    path = "/v1/stream/leaver"
    exchange(fast.port, put(path, TEXT))
    whole = post(path, b"0123456789", TEXT)
    with socket.create_connection(("127.0.0.1", fast.port)) as s:
        s.sendall(whole[:-4])
    # and one that leaves while its answer is on the way: the append stands, the reader goes on
    with socket.create_connection(("127.0.0.1", fast.port)) as s:
        s.sendall(post(path, b"kept", TEXT))
    assert parsed(exchange(fast.port, post(path, b"!", TEXT))[0])[0] == 204
    assert read_all(fast.port, path) in (b"kept!", b"!kept")


def test_an_ingester_that_is_down_is_a_503_like_aiohttp_s(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{procs.free_port()}"
    store = f"file://{tmp_path / 'objects'}"
    fast = procs.reader(tmp_path / "fast", dead, store)
    slow = procs.reader(tmp_path / "slow", dead, store)
    slow.env["DS3_FAST_LANE"] = "0"
    fast.start()
    try:
        slow.start()
        try:
            for request in (post("/v1/stream/d", b"x", TEXT, RID), head("/v1/stream/d", RID)):
                answers = [parsed(exchange(p.port, request, bodiless=request.startswith(b"HEAD"))[0])
                           for p in (fast, slow)]
                assert answers[0] == answers[1]
                assert answers[0][0] == 503 and answers[0][1]["retry-after"] == "2"
            assert lane_count(fast) == 2
        finally:
            slow.stop()
    finally:
        fast.stop()


AWAY = "X-Forwarded-For: 203.0.113.7"  # a client a trusted proxy (loopback) forwards: limited


def test_write_limits_refuse_as_aiohttp_does(tmp_path: Path, tier: Tier) -> None:
    store = f"file://{tmp_path / 'objects'}"
    limited = [procs.reader(tmp_path / n, tier.ingester.url, store, "--write-rate", "0.001", "--write-burst", "2")
               for n in ("fast", "slow")]
    limited[1].env["DS3_FAST_LANE"] = "0"
    exchange(tier.fast.port, put("/v1/stream/limited", TEXT))
    for p in limited:
        p.start()
    try:
        answers = []
        for p in limited:
            got = pipeline(p.port, [post("/v1/stream/limited", b"x", TEXT, RID, AWAY) * 3], 3)
            got += [exchange(p.port, post("/v1/stream/limited", b"x", TEXT, RID, AWAY))[0]]  # a new connection
            answers.append([_normal(a, "") for a in got])
        assert [a[0] for a in answers[0]] == [204, 204, 429, 429]
        assert answers[0][2:] == answers[1][2:]
        # what the refused appends carried is not stored
        assert read_all(tier.fast.port, "/v1/stream/limited") == b"xxxx"
    finally:
        for p in limited:
            p.stop()


def test_create_limits_refuse_as_aiohttp_does(tmp_path: Path, tier: Tier) -> None:
    store = f"file://{tmp_path / 'objects'}"
    limited = [procs.reader(tmp_path / n, tier.ingester.url, store, "--create-rate", "0.001", "--create-burst", "2")
               for n in ("fast", "slow")]
    limited[1].env["DS3_FAST_LANE"] = "0"
    for p in limited:
        p.start()
    try:
        answers = []
        for p in limited:
            paths = [f"/v1/stream/climit-{p.port}-{i}" for i in range(3)]
            got = pipeline(p.port, [b"".join(put(path, TEXT, RID, AWAY) for path in paths)], 3)
            answers.append([_normal(a, str(p.port)) for a in got])
            assert [parsed(exchange(p.port, head(path))[0])[0] for path in paths] == [200, 200, 404]
        assert [a[0] for a in answers[0]] == [201, 201, 429]
        assert answers[0][2] == answers[1][2]
    finally:
        for p in limited:
            p.stop()


def test_creates_and_deletes_take_the_lane_and_forks_do_not(tier: Tier) -> None:
    fast = tier.fast
    before = lane_count(fast)
    assert parsed(exchange(fast.port, put("/v1/stream/cd-lane", TEXT))[0])[0] == 201
    assert parsed(exchange(fast.port, post("/v1/stream/cd-lane", b"abc", TEXT))[0])[0] == 204
    assert lane_count(fast) - before == 2
    fork = put("/v1/stream/cd-fork", TEXT, "Stream-Forked-From: /v1/stream/cd-lane")
    assert parsed(exchange(fast.port, fork)[0])[0] == 201
    assert lane_count(fast) - before == 2  # a fork's create is aiohttp's (auth checks its source)
    assert read_all(fast.port, "/v1/stream/cd-fork") == b"abc"
    assert parsed(exchange(fast.port, delete("/v1/stream/cd-lane"))[0])[0] == 204
    assert lane_count(fast) - before == 3
    # deleted (its fork keeps its data, so it is gone rather than unknown), seen as such at once
    assert parsed(exchange(fast.port, head("/v1/stream/cd-lane"))[0])[0] == 410
    assert read_all(fast.port, "/v1/stream/cd-fork") == b"abc"


# ---------------------------------------------------------------- long-polls on the live channel
def long_poll(path: str, offset: str, *headers: str) -> bytes:
    return (f"GET {path}?offset={offset}&live=long-poll HTTP/1.1\r\nHost: t\r\n"
            + "".join(h + "\r\n" for h in headers) + "\r\n").encode("latin-1")


def live_gauge(p: procs.Proc) -> float:
    return metric(p, r'ds3_http_live_connections\{mode="long-poll"\}')


def _poll_after(p: procs.Proc, path: str, offset: str, then: bytes | None, *headers: str) -> bytes:
    """A long-poll at `offset`, and `then` (an append) sent once it is waiting."""
    import threading

    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.extend(exchange(p.port, long_poll(path, offset, *headers), timeout=20)))
    t.start()
    time.sleep(0.3)
    if then is not None:
        assert parsed(exchange(p.port, then)[0])[0] == 204
    t.join(25)
    assert out, "the long-poll got no answer"
    return out[0]


def test_long_polls_the_channel_answers_take_the_lane_and_answer_as_aiohttp_does(tier: Tier) -> None:
    answers = []
    for p, suffix in ((tier.fast, "_zzfast"), (tier.slow, "_zzslow")):
        path = "/v1/stream/lp" + suffix
        exchange(p.port, put(path, TEXT))
        tail = parsed(exchange(p.port, post(path, b"a", TEXT))[0])[1]["stream-next-offset"]
        # the first long-poll starts the stream's channel (aiohttp's path on both readers)
        first = parsed(_poll_after(p, path, tail, post(path, b"b", TEXT)))
        assert first[0] == 200 and first[2] == b"b"
        before = lane_count(p)
        # the next one, where the channel now polls: the fast reader's lane takes it
        raw = _poll_after(p, path, first[1]["stream-next-offset"], post(path, b"cd", TEXT), RID)
        assert b"\r\nX-Request-Id: parity-0123456789\r\n" in raw
        answers.append(_normal(raw, suffix))
        assert lane_count(p) - before == (2 if p is tier.fast else 0)  # the long-poll and the append
        assert live_gauge(p) == 0
    assert answers[0][0] == 200 and answers[0][2] == b"cd"
    assert sorted(answers[0][1].items()) == sorted(answers[1][1].items())
    assert answers[0][2] == answers[1][2]


@pytest.fixture(scope="module")
def quick_tier(tmp_path_factory: pytest.TempPathFactory, tier: Tier) -> Iterator[tuple[procs.Proc, procs.Proc]]:
    """Two readers (lane, no lane) whose long-polls time out after 1 s, on the tier's ingester."""
    root = tmp_path_factory.mktemp("quick")
    store = f"file://{root / 'objects'}"
    fast, slow = (procs.reader(root / n, tier.ingester.url, store, "--long-poll-timeout", "1", "--write-rate", "0")
                  for n in ("fast", "slow"))
    slow.env["DS3_FAST_LANE"] = "0"
    fast.start()
    try:
        slow.start()
        try:
            yield fast, slow
        finally:
            slow.stop()
    finally:
        fast.stop()


def test_a_long_poll_that_times_out_on_the_lane_is_aiohttp_s_204(quick_tier: tuple[procs.Proc, procs.Proc]) -> None:
    answers = []
    for p, suffix in zip(quick_tier, ("_zzfast", "_zzslow"), strict=True):
        path = "/v1/stream/lp204" + suffix
        exchange(p.port, put(path, TEXT))
        tail = parsed(exchange(p.port, post(path, b"a", TEXT))[0])[1]["stream-next-offset"]
        assert parsed(_poll_after(p, path, tail, None))[0] == 204  # starts the channel
        before = lane_count(p)
        answers.append(_normal(_poll_after(p, path, tail, None, RID), suffix))
        assert lane_count(p) - before == (1 if p is quick_tier[0] else 0)
    assert answers[0][0] == 204
    assert sorted(answers[0][1].items()) == sorted(answers[1][1].items())


def test_a_long_poll_client_that_leaves_frees_its_place(tier: Tier) -> None:
    fast = tier.fast
    path = "/v1/stream/lp-leaver"
    exchange(fast.port, put(path, TEXT))
    tail = parsed(exchange(fast.port, post(path, b"a", TEXT))[0])[1]["stream-next-offset"]
    first = parsed(_poll_after(fast, path, tail, post(path, b"b", TEXT)))
    at = first[1]["stream-next-offset"]
    before = lane_count(fast)
    socks = []
    for _ in range(20):  # waiting on the lane, then gone
        s = socket.create_connection(("127.0.0.1", fast.port))
        s.sendall(long_poll(path, at))
        socks.append(s)
    deadline = time.monotonic() + 5
    while live_gauge(fast) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_gauge(fast) == 20
    for s in socks:
        s.close()
    while live_gauge(fast) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_gauge(fast) == 0
    assert lane_count(fast) == before  # none was answered
    # the channel carries on for whoever comes next
    again = parsed(_poll_after(fast, path, at, post(path, b"c", TEXT)))
    assert again[0] == 200 and again[2] == b"c"


def test_garbage_after_pipelined_creates_answers_each_create_then_400(tier: Tier) -> None:
    """Requests aiohttp serves (creates), then a malformed one, in one write: each create gets
    its own 201 and is done, and only the malformed one the 400, at the reader and at the
    ingester. (aiohttp alone, the lane switched off, answers one 400 for the whole write: its
    parser drops the messages it had parsed from it.)"""
    bad = b"GET /v1/stream/x HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n"
    for p in (tier.fast, tier.ingester):
        paths = [f"/v1/stream/pipe-bad-{uuid.uuid4().hex}" for _ in range(2)]
        answers = exchange(p.port, b"".join(put(q, "Content-Type: text/plain") for q in paths) + bad, answers=3)
        assert [parsed(a)[0] for a in answers] == [201, 201, 400], p.args[0]
        for q in paths:
            assert parsed(exchange(p.port, head(q), bodiless=True)[0])[0] == 200


def _closed_after_answer(port: int, request: bytes) -> bytes:
    """The whole of what the server sent before closing the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return data


def test_connection_close_is_honoured_for_requests_without_a_body(tier: Tier) -> None:
    """A HEAD or a long-poll that asks for `Connection: close` is aiohttp's, and the connection
    closes after its answer. (Before: llhttp forgets `Connection: close` once a bodiless message
    is complete, the lane took them and kept the connection open.)"""
    fast = tier.fast
    path = "/v1/stream/closing"
    exchange(fast.port, put(path, TEXT))
    tail = parsed(exchange(fast.port, post(path, b"a", TEXT))[0])[1]["stream-next-offset"]
    first = parsed(_poll_after(fast, path, tail, post(path, b"b", TEXT)))  # the channel runs
    at = first[1]["stream-next-offset"]
    before = lane_count(fast)
    assert _closed_after_answer(fast.port, head(path, "Connection: close")).startswith(b"HTTP/1.1 200")
    assert _closed_after_answer(fast.port, post(path, b"c", TEXT, "Connection: close")).startswith(b"HTTP/1.1 204")
    got = _closed_after_answer(fast.port, long_poll(path, at, "Connection: close"))
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"c")
    assert lane_count(fast) == before


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_more_than_32_pipelined_requests_for_aiohttp_are_all_answered(tier: Tier, method: str) -> None:
    """aiohttp pauses reading at 32 queued pipelined requests and, as its queue drains, parses
    what it buffered meanwhile (its data_received(b"")). The lanes' connections used to swallow
    that call: the 33rd request and those after it waited for the keep-alive timeout."""
    for p in (tier.fast, tier.slow):
        path = f"/v1/stream/many-{method}-{p.port}"
        exchange(p.port, put(path, TEXT))
        one = f"{method} {path}?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n".encode()
        answers = pipeline(p.port, [one * 100], 100, timeout=10)
        assert [parsed(a)[0] for a in answers] == [200] * 100


# --- reads at the unsealed tail ------------------------------------------------------------


def get(path: str, query: str, *headers: str) -> bytes:
    return (f"GET {path}?{query} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def next_offset(p: procs.Proc, path: str) -> str:
    return parsed(exchange(p.port, head(path), bodiless=True)[0])[1]["stream-next-offset"]


@pytest.mark.parametrize("where", ["stream", "bucket"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/json"])
def test_reads_at_the_unsealed_tail_take_the_lane_and_answer_as_aiohttp_does(tier: Tier, content_type: str,
                                                                              where: str) -> None:
    """A catch-up read of what only the ingester holds, and the empty page at the end: the
    first asks the store (nothing sealed there), the next within a second is the lane's and
    answers byte for byte as aiohttp's path does."""
    ct = f"Content-Type: {content_type}"
    one, two = (b'{"a":1}', b'[{"b":2},{"c":3}]') if content_type == "application/json" else (b"one", b"two")
    answers: dict[str, list[tuple[int, dict[str, str], bytes]]] = {"middle": [], "end": []}
    for p, suffix in ((tier.fast, "_zzfast"), (tier.slow, "_zzslow")):
        name = f"tail-{content_type.replace('/', '-')}{suffix}"
        path = f"/v1/stream/{name}"
        if where == "bucket":
            assert parsed(exchange(p.port, put(f"/v1/buckets/{name}"))[0])[0] == 201
            path = f"/v1/buckets/{name}/s"
        assert parsed(exchange(p.port, put(path, ct))[0])[0] == 201
        assert parsed(exchange(p.port, post(path, one, ct))[0])[0] == 204
        middle = next_offset(p, path)
        assert parsed(exchange(p.port, post(path, two, ct))[0])[0] == 204
        end = next_offset(p, path)
        for name, offset in (("middle", middle), ("end", end)):
            exchange(p.port, get(path, f"offset={offset}"))  # the store is asked: no chunk there
            before = lane_count(p)
            raw = exchange(p.port, get(path, f"offset={offset}", RID))[0]
            assert b"\r\nX-Request-Id: parity-0123456789\r\n" in raw
            assert lane_count(p) - before == (1 if p is tier.fast else 0)
            answers[name].append(_normal(raw, suffix))
    for name, (fast, slow) in answers.items():
        assert fast == slow, name
    status, headers, body = answers["middle"][0]
    assert status == 200 and body == (b'[{"b":2},{"c":3}]' if content_type == "application/json" else b"two")
    status, headers, body = answers["end"][0]
    assert status == 200 and headers["stream-up-to-date"] == "true"
    assert body == (b"[]" if content_type == "application/json" else b"")


@pytest.mark.parametrize("query", ["offset=-1", "offset=now", "offset=0000000000000000_0000000000000000&x=1",
                                   "offset=bad", "offset=1&offset=2"])
def test_reads_the_lane_cannot_judge_stay_aiohttp_s(tier: Tier, query: str) -> None:
    path = "/v1/stream/tail-other"
    exchange(tier.fast.port, put(path, TEXT))
    exchange(tier.fast.port, post(path, b"x", TEXT))
    exchange(tier.fast.port, get(path, f"offset={next_offset(tier.fast, path)}"))
    before = lane_count(tier.fast)
    fast = _normal(exchange(tier.fast.port, get(path, query, RID))[0], "")
    assert lane_count(tier.fast) == before
    slow_path = path + "-slow"
    exchange(tier.slow.port, put(slow_path, TEXT))
    exchange(tier.slow.port, post(slow_path, b"x", TEXT))
    assert fast == _normal(exchange(tier.slow.port, get(slow_path, query, RID))[0], "-slow")


def test_identical_tail_reads_share_one_upstream_request(tier: Tier) -> None:
    """20 clients read the tail while the ingester is frozen (SIGSTOP): one request reaches
    it, and when it wakes every client gets the answer."""
    path = "/v1/stream/tail-shared"
    exchange(tier.fast.port, put(path, TEXT))
    exchange(tier.fast.port, post(path, b"shared", TEXT))
    offset = next_offset(tier.fast, path)
    exchange(tier.fast.port, get(path, f"offset={offset}"))  # the misses are remembered (for a second)
    upstream = metric(tier.fast, "ds3_reader_ingester_requests_total")
    forwarded = metric(tier.fast, "ds3_reader_forwarded_total")
    lane = lane_count(tier.fast)
    results: list[bytes] = []
    clients = []
    assert tier.ingester.popen is not None
    tier.ingester.popen.send_signal(signal.SIGSTOP)
    try:
        for _ in range(20):
            t = threading.Thread(target=lambda: results.append(exchange(tier.fast.port, get(path, f"offset={offset}"),
                                                                        timeout=20)[0]))
            t.start()
            clients.append(t)
        deadline = time.monotonic() + 10
        while metric(tier.fast, "ds3_reader_forwarded_total") < forwarded + 20 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        tier.ingester.popen.send_signal(signal.SIGCONT)
    for t in clients:
        t.join(20)
    assert len(results) == 20
    assert {parsed(r)[0] for r in results} == {200}
    assert {parsed(r)[1]["stream-next-offset"] for r in results} == {offset}
    assert metric(tier.fast, "ds3_reader_ingester_requests_total") == upstream + 1
    assert lane_count(tier.fast) == lane + 20


def test_a_client_that_leaves_a_shared_tail_read_does_not_take_it_from_the_others(tier: Tier) -> None:
    """Two clients share one upstream read (the ingester frozen meanwhile); the first hangs up:
    the second still gets the answer, and the reader serves on."""
    path = "/v1/stream/tail-left"
    exchange(tier.fast.port, put(path, TEXT))
    exchange(tier.fast.port, post(path, b"stay", TEXT))
    offset = next_offset(tier.fast, path)
    exchange(tier.fast.port, get(path, f"offset={offset}"))  # the misses are remembered
    forwarded = metric(tier.fast, "ds3_reader_forwarded_total")
    upstream = metric(tier.fast, "ds3_reader_ingester_requests_total")
    results: list[bytes] = []
    assert tier.ingester.popen is not None
    tier.ingester.popen.send_signal(signal.SIGSTOP)
    try:
        leaving = socket.create_connection(("127.0.0.1", tier.fast.port), timeout=5)
        leaving.sendall(get(path, f"offset={offset}"))
        staying = threading.Thread(target=lambda: results.append(
            exchange(tier.fast.port, get(path, f"offset={offset}"), timeout=20)[0]))
        staying.start()
        deadline = time.monotonic() + 10
        while metric(tier.fast, "ds3_reader_forwarded_total") < forwarded + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        leaving.close()
        time.sleep(0.2)
    finally:
        tier.ingester.popen.send_signal(signal.SIGCONT)
    staying.join(20)
    assert len(results) == 1 and parsed(results[0])[0] == 200
    assert parsed(results[0])[1]["stream-next-offset"] == offset
    assert metric(tier.fast, "ds3_reader_ingester_requests_total") == upstream + 1
    assert parsed(exchange(tier.fast.port, post(path, b"more", TEXT))[0])[0] == 204
    assert read_all(tier.fast.port, path) == b"staymore"


# (name, the request for bucket B, whether the reader's lane takes it, the status)
BUCKET_CASES: list[tuple[str, str, bool, int]] = [
    ("append", "POST /v1/buckets/B/s", True, 204),
    ("head", "HEAD /v1/buckets/B/s", True, 200),
    ("append to a missing stream", "POST /v1/buckets/B/nothing", True, 404),
    ("append to a missing bucket", "POST /v1/buckets/B-none/s", True, 404),
    ("the bucket itself", "POST /v1/buckets/B", False, 405),
    ("the reserved stream id", "POST /v1/buckets/B/streams", False, 400),
    ("a nested stream id", "POST /v1/buckets/B/a/b", False, 400),
    ("create a stream", "PUT /v1/buckets/B/new", True, 201),
    ("create it again", "PUT /v1/buckets/B/s", True, 200),
    ("create in a missing bucket", "PUT /v1/buckets/B-none/new", True, 404),
    ("create the bucket again", "PUT /v1/buckets/B", False, 409),
    ("delete a stream", "DELETE /v1/buckets/B/gone", True, 204),
    ("delete a missing stream", "DELETE /v1/buckets/B/nothing", True, 404),
]


@pytest.mark.parametrize(("request_", "taken", "status"), [c[1:] for c in BUCKET_CASES],
                         ids=[c[0] for c in BUCKET_CASES])
def test_a_bucket_s_streams_take_the_lane_as_aiohttp_answers_them(tier: Tier, request_: str, taken: bool,
                                                                   status: int) -> None:
    answers = []
    for p, bucket in ((tier.fast, "bkt-zzfast"), (tier.slow, "bkt-zzslow")):
        if parsed(exchange(p.port, put(f"/v1/buckets/{bucket}"))[0])[0] == 201:
            assert parsed(exchange(p.port, put(f"/v1/buckets/{bucket}/s", TEXT))[0])[0] == 201
        method, target = request_.split(" ")
        target = target.replace("/B", f"/{bucket}")
        if target.endswith("/new"):  # a stream to create: none of that name yet
            target += uuid.uuid4().hex[:8]
        if target.endswith("/gone"):  # a stream to delete
            assert parsed(exchange(p.port, put(target, TEXT))[0])[0] == 201
        raw_request = {"POST": post(target, b"x", TEXT, RID), "HEAD": head(target, RID), "PUT": put(target, TEXT, RID),
                       "DELETE": delete(target, RID)}[method]
        before = lane_count(p)
        raw = exchange(p.port, raw_request, bodiless=method == "HEAD")[0]
        if p is tier.fast:
            assert lane_count(p) - before == (1 if taken else 0)
        answers.append(_normal(re.sub(rb"/new[0-9a-f]{8}", b"/new", raw.replace(bucket.encode(), b"BUCKET")), bucket))
    assert answers[0][0] == status, answers[0]
    assert answers[0] == answers[1]


@pytest.mark.parametrize("what", ["long path", "long header", "bad syntax"])
def test_a_request_aiohttp_cannot_parse_is_a_plain_400_and_one_log_line(tier: Tier, what: str) -> None:
    """A request line or header over 8190 bytes, or broken syntax: 400 with a message saying
    so, at the reader and at the ingester; a warning line in the log, not aiohttp's traceback
    (any client could fill the logs with those) nor an echo of 8 KiB of the client's bytes."""
    request = {
        "long path": b"GET /v1/stream/" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "long header": b"GET /v1/stream/x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 10_000 + b"\r\n\r\n",
        "bad syntax": b"GET /v1/stream/x HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
    }[what]
    for p in (tier.fast, tier.ingester):
        before = p.log_path.read_text()
        status, headers, body = parsed(exchange(p.port, request)[0])
        assert status == 400, (p.args[0], what, status, body[:300])
        text = body.decode()
        assert text.startswith("malformed HTTP request: ") and len(text) < 400, text
        if what != "bad syntax":
            assert "longer than 8190 bytes" in text
        assert headers.get("x-content-type-options") == "nosniff"
        deadline = time.monotonic() + 5
        while "malformed request from" not in p.log_path.read_text()[len(before):]:
            assert time.monotonic() < deadline, p.log_path.read_text()[len(before):]
            time.sleep(0.05)
        assert "Traceback" not in p.log_path.read_text()[len(before):]
