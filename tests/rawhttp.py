"""Raw HTTP/1.1 over sockets, for tests of what only raw sockets show (the fast lanes:
pipelining, bytes split anywhere, byte-for-byte answers)."""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

VOLATILE = {"date", "x-request-id"}
STREAM_OFFSET = re.compile(rb"\d{16}_\d{16}")


def exchange(port: int, *parts: bytes, answers: int = 1, timeout: float = 5.0, pause: float = 0.0,
             bodiless: bool = False) -> list[bytes]:
    """Send `parts` (each its own write, `pause` s apart) on one connection; read `answers`
    whole responses (`bodiless`: answers to HEADs, whose Content-Length has no body after it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, part in enumerate(parts):
            if i and pause:
                time.sleep(pause)
            s.sendall(part)
        buf = b""
        out: list[bytes] = []
        while len(out) < answers:
            while True:
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0:
                    m = re.search(rb"(?im)^content-length:\s*(\d+)", buf[:head_end])
                    total = head_end + 4 + (int(m.group(1)) if m and not bodiless else 0)
                    if len(buf) >= total:
                        out.append(buf[:total])
                        buf = buf[total:]
                        break
                chunk = s.recv(65536)
                if not chunk:
                    raise AssertionError(f"connection closed after {len(out)} answers: {buf[:300]!r}")
                buf += chunk
        return out


def parsed(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.lower() not in VOLATILE:
            headers[name.lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def post(path: str, body: bytes, *headers: str) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers)
    return head.encode("latin-1") + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def put(path: str, *headers: str) -> bytes:
    head = f"PUT {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers)
    return head.encode("latin-1") + b"Content-Length: 0\r\n\r\n"


def put_body(path: str, body: bytes, *headers: str) -> bytes:
    head = f"PUT {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers)
    return head.encode("latin-1") + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def delete(path: str, *headers: str) -> bytes:
    return (f"DELETE {path} HTTP/1.1\r\nHost: t\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def pipeline(port: int, parts: list[bytes], answers: int, pause: float = 0.0, timeout: float = 60.0) -> list[bytes]:
    """Send `parts` on one connection from a thread (each its own write, `pause` s apart) while
    reading `answers` whole responses: a client that pipelines without waiting."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def send() -> None:
            for i, part in enumerate(parts):
                if i and pause:
                    time.sleep(pause)
                s.sendall(part)

        sender = threading.Thread(target=send)
        sender.start()
        out: list[bytes] = []
        buf = bytearray()
        pos = 0
        try:
            while len(out) < answers:
                head_end = buf.find(b"\r\n\r\n", pos)
                if head_end >= 0:
                    m = re.search(rb"(?im)^content-length:\s*(\d+)", bytes(buf[pos:head_end]))
                    total = head_end + 4 + (int(m.group(1)) if m else 0)
                    if len(buf) >= total:
                        out.append(bytes(buf[pos:total]))
                        pos = total
                        continue
                chunk = s.recv(1 << 20)
                if not chunk:
                    raise AssertionError(f"connection closed after {len(out)} answers: {bytes(buf[pos:pos + 300])!r}")
                buf += chunk
        finally:
            sender.join(timeout)
        return out


def read_all(port: int, path: str) -> bytes:
    return parsed(exchange(port, f"GET {path}?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n".encode())[0])[2]


def mixed_requests(path: str) -> bytes:
    """A pipelined mix: fast appends, a refused one, a producer's, a HEAD, a GET, a chunked append."""
    return b"".join([
        post(path, b"a", "Content-Type: text/plain"),
        post(path, b"no", "Content-Type: application/json"),
        f"HEAD {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode(),
        post(path, b"b", "Content-Type: text/plain", "Producer-Id: q", "Producer-Epoch: 0", "Producer-Seq: 0"),
        f"GET {path}?offset=-1 HTTP/1.1\r\nHost: t\r\n\r\n".encode(),
        (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
         "1\r\nc\r\n0\r\n\r\n").encode(),
        post(path, b"d", "Content-Type: text/plain"),
    ])


MIXED_ANSWERS = 7


def mix_shape(port: int, cuts: Iterable[int], pause: float = 0.002) -> list[tuple[int, bytes]]:
    """The answers' shapes to `mixed_requests` on a fresh stream (its path the same length
    every time: the mix has MIX_BYTES bytes), sent in writes split at each of `cuts`, `pause`
    apart (so the server sees each part alone); the stream holds the mix's appends."""
    path = f"/v1/stream/mix-{uuid.uuid4().hex}"
    data = mixed_requests(path)
    marks = [0, *sorted(c for c in set(cuts) if 0 < c < len(data)), len(data)]
    exchange(port, put(path, "Content-Type: text/plain"))
    got = answer_shapes(pipeline(port, [data[a:b] for a, b in itertools.pairwise(marks)], MIXED_ANSWERS, pause=pause))
    assert read_all(port, path) == b"abcd", marks
    return [(status, body.replace(path.encode(), b"P")) for status, body in got]


MIX_BYTES = len(mixed_requests("/v1/stream/mix-" + "0" * 32))


def assert_every_mix_cut_answered_as(expected_port: int, port: int) -> None:
    """Every split of `mixed_requests` in two gets from `port` the answers `expected_port`
    (aiohttp's path) gives it. The cuts go several at a time: each is its own stream and
    connection, and one at a time they took half a minute."""
    expected = mix_shape(expected_port, [1])
    cuts = range(1, MIX_BYTES)
    with ThreadPoolExecutor(6) as pool:
        for cut, got in zip(cuts, pool.map(lambda c: mix_shape(port, [c]), cuts), strict=True):
            assert got == expected, (cut, got)


def answer_shapes(answers: list[bytes]) -> list[tuple[int, bytes]]:
    return [(parsed(a)[0], STREAM_OFFSET.sub(b"O", parsed(a)[2])) for a in answers]
