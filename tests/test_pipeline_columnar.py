"""The columnar chunk decoder (pipeline/columnar.py) gives the same rows, byte for byte, as the
message-by-message one (rows.chunk_batch_rows): byte, text and JSON streams, chunks that are
not a stream's first, fork positions inside a chunk (and inside a byte stream's message),
position bounds, invalid UTF-8 (the row path's replacement), offsets of every width."""

from __future__ import annotations

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import columnar, rows
from pipeline.catalog import ChunkRef
from shared import offsets
from shared.chunks import FLAG_LAST_IN_APPEND, ChunkHeader, encode_chunk

OCTET, TEXT, JSON = "application/octet-stream", "text/plain; charset=utf-8", "application/json"


def chunk(start: int, messages: list[bytes], ctype: str, chunk_id: int = 5) -> bytes:
    stored = [m + b"," for m in messages] if ctype == JSON else messages
    recs, pos = [], start
    for m in stored:
        pos += len(m)
        recs.append((pos, FLAG_LAST_IN_APPEND, m))
    header = ChunkHeader(sid=1, chunk=chunk_id, start=start, end=pos, content_type=ctype, records=len(recs),
                         closed=False, created_at=1_700_000_000.5, path="s")
    return encode_chunk(header, recs)


def ref(start: int, end: int, chunk_id: int = 5, prev: int = 4) -> ChunkRef:
    return ChunkRef(uid="u" * 32, chunk=chunk_id, start=start, end=end, prev_chunk=prev, object_size=0,
                    sealed_at=1_700_000_000.5)


def both(target: rows.Target, r: ChunkRef, obj: bytes) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    return rows.chunk_batch(target, r, obj), rows.chunk_batch_rows(target, r, obj)


CASES = {
    "bytes": (OCTET, 0, [b"a", b"bc", b"\x00\xff", b"defg"], {}),
    "text, later chunk": (TEXT, 1000, ["héllo".encode(), b"w", b"xyz"], {}),
    "json": (JSON, 0, [b'{"a":1}', b'"s"', b"[1,2]", b"3"], {}),
    "json, bounds": (JSON, 50, [b'{"a":1}', b'"s"', b"[1,2]", b"3"], {"lo": 58, "hi": 68}),
    "bytes, fork inside a message": (OCTET, 0, [b"aaaa", b"bbbb", b"cccc"], {"cap": 6}),
    "json, fork at a boundary": (JSON, 0, [b"1", b"22", b"333"], {"cap": 5}),
    "bytes, nothing wanted": (OCTET, 0, [b"aaaa"], {"lo": 100}),
    "text, invalid utf-8 (row path)": (TEXT, 0, [b"ok", b"\xff\xfe", b"fine"], {}),
    "big positions": (OCTET, 9_999_999_999_000_000, [b"x" * 10, b"y"], {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_columnar_rows_equal_row_by_row(name: str) -> None:
    ctype, start, messages, kw = CASES[name]
    obj = chunk(start, messages, ctype)
    end = start + sum(len(m) + (1 if ctype == JSON else 0) for m in messages)
    cap = kw.get("cap")
    r = ref(start, start + cap if cap is not None else end)
    lo = kw.get("lo", 0)
    hi = kw.get("hi")
    target = rows.Target("s", None, ctype, lo, hi)
    fast, slow = both(target, r, obj)
    assert fast.equals(slow), (fast.to_pylist(), slow.to_pylist())


def test_the_columnar_path_is_taken_where_it_applies() -> None:
    obj = chunk(0, [b"a", b"b"], JSON)
    cols = columnar.chunk_columns(obj, chunk=5, start_offset="x", cap=4, lo=0, hi=None, json_mode=True, text=True)
    assert cols is not None and cols.message.to_pylist() == [b"a", b"b"]
    bad = chunk(0, [b"\xff"], TEXT)
    assert columnar.chunk_columns(bad, chunk=5, start_offset="x", cap=1, lo=0, hi=None, json_mode=False,
                                  text=True) is None


@pytest.mark.parametrize("chunk_id, position", [(0, 0), (3, 123456), (10**16 - 1, 10**16 - 1), (42, 7)])
def test_offset_strings_spell_offsets(chunk_id: int, position: int) -> None:
    import numpy as np

    got = columnar.offset_strings(np.array([chunk_id]), np.array([position])).to_pylist()
    assert got == [offsets.encode(chunk_id, position)]


@settings(max_examples=150, deadline=None)
@given(
    ctype=st.sampled_from([OCTET, TEXT, JSON]),
    start=st.integers(0, 10**12),
    messages=st.lists(st.binary(min_size=1, max_size=12), min_size=1, max_size=20),
    cut=st.floats(0, 1.2), lo=st.integers(0, 300), span=st.one_of(st.none(), st.integers(0, 300)),
)
def test_columnar_rows_equal_row_by_row_for_any_chunk(ctype: str, start: int, messages: list[bytes], cut: float,
                                                      lo: int, span: int | None) -> None:
    if ctype == JSON:
        messages = [m.replace(b",", b"") or b"0" for m in messages]  # (bytes only: not parsed here)
    obj = chunk(start, messages, ctype)
    end = start + sum(len(m) + (1 if ctype == JSON else 0) for m in messages)
    cap = min(end, start + 1 + int((end - start) * cut))
    target = rows.Target("s", "b", ctype, start + lo, None if span is None else start + lo + span)
    fast, slow = both(target, ref(start, cap), obj)
    assert fast.equals(slow), (fast.to_pylist(), slow.to_pylist())


@settings(max_examples=100, deadline=None)
@given(
    ctype=st.sampled_from([OCTET, TEXT, JSON]),
    messages=st.lists(st.binary(min_size=1, max_size=12), min_size=1, max_size=20),
    columns=st.lists(st.sampled_from(rows.COLUMNS), min_size=1, max_size=10, unique=True),
    first_chunk=st.booleans(),
)
def test_a_projection_is_those_columns_of_the_full_batch(ctype: str, messages: list[bytes], columns: list[str],
                                                        first_chunk: bool) -> None:
    """Only some columns asked for (in any order): the same as selecting them from every column
    (invalid UTF-8 included: the row path then answers)."""
    if ctype == JSON:
        messages = [m.replace(b",", b"") or b"0" for m in messages]
    start = 0 if first_chunk else 77
    obj = chunk(start, messages, ctype)
    end = start + sum(len(m) + (1 if ctype == JSON else 0) for m in messages)
    target = rows.Target("s", None, ctype)
    full = rows.chunk_batch(target, ref(start, end), obj)
    got = rows.chunk_batch(target, ref(start, end), obj, columns)
    assert got.schema.names == columns
    assert got.equals(full.select(columns)), (got.to_pylist(), full.select(columns).to_pylist())
