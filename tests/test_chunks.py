"""The chunk object format: round trips, message-aligned slices, and every malformed input."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import replace

import pytest

from shared import chunks
from shared.chunks import (
    FLAG_LAST_IN_APPEND,
    PRELUDE_SIZE,
    ChunkFormatError,
    ChunkHeader,
    Record,
    decode_chunk,
    encode_chunk,
    iter_records,
    parse_head,
    parse_prelude,
)

Rec = tuple[int, int, bytes]


def make(
    start: int, payloads: list[bytes], flags: list[int] | None = None, **kw: object
) -> tuple[ChunkHeader, list[Rec]]:
    """Header and records for payloads laid end to end from `start`."""
    records: list[Rec] = []
    pos = start
    for i, p in enumerate(payloads):
        pos += len(p)
        records.append((pos, (flags or [FLAG_LAST_IN_APPEND] * len(payloads))[i], p))
    fields: dict[str, object] = dict(
        sid=7, chunk=3, start=start, end=pos, content_type="application/octet-stream",
        records=len(records), closed=False, created_at=1_700_000_000.25, path="/a/b",
    )
    fields.update(kw)
    return ChunkHeader(**fields), records  # type: ignore[arg-type]


JSON_MSGS = [b'{"a":1},', b'"text",', b"[1,2,3],", b'{"nested":{"k":"\xc3\xa9"}},']

ROUND_TRIPS = {
    "single record": make(0, [b"hello"]),
    "single byte": make(41, [b"x"]),
    "many records": make(1000, [bytes([i % 256]) * (i % 17 + 1) for i in range(500)]),
    "json framed": make(12, JSON_MSGS, content_type="application/json"),
    "mixed flags": make(5, [b"ab", b"cd", b"ef"], flags=[0, 0, FLAG_LAST_IN_APPEND]),
    "large record": make(0, [bytes(range(256)) * 4096 * 3]),  # 3 MiB
    "closed, unicode path": make(9, [b"end"], closed=True, path="/streams/é/ü", content_type=""),
    "huge positions": make(2**50, [b"far", b"away"]),
}


@pytest.mark.parametrize("case", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_round_trip(case: tuple[ChunkHeader, list[Rec]]) -> None:
    header, records = case
    blob = encode_chunk(header, records)
    head, decoded = decode_chunk(blob)
    assert head.header == header
    assert head.object_size == len(blob)
    assert head.data_offset == len(blob) - (header.end - header.start)
    expected = []
    prev = header.start
    for end, flags, data in records:
        expected.append(Record(prev, end, flags, data))
        prev = end
    assert decoded == expected
    # the data section alone decodes the same, and data byte k is position start + k
    assert list(iter_records(head, blob[head.data_offset :])) == expected
    assert blob[head.data_offset :] == b"".join(r[2] for r in records)
    # parse_head needs exactly the head; extra data bytes are ignored
    prelude = parse_prelude(blob)
    assert prelude.head_size == head.data_offset and prelude.object_size == len(blob)
    assert parse_head(blob[: prelude.head_size]) == head == parse_head(blob[: prelude.head_size + 1])
    # deterministic: the same input encodes to the same bytes
    assert encode_chunk(header, records) == blob


def test_layout_is_as_documented() -> None:
    header, records = make(100, [b"abc", b"de"], flags=[0, 1])
    blob = encode_chunk(header, records)
    magic, version, hlen, ilen, dlen = struct.unpack(">8sIIQQ", blob[:32])
    assert (magic, version, ilen, dlen) == (b"DS3CHNK1", 1, 18, 5)
    hdr = json.loads(blob[32 : 32 + hlen])
    assert hdr == {"sid": 7, "chunk": 3, "start": 100, "end": 105, "content_type": "application/octet-stream",
                   "records": 2, "closed": False, "created_at": 1_700_000_000.25, "path": "/a/b"}
    assert blob[32 + hlen : 32 + hlen + 18] == struct.pack(">QBQB", 103, 0, 105, 1)
    assert blob[32 + hlen + 18 :] == b"abcde"


def test_json_range_is_one_slice() -> None:
    """A JSON response is '[' + slice without its last ',' + ']'."""
    header, records = make(0, JSON_MSGS, content_type="application/json")
    blob = encode_chunk(header, records)
    head = parse_head(blob)
    a, b, _ = head.slice_for(head.ends[0], 10**6)
    assert json.loads(b"[" + blob[a : b - 1] + b"]") == [json.loads(m[:-1]) for m in JSON_MSGS[1:]]


# ---------------------------------------------------------------- slice_for & friends
# records at positions [10,14) [14,15) [15,25) [25,28)
SLICE_HEAD = parse_head(encode_chunk(*make(10, [b"aaaa", b"b", b"cccccccccc", b"ddd"])))
D = SLICE_HEAD.data_offset

SLICES = [
    # position, max_bytes, expected end position
    (10, 1000, 28),   # whole chunk
    (10, 18, 28),     # exactly fits
    (10, 17, 25),     # the last record does not fit
    (10, 5, 15),      # two whole records
    (10, 4, 14),      # exactly the first
    (10, 1, 14),      # smaller than one record: still that record
    (14, 1, 15),
    (14, 2, 15),      # the next record (10 bytes) does not fit
    (15, 3, 25),      # a 10-byte record over a 3-byte budget: served whole
    (25, 100, 28),
    (12, 1, 14),      # mid-record (byte streams): to the end of that record
    (12, 3, 15),
    (20, 5, 25),
    (27, 1, 28),
    (28, 1, 28),      # at the end: empty
    (28, 100, 28),
]


@pytest.mark.parametrize(("position", "max_bytes", "end"), SLICES)
def test_slice_for(position: int, max_bytes: int, end: int) -> None:
    lo, hi, reached = SLICE_HEAD.slice_for(position, max_bytes)
    assert (lo, hi, reached) == (D + position - 10, D + end - 10, end)


@pytest.mark.parametrize(("position", "max_bytes"), [(9, 10), (29, 10), (10, 0), (10, -1)])
def test_slice_for_rejects(position: int, max_bytes: int) -> None:
    with pytest.raises(ValueError):
        SLICE_HEAD.slice_for(position, max_bytes)


@pytest.mark.parametrize(("position", "span"), [
    (10, (0, 10, 14)), (13, (0, 10, 14)), (14, (1, 14, 15)), (15, (2, 15, 25)), (24, (2, 15, 25)),
    (25, (3, 25, 28)), (27, (3, 25, 28)),
])
def test_record_at(position: int, span: tuple[int, int, int]) -> None:
    got = SLICE_HEAD.record_at(position)
    assert (got.number, got.start, got.end) == span and got.flags == FLAG_LAST_IN_APPEND


@pytest.mark.parametrize("position", [9, 28, 100])
def test_record_at_outside(position: int) -> None:
    with pytest.raises(ValueError):
        SLICE_HEAD.record_at(position)


def test_is_boundary() -> None:
    assert [p for p in range(0, 40) if SLICE_HEAD.is_boundary(p)] == [10, 14, 15, 25, 28]


# ---------------------------------------------------------------- encode: bad records
GOOD_HEADER, GOOD_RECORDS = make(10, [b"aaaa", b"b", b"cc"])

BAD_ENCODES = {
    "no records": (replace(GOOD_HEADER, records=0, end=10), []),
    "count mismatch": (replace(GOOD_HEADER, records=4), GOOD_RECORDS),
    "end mismatch": (replace(GOOD_HEADER, end=18), GOOD_RECORDS),
    "ends not increasing": (GOOD_HEADER, [(14, 1, b"aaaa"), (14, 1, b""), (17, 1, b"ccc")]),
    "length != end - prev": (GOOD_HEADER, [(14, 1, b"aaa"), (15, 1, b"b"), (17, 1, b"cc")]),
    "first end before start": (replace(GOOD_HEADER, start=20), GOOD_RECORDS),
    "flags too big": (GOOD_HEADER, [(14, 256, b"aaaa"), (15, 1, b"b"), (17, 1, b"cc")]),
    "negative start": (replace(GOOD_HEADER, start=-1, end=2), [(2, 0, b"abc")]),
}


@pytest.mark.parametrize("case", BAD_ENCODES.values(), ids=BAD_ENCODES.keys())
def test_encode_rejects(case: tuple[ChunkHeader, list[Rec]]) -> None:
    with pytest.raises(ChunkFormatError):
        encode_chunk(*case)


# ---------------------------------------------------------------- decode: malformed objects
GOOD = encode_chunk(GOOD_HEADER, GOOD_RECORDS)
HLEN = parse_prelude(GOOD).header_length
IDX = PRELUDE_SIZE + HLEN  # where the index starts


def with_prelude(blob: bytes, **fields: int) -> bytes:
    magic, version, hlen, ilen, dlen = struct.unpack(">8sIIQQ", blob[:32])
    vals = dict(version=version, hlen=hlen, ilen=ilen, dlen=dlen) | fields
    prelude = struct.pack(">8sIIQQ", magic, vals["version"], vals["hlen"], vals["ilen"], vals["dlen"])
    return prelude + blob[32:]


def with_header(obj: dict[str, object]) -> bytes:
    """GOOD with its header JSON replaced (prelude adjusted)."""
    raw = json.dumps(obj).encode()
    return with_prelude(GOOD[:32], hlen=len(raw)) + raw + GOOD[IDX:]


def with_index_entry(i: int, end: int) -> bytes:
    off = IDX + 9 * i
    return GOOD[:off] + struct.pack(">Q", end) + GOOD[off + 8 :]


GOOD_HDR_OBJ = json.loads(GOOD[32:IDX])

MALFORMED = {
    "empty": b"",
    "truncated prelude": GOOD[:31],
    "bad magic": b"DS3CHNK0" + GOOD[8:],
    "not a chunk at all": b"PK\x03\x04" + bytes(60),
    "version 2": with_prelude(GOOD, version=2),
    "version 0": with_prelude(GOOD, version=0),
    "zero header length": with_prelude(GOOD, hlen=0),
    "huge header length": with_prelude(GOOD, hlen=2**31),
    "index not a multiple of 9": with_prelude(GOOD, ilen=26),
    "empty index": with_prelude(GOOD, ilen=0),
    "no data": with_prelude(GOOD, dlen=0),
    "truncated header": GOOD[: IDX - 1],
    "truncated index": GOOD[: IDX + 26],
    "truncated data": GOOD[:-1],
    "trailing bytes": GOOD + b"x",
    "data length mismatch": with_prelude(GOOD, dlen=8) + b"x",
    "header not JSON": with_header({}).replace(b"{}", b"{{"),
    "header not UTF-8": with_prelude(GOOD[:32], hlen=2) + b"\xff\xfe" + GOOD[IDX:],
    "header a list": with_header([]),  # type: ignore[arg-type]
    "header lacks end": with_header({k: v for k, v in GOOD_HDR_OBJ.items() if k != "end"}),
    "header sid a string": with_header(GOOD_HDR_OBJ | {"sid": "7"}),
    "header closed an int": with_header(GOOD_HDR_OBJ | {"closed": 1}),
    "header chunk a bool": with_header(GOOD_HDR_OBJ | {"chunk": True}),
    "header records mismatch": with_header(GOOD_HDR_OBJ | {"records": 2}),
    "header end mismatch": with_header(GOOD_HDR_OBJ | {"end": 18}),
    "header start mismatch": with_header(GOOD_HDR_OBJ | {"start": 11}),
    "index not increasing": with_index_entry(1, 14),
    "index decreasing": with_index_entry(1, 12),
    "index first end at start": with_index_entry(0, 10),
    "index last end != header end": with_index_entry(2, 16),
}


@pytest.mark.parametrize("blob", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_raises_chunk_format_error(blob: bytes) -> None:
    with pytest.raises(ChunkFormatError):
        decode_chunk(blob)
    assert issubclass(ChunkFormatError, ValueError)


def test_parse_head_reports_what_is_missing() -> None:
    with pytest.raises(ChunkFormatError, match="truncated prelude"):
        parse_head(GOOD[:10])
    with pytest.raises(ChunkFormatError, match="truncated header"):
        parse_head(GOOD[: IDX - 1])
    with pytest.raises(ChunkFormatError, match="truncated index"):
        parse_head(GOOD[: IDX + 1])
    with pytest.raises(ChunkFormatError, match="version 2"):
        parse_prelude(with_prelude(GOOD, version=2))


def test_iter_records_checks_data_length() -> None:
    head = parse_head(GOOD)
    with pytest.raises(ChunkFormatError):
        list(iter_records(head, b"short"))


def test_unknown_header_fields_are_ignored() -> None:
    head, records = decode_chunk(with_header(GOOD_HDR_OBJ | {"future": [1, 2]}))
    assert head.header == GOOD_HEADER and len(records) == 3


def test_module_is_pure() -> None:
    """The PySpark pipeline imports it: no aiohttp, lmdb or botocore may come along."""
    code = ("import sys, shared.chunks; "
            "bad = {'aiohttp', 'lmdb', 'aiobotocore', 'botocore', 'orjson'} & set(sys.modules); "
            "print(*sorted(bad)); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert chunks.__doc__ and "DS3CHNK1" in chunks.__doc__
