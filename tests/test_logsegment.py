"""The log segment format (shared/logsegment.py): round trips, determinism, and every damaged
segment refused with LogSegmentError (truncations, bit flips, bad magic, version, lengths)."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import logsegment
from shared.logsegment import (
    CLEAR,
    DB_IDS,
    DELETE,
    FOLD,
    MAGIC,
    PRELUDE_SIZE,
    PUT,
    Commit,
    LogSegmentError,
    Write,
    decode,
    encode,
    parse_prelude,
    parse_segment_key,
    segment_key,
)

STREAMS, RECORDS, JOURNAL, SYS = DB_IDS["streams"], DB_IDS["records"], DB_IDS["journal"], DB_IDS["sys"]


def norm(commits: list[Commit]) -> list[tuple[int, list[Write]]]:
    return [(c.seq, list(c.writes)) for c in commits]


def small() -> list[Commit]:
    return [
        Commit(1, [(STREAMS, PUT, b"/s", b'{"sid":1}'), (SYS, PUT, b"commit_seq", struct.pack(">Q", 1))]),
        Commit(2, [(RECORDS, PUT, b"k" * 16, b""), (STREAMS, DELETE, b"/s", b""), (JOURNAL, CLEAR, b"", b"")]),
    ]


ROUND_TRIPS: list[tuple[str, list[Commit], int]] = [
    ("one put", [Commit(1, [(STREAMS, PUT, b"a", b"b")])], 0),
    ("empty value", [Commit(7, [(SYS, PUT, b"pub:/x", b"")])], 0),
    ("no writes", [Commit(3, [])], 0),
    ("large value", [Commit(10, [(RECORDS, PUT, b"\x00" * 16, bytes(range(256)) * 5000)])], 0),
    ("every db", [Commit(1, [(db, PUT, name.encode(), name.encode() * 3) for name, db in DB_IDS.items()])], 0),
    ("deletes and clears", [Commit(5, [(db, DELETE, b"k", b"") for db in DB_IDS.values()]
                                   + [(db, CLEAR, b"", b"") for db in DB_IDS.values()])], 0),
    ("gaps between seqs", [Commit(1, []), Commit(4, [(SYS, PUT, b"a", b"1")]), Commit(2**64 - 1, [])], 0),
    ("epoch", small(), 2**64 - 1),
    ("binary keys", [Commit(1, [(JOURNAL, PUT, bytes([i]) * 8, bytes([255 - i])) for i in range(256)])], 9),
    ("a fold", [Commit(1, [(JOURNAL, PUT, b"s" * 8, b"m"), (JOURNAL, FOLD, b"", b"")]), Commit(2, [])], 0),
]


@pytest.mark.parametrize(("name", "commits", "epoch"), ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_round_trip(name: str, commits: list[Commit], epoch: int) -> None:
    blob = encode(commits, epoch)
    seg = decode(blob)
    assert seg.epoch == epoch
    assert norm(seg.commits) == norm(commits)
    assert (seg.first_seq, seg.last_seq) == (commits[0].seq, commits[-1].seq)
    assert parse_prelude(blob)[1:] == (len(blob), epoch, commits[0].seq, commits[-1].seq)
    assert encode(seg.commits, seg.epoch) == blob  # deterministic: decoding and encoding again is identical
    assert decode(memoryview(blob)).commits == seg.commits


def test_layout_matches_the_drawing() -> None:
    blob = encode([Commit(5, [(SYS, PUT, b"ab", b"xyz")])], epoch=3)
    assert blob[:8] == MAGIC == b"DS3WLOG1"
    assert struct.unpack(">IIQQQQ", blob[8:48]) == (2, 1, len(blob), 3, 5, 5)
    assert blob[48:60] == struct.pack(">QI", 5, 1)
    assert blob[60:70] == struct.pack(">BBII", SYS, PUT, 2, 3)
    assert blob[70:75] == b"abxyz"
    assert blob[75:] == struct.pack(">I", zlib.crc32(blob[:75]))
    assert len(blob) == 79
    assert logsegment.__doc__ and "DS3WLOG1" in logsegment.__doc__


BAD_COMMITS: list[tuple[str, list[Commit], int]] = [
    ("no commits", [], 0),
    ("seq zero", [Commit(0, [])], 0),
    ("seq too large", [Commit(2**64, [])], 0),
    ("seqs not rising", [Commit(2, []), Commit(2, [])], 0),
    ("seqs falling", [Commit(3, []), Commit(1, [])], 0),
    ("unknown db", [Commit(1, [(0, PUT, b"k", b"v")])], 0),
    ("unknown db 9", [Commit(1, [(9, PUT, b"k", b"v")])], 0),
    ("unknown op", [Commit(1, [(SYS, 5, b"k", b"v")])], 0),
    ("fold with a key", [Commit(1, [(JOURNAL, FOLD, b"k", b"")])], 0),
    ("fold with a value", [Commit(1, [(JOURNAL, FOLD, b"", b"v")])], 0),
    ("fold of another db", [Commit(1, [(RECORDS, FOLD, b"", b"")])], 0),
    ("delete with a value", [Commit(1, [(SYS, DELETE, b"k", b"v")])], 0),
    ("clear with a key", [Commit(1, [(SYS, CLEAR, b"k", b"")])], 0),
    ("str key", [Commit(1, [(SYS, PUT, "k", b"v")])], 0),  # type: ignore[list-item]
    ("short write", [Commit(1, [(SYS, PUT, b"k")])], 0),  # type: ignore[list-item]
    ("negative epoch", [Commit(1, [])], -1),
    ("epoch too large", [Commit(1, [])], 2**64),
]


@pytest.mark.parametrize(("name", "commits", "epoch"), BAD_COMMITS, ids=[r[0] for r in BAD_COMMITS])
def test_encode_refuses(name: str, commits: list[Commit], epoch: int) -> None:
    with pytest.raises(LogSegmentError):
        encode(commits, epoch)


def test_every_truncation_fails_cleanly() -> None:
    blob = encode(small(), epoch=2)
    for cut in range(len(blob)):
        with pytest.raises(LogSegmentError, match="truncated"):
            decode(blob[:cut])


def test_trailing_bytes_fail() -> None:
    blob = encode(small())
    with pytest.raises(LogSegmentError, match="after the segment's end"):
        decode(blob + b"\x00")


def test_every_bit_flip_fails() -> None:
    blob = encode(small(), epoch=2)
    for i in range(len(blob)):
        for bit in range(8):
            bad = bytearray(blob)
            bad[i] ^= 1 << bit
            with pytest.raises(LogSegmentError):
                decode(bytes(bad))


def _resealed(body: bytes) -> bytes:
    """`body` (a segment without its trailer) with a correct checksum: what a buggy writer
    might upload. The structural checks must refuse it all the same."""
    return body + struct.pack(">I", zlib.crc32(body))


def _prelude(count: int, length: int, first: int, last: int, magic: bytes = MAGIC, version: int = 2) -> bytes:
    return struct.pack(">8sIIQQQQ", magic, version, count, length, 0, first, last)


MALFORMED: list[tuple[str, bytes, str]] = [
    ("bad magic", _resealed(b"DS3CHNK1" + encode(small())[8:-4]), "not a ds3 log segment"),
    ("bad version", _resealed(encode(small())[:8] + struct.pack(">I", 3) + encode(small())[12:-4]),
     "unsupported log segment version 3"),
    ("version 0", _resealed(encode(small())[:8] + struct.pack(">I", 0) + encode(small())[12:-4]),
     "unsupported log segment version 0"),
    ("a fold in version 1",
     _resealed(_prelude(1, 74, 1, 1, version=1) + struct.pack(">QIBBII", 1, 1, JOURNAL, FOLD, 0, 0)),
     "a fold in a version 1 segment"),
    ("no commits", _resealed(_prelude(0, 52, 1, 1)), "claims no commits"),
    ("implausible length", _resealed(_prelude(1, 60, 1, 1)), "implausible segment length"),
    ("first after last", _resealed(_prelude(1, 64, 2, 1) + struct.pack(">QI", 2, 0)), "implausible commit seqs"),
    ("seq zero", _resealed(_prelude(1, 64, 0, 0) + struct.pack(">QI", 0, 0)), "implausible commit seqs"),
    ("prelude seqs lie", _resealed(_prelude(1, 64, 1, 1) + struct.pack(">QI", 2, 0)), "prelude says commits 1..1"),
    ("seqs not rising", _resealed(_prelude(2, 76, 1, 1) + struct.pack(">QIQI", 1, 0, 1, 0)), "does not follow"),
    ("write header past the end",
     _resealed(_prelude(1, 64, 1, 1) + struct.pack(">QI", 1, 1)), "header runs past"),
    ("write bytes past the end",
     _resealed(_prelude(1, 74, 1, 1) + struct.pack(">QIBBII", 1, 1, SYS, PUT, 5, 0)), "run past"),
    ("unknown db", _resealed(_prelude(1, 74, 1, 1) + struct.pack(">QIBBII", 1, 1, 0, PUT, 0, 0)), "unknown database"),
    ("unknown op", _resealed(_prelude(1, 74, 1, 1) + struct.pack(">QIBBII", 1, 1, SYS, 0, 0, 0)), "unknown op"),
    ("unparsed bytes", _resealed(_prelude(1, 65, 1, 1) + struct.pack(">QI", 1, 0) + b"x"), "unparsed bytes"),
    ("commit header past the end", _resealed(_prelude(2, 76, 1, 2) + struct.pack(">QIBBII", 1, 1, SYS, CLEAR, 0, 0)
                                             + b"\x00\x00"), "header runs past"),
]


@pytest.mark.parametrize(("name", "blob", "message"), MALFORMED, ids=[r[0] for r in MALFORMED])
def test_malformed_segments(name: str, blob: bytes, message: str) -> None:
    with pytest.raises(LogSegmentError, match=message):
        decode(blob)


def test_version_1_segments_still_decode() -> None:
    """Segments uploaded before FOLD (version 1) replay as they were written."""
    blob = encode(small(), epoch=4)
    v1 = _resealed(blob[:8] + struct.pack(">I", 1) + blob[12:-4])
    seg = decode(v1)
    assert (seg.epoch, norm(seg.commits)) == (4, norm(small()))


def test_checksum_mismatch_is_named() -> None:
    blob = bytearray(encode(small()))
    blob[PRELUDE_SIZE + 20] ^= 0x10
    with pytest.raises(LogSegmentError, match="checksum mismatch"):
        decode(bytes(blob))


def test_error_is_a_value_error() -> None:
    assert issubclass(LogSegmentError, ValueError)


# --- object keys ----------------------------------------------------------------------------


def test_segment_keys_sort_in_commit_order() -> None:
    ranges = [(1, 1), (2, 9), (10, 10), (11, 99), (100, 2**64 - 1)]
    keys = [segment_key(a, b, "wal/ingester-1/") for a, b in ranges]
    assert keys == sorted(keys)
    assert keys[1] == "wal/ingester-1/log/00000000000000000002-00000000000000000009.seg"
    assert [parse_segment_key(k, "wal/ingester-1/") for k in keys] == ranges
    assert segment_key(3, 4) == "log/00000000000000000003-00000000000000000004.seg"


@pytest.mark.parametrize("key", [
    "log/00000000000000000003-00000000000000000004.seg",  # another prefix
    "wal/log/0000000000000000003-00000000000000000004.seg",
    "wal/log/00000000000000000004-00000000000000000003.seg",
    "wal/log/00000000000000000000-00000000000000000003.seg",
    "wal/log/00000000000000000003-00000000000000000004.seg.tmp",
    "wal/log/99999999999999999999-99999999999999999999.seg",
    "wal/checkpoint/00000000000000000003.ckpt",
])
def test_other_keys_are_not_segments(key: str) -> None:
    assert parse_segment_key(key, "wal/") is None


@pytest.mark.parametrize(("first", "last"), [(0, 1), (2, 1), (1, 2**64)])
def test_segment_key_refuses_bad_ranges(first: int, last: int) -> None:
    with pytest.raises(ValueError):
        segment_key(first, last)


# --- properties -----------------------------------------------------------------------------

_db = st.sampled_from(sorted(DB_IDS.values()))
_bytes = st.binary(max_size=64)
_write = st.one_of(
    st.tuples(_db, st.just(PUT), _bytes, _bytes),
    st.tuples(_db, st.just(DELETE), _bytes, st.just(b"")),
    st.tuples(_db, st.just(CLEAR), st.just(b""), st.just(b"")),
    st.just((JOURNAL, FOLD, b"", b"")),
)


@st.composite
def _commits(draw: st.DrawFn) -> list[Commit]:
    steps = draw(st.lists(st.integers(1, 2**20), min_size=1, max_size=8))
    seq = draw(st.integers(0, 2**40))
    out: list[Commit] = []
    for step in steps:
        seq += step
        out.append(Commit(seq, draw(st.lists(_write, max_size=8))))
    return out


@settings(max_examples=300, deadline=None)
@given(_commits(), st.integers(0, 2**64 - 1))
def test_round_trip_property(commits: list[Commit], epoch: int) -> None:
    blob = encode(commits, epoch)
    seg = decode(blob)
    assert (seg.epoch, norm(seg.commits)) == (epoch, norm(commits))
    assert encode(seg.commits, epoch) == blob


@settings(max_examples=200, deadline=None)
@given(_commits(), st.data())
def test_damage_property(commits: list[Commit], data: st.DataObject) -> None:
    blob = encode(commits)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(LogSegmentError):
        decode(blob[:cut])
    at = data.draw(st.integers(0, len(blob) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(blob)
    bad[at] ^= flip
    with pytest.raises(LogSegmentError):
        decode(bytes(bad))


def test_module_is_pure() -> None:
    """Shared with whatever recovers from the store: no aiohttp, lmdb or botocore may come along."""
    code = ("import sys, shared.logsegment; "
            "bad = {'aiohttp', 'lmdb', 'aiobotocore', 'botocore', 'orjson'} & set(sys.modules); "
            "print(*sorted(bad)); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
