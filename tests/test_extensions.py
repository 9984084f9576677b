"""Table-driven tests of the pure pieces of the extensions: endpoint URLs, multipart framing,
and splitting sealed chunk data into messages."""

from __future__ import annotations

import email

import pytest

from shared import chunks, extensions
from shared.errors import BadRequest
from shared.extensions import BOOTSTRAP, SNAPSHOT, Endpoint

OFF = "0000000000000007_0000000000000123"


@pytest.mark.parametrize(
    ("raw", "stream", "endpoint"),
    [
        ("/v1/stream/a", "/v1/stream/a", None),
        ("/v1/stream/a/b", "/v1/stream/a/b", None),
        ("/v1/stream/a/bootstrap", "/v1/stream/a", Endpoint(BOOTSTRAP, None)),
        ("/v1/stream/a/b/snapshot", "/v1/stream/a/b", Endpoint(SNAPSHOT, None)),
        (f"/v1/stream/a/snapshot/{OFF}", "/v1/stream/a", Endpoint(SNAPSHOT, OFF)),
        ("/v1/stream/a/snapshot/garbage", "/v1/stream/a", Endpoint(SNAPSHOT, "garbage")),
        ("/v1/stream/a/snapshot/%2D1", "/v1/stream/a", Endpoint(SNAPSHOT, "-1")),
        # A stream path alone, even one that reads like an endpoint name, stays a stream.
        ("/v1/stream/bootstrap", "/v1/stream/bootstrap", None),
        ("/v1/stream/snapshot", "/v1/stream/snapshot", None),
        ("/v1/stream/snapshot/x", "/v1/stream/snapshot/x", None),
        ("/v1/stream/a/snapshots", "/v1/stream/a/snapshots", None),
        ("/v1/buckets/bkt1/s/bootstrap", "/v1/buckets/bkt1/s", Endpoint(BOOTSTRAP, None)),
        ("/v1/buckets/bkt1/s/snapshot", "/v1/buckets/bkt1/s", Endpoint(SNAPSHOT, None)),
        (f"/v1/buckets/bkt1/s/snapshot/{OFF}", "/v1/buckets/bkt1/s", Endpoint(SNAPSHOT, OFF)),
        # Under a bucket, the last segment is a stream id, not an endpoint, when nothing precedes it.
        ("/v1/buckets/bkt1/bootstrap", "/v1/buckets/bkt1/bootstrap", None),
        ("/v1/buckets/bkt1/snapshot", "/v1/buckets/bkt1/snapshot", None),
        ("/v1/buckets/bkt1/s/x/bootstrap", "/v1/buckets/bkt1/s/x/bootstrap", None),
        ("/elsewhere/bootstrap", "/elsewhere/bootstrap", None),
    ],
)
def test_split(raw: str, stream: str, endpoint: Endpoint | None) -> None:
    assert extensions.split(raw) == (stream, endpoint)


def test_split_rejects_an_offset_that_is_not_utf8() -> None:
    with pytest.raises(BadRequest):
        extensions.split("/v1/stream/a/snapshot/%ff")


@pytest.mark.parametrize("text", [None, "-1", "now", "", "1_2", OFF + "0", "x" * 33])
def test_snapshot_offset_rejects(text: str | None) -> None:
    with pytest.raises(BadRequest):
        extensions.snapshot_offset(text)


@pytest.mark.parametrize("text", ["-1", "now"])
def test_snapshot_offset_refuses_minus_one_and_now_without_offering_them(text: str) -> None:
    # (the offset parser's message offered "-1, now" as what it expected; found by QA)
    with pytest.raises(BadRequest, match="not -1 or now") as e:
        extensions.snapshot_offset(text)
    assert "expected -1" not in str(e.value)


def test_snapshot_offset_accepts_a_concrete_offset() -> None:
    assert str(extensions.snapshot_offset(OFF)) == OFF


@pytest.mark.parametrize(
    "bodies",
    [
        [],
        [b""],
        [b"plain"],
        [b"\r\n", b"--", b"\r\n--not-the-boundary\r\n", bytes(range(256))],
        [b'{"a":1}', b"[1,2]", b'"s"'],
    ],
)
def test_multipart_round_trips_through_the_email_parser(bodies: list[bytes]) -> None:
    boundary = extensions.new_boundary()
    assert extensions.valid_boundary(boundary)
    body = extensions.first_part_head(boundary, "application/x-snap") + b"SNAP"
    for b in bodies:
        body += extensions.part_head(boundary, "application/octet-stream") + b
    body += extensions.closing(boundary)
    msg = email.message_from_bytes(f"Content-Type: {extensions.content_type(boundary)}\r\n\r\n".encode() + body)
    parts = msg.get_payload()
    assert isinstance(parts, list)
    assert [p.get_content_type() for p in parts] == ["application/x-snap"] + ["application/octet-stream"] * len(bodies)
    assert [p.get_payload(decode=True) for p in parts] == [b"SNAP", *bodies]


@pytest.mark.parametrize("text", ["", "ds3-", "ds3-" + "g" * 32, "xx3-" + "a" * 32, "ds3-" + "a" * 31])
def test_valid_boundary_rejects(text: str) -> None:
    assert not extensions.valid_boundary(text)


def _head(start: int, ends: list[int]) -> chunks.ChunkHead:
    header = chunks.ChunkHeader(sid=1, chunk=9, start=start, end=ends[-1], content_type="x", records=len(ends),
                                closed=False, created_at=0.0, path="p")
    data = []
    prev = start
    for e in ends:
        data.append((e, 1, b"m" * (e - prev)))
        prev = e
    return chunks.parse_head(chunks.encode_chunk(header, data))


@pytest.mark.parametrize(
    ("start", "ends", "lo", "hi", "want"),
    [
        (0, [3, 5, 9], 0, 9, [(3, 3), (5, 2), (9, 4)]),
        (0, [3, 5, 9], 3, 9, [(5, 2), (9, 4)]),
        (0, [3, 5, 9], 3, 5, [(5, 2)]),
        (0, [3, 5, 9], 5, 7, [(7, 2)]),  # cut at a fork position inside the last message
        (0, [3, 5, 9], 9, 9, []),
        (100, [103, 110], 100, 110, [(103, 3), (110, 7)]),
    ],
)
def test_messages_in(start: int, ends: list[int], lo: int, hi: int, want: list[tuple[int, int]]) -> None:
    head = _head(start, ends)
    data = bytes(range(hi - lo))
    got = list(chunks.messages_in(head, lo, hi, data))
    assert [(end, len(m)) for end, m in got] == want
    assert b"".join(m for _end, m in got) == data


def test_messages_in_checks_the_data_length() -> None:
    with pytest.raises(ValueError, match="expected 9 bytes"):
        list(chunks.messages_in(_head(0, [3, 9]), 0, 9, b"short"))
