"""shared/offsets.py: the offset codec. Offsets are what clients resume from, so a wrong
spelling or a wrong order loses or repeats data; malformed input must be refused."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from shared import offsets
from shared.offsets import NOW, START, Offset, OffsetSyntaxError

MAX = offsets.MAX_FIELD

ROUND_TRIP = [
    (0, 0, "0000000000000000_0000000000000000"),
    (0, 1, "0000000000000000_0000000000000001"),
    (1, 0, "0000000000000001_0000000000000000"),
    (3, 123456, "0000000000000003_0000000000123456"),
    (12, 10**15, "0000000000000012_1000000000000000"),
    (MAX, MAX, "9999999999999999_9999999999999999"),
    (MAX, 0, "9999999999999999_0000000000000000"),
]


@pytest.mark.parametrize(("chunk", "position", "text"), ROUND_TRIP)
def test_encode_parse_round_trip(chunk: int, position: int, text: str) -> None:
    assert offsets.encode(chunk, position) == text
    assert str(Offset(chunk, position)) == text
    parsed = offsets.parse(text)
    assert parsed == Offset(chunk, position)
    assert str(parsed) == text
    assert len(text) == 33


def test_zero_is_the_start_of_every_stream() -> None:
    assert str(offsets.ZERO) == "0000000000000000_0000000000000000"


# Pairs in stream order around chunk boundaries: a position that ends chunk c keeps naming c,
# the next record starts chunk c+1 at a greater position.
_POINTS = [
    (0, 0), (0, 1), (0, 9), (0, 10), (1, 10), (1, 11), (1, 99), (1, 100), (1, 101),
    (2, 101), (2, 999), (2, 1000), (9, 1000), (10, 1000), (10, 1001), (11, 10**9),
    (99, 10**12), (100, 10**12 + 1), (MAX - 1, MAX - 1), (MAX - 1, MAX), (MAX, MAX),
]


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(_POINTS, 2)))
def test_string_order_is_chunk_then_position_order(a: tuple[int, int], b: tuple[int, int]) -> None:
    ea, eb = offsets.encode(*a), offsets.encode(*b)
    assert (ea < eb) == (Offset(*a) < Offset(*b)) == (a < b)
    assert (ea == eb) == (a == b)


def test_string_order_over_a_dense_grid() -> None:
    pairs = [(c, p) for c in (0, 1, 2, 9, 10, 11, 99, 100) for p in (0, 1, 9, 10, 11, 99, 100, 10**15)]
    assert sorted(pairs, key=lambda cp: offsets.encode(*cp)) == sorted(pairs)


BAD = [
    pytest.param("", id="empty"),
    pytest.param("0", id="one-digit"),
    pytest.param("00000000000000000000000000000000", id="no-underscore"),
    pytest.param("0000000000000000-0000000000000000", id="dash-separator"),
    pytest.param("0000000000000000__0000000000000000", id="double-underscore"),
    pytest.param("000000000000000_0000000000000000", id="15-digit-chunk"),
    pytest.param("0000000000000000_000000000000000", id="15-digit-position"),
    pytest.param("00000000000000000_0000000000000000", id="17-digit-chunk"),
    pytest.param("0000000000000000_00000000000000000", id="17-digit-position"),
    pytest.param(" 0000000000000000_0000000000000000", id="leading-space"),
    pytest.param("0000000000000000_0000000000000000 ", id="trailing-space"),
    pytest.param("0000000000000000_0000000000000000\n", id="trailing-newline"),
    pytest.param("0000000000000000_ 000000000000000", id="inner-space"),
    pytest.param("0000000000000000,0000000000000000", id="comma"),
    pytest.param("0000000000000000_0000000000000000,0000000000000000_0000000000000001", id="list"),
    pytest.param("-000000000000001_0000000000000000", id="negative-chunk"),
    pytest.param("0000000000000000_-000000000000001", id="negative-position"),
    pytest.param("+000000000000001_0000000000000000", id="plus-chunk"),
    pytest.param("0000000000000000_+000000000000001", id="plus-position"),
    pytest.param("000000000000000１_0000000000000000", id="fullwidth-digit"),
    pytest.param("0000000000000000_000000000000000٣", id="arabic-indic-digit"),
    pytest.param("0000000000000000_000000000000000𝟗", id="math-digit"),
    pytest.param("00000000000000a0_0000000000000000", id="hex-letter"),
    pytest.param("0x00000000000000_0000000000000000", id="hex-prefix"),
    pytest.param("-1", id="start-sentinel-is-not-concrete"),
    pytest.param("now", id="now-sentinel-is-not-concrete"),
    pytest.param("NOW", id="uppercase-now"),
    pytest.param("0000000000000000_0000000000000000\x00", id="nul"),
]


@pytest.mark.parametrize("text", BAD)
def test_parse_rejects_malformed(text: str) -> None:
    with pytest.raises(OffsetSyntaxError):
        offsets.parse(text)


@pytest.mark.parametrize("text", [t for t in BAD if t.values[0] not in ("-1", "now")])
def test_parse_query_rejects_malformed(text: str) -> None:
    with pytest.raises(OffsetSyntaxError):
        offsets.parse_query(text)


def test_syntax_error_message_names_the_input_and_the_format() -> None:
    with pytest.raises(OffsetSyntaxError) as e:
        offsets.parse("bogus")
    assert "bogus" in str(e.value)
    assert "16 digits" in str(e.value)


def test_syntax_error_message_is_bounded() -> None:
    with pytest.raises(OffsetSyntaxError) as e:
        offsets.parse("x" * 10_000)
    assert len(str(e.value)) < 300


@pytest.mark.parametrize(("chunk", "position"), [(-1, 0), (0, -1), (MAX + 1, 0), (0, MAX + 1)])
def test_offset_fields_out_of_range(chunk: int, position: int) -> None:
    with pytest.raises(OffsetSyntaxError):
        Offset(chunk, position)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, START),
        ("-1", START),
        ("now", NOW),
        ("0000000000000000_0000000000000000", Offset(0, 0)),
        ("0000000000000002_0000000000000042", Offset(2, 42)),
    ],
)
def test_parse_query(text: str | None, expected: Offset | str) -> None:
    assert offsets.parse_query(text) == expected


def test_sentinels_are_never_valid_offsets() -> None:
    # an issued offset can never be mistaken for a sentinel
    for chunk, position in _POINTS:
        assert offsets.encode(chunk, position) not in (START, NOW)


@pytest.mark.parametrize(
    ("parse", "text", "offers_sentinels"),
    [
        (offsets.parse, "-1", False),  # a concrete offset is wanted (Stream-Fork-Offset, snapshots)
        (offsets.parse, "now", False),
        (offsets.parse, "abc", False),
        (offsets.parse_query, "abc", True),  # the offset query parameter takes -1 and now too
        (offsets.parse_query, "1_2", True),
    ],
)
def test_a_malformed_offset_says_what_would_do(parse: Any, text: str, offers_sentinels: bool) -> None:
    """The message offered "-1, now" even where they are refused (Stream-Fork-Offset: -1 was
    told 'expected -1, now, or ...'; found by QA)."""
    with pytest.raises(offsets.OffsetSyntaxError) as e:
        parse(text)
    assert "16 digits '_' 16 digits" in str(e.value)
    assert ("-1, now" in str(e.value)) is offers_sentinels
