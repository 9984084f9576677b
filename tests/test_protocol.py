"""shared/protocol.py: header, path and content-type rules. Every malformed value must be
a BadRequest (a clear 400), never another exception (a 500) and never silently accepted."""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime

import pytest

from shared import protocol as P
from shared.errors import BadRequest

# --- Stream-TTL ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0", 0), ("1", 1), ("3600", 3600), ("86400", 86400), (str(P.MAX_TTL_SECONDS), P.MAX_TTL_SECONDS)],
)
def test_parse_ttl_valid(text: str, seconds: int) -> None:
    assert P.parse_ttl(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("03600", id="leading-zero"),
        pytest.param("00", id="double-zero"),
        pytest.param("+3600", id="plus"),
        pytest.param("-1", id="negative"),
        pytest.param("3.6e3", id="exponent"),
        pytest.param("3600.0", id="decimal-point"),
        pytest.param(" 1", id="leading-space"),
        pytest.param("1 ", id="trailing-space"),
        pytest.param("1\n", id="trailing-newline"),
        pytest.param("1_000", id="underscore"),
        pytest.param("0x10", id="hex"),
        pytest.param("１", id="fullwidth-digit"),
        pytest.param("٣", id="arabic-indic-digit"),
        pytest.param("abc", id="letters"),
        pytest.param(str(P.MAX_TTL_SECONDS + 1), id="over-max"),
        pytest.param("9" * 30, id="huge"),
        pytest.param("9" * 5000, id="over-int-str-digits-limit"),
    ],
)
def test_parse_ttl_invalid(text: str) -> None:
    with pytest.raises(BadRequest) as e:
        P.parse_ttl(text)
    assert "Stream-TTL" in e.value.message


@pytest.mark.parametrize("text", [str(P.MAX_TTL_SECONDS + 1), "9" * 20, "9" * 21, "9" * 23, "9" * 5000])
def test_parse_ttl_too_large_says_the_limit(text: str) -> None:
    """A well-formed TTL over the cap is too large, whatever its length (over 20 digits it was
    called malformed)."""
    with pytest.raises(BadRequest, match=f"at most {P.MAX_TTL_SECONDS} seconds"):
        P.parse_ttl(text)


@pytest.mark.parametrize(("name", "value", "why"), [
    ("Stream-TTL", "0", "Stream-TTL is 0: the stream would be expired at once"),
    ("Stream-Expires-At", "2000-01-01T00:00:00Z", "would be expired at once"),
    ("Stream-Expires-At", "9999-12-31T23:59:59Z", f"at most {P.MAX_TTL_SECONDS} seconds"),
])
def test_a_create_whose_expiry_cannot_be_is_refused(name: str, value: str, why: str) -> None:
    """TTL 0 answered 201 for a stream that was 404 at once; an Expires-At centuries ahead was
    taken although a TTL is capped at 100 years."""
    from ingester.http import create_request

    with pytest.raises(BadRequest, match=why):
        create_request(lambda h: value if h == name else None, "s", 480)


def test_a_create_expiring_within_the_cap_is_taken() -> None:
    from ingester.http import create_request

    soon = P.format_rfc3339(time.time() + P.MAX_TTL_SECONDS - 60)
    assert create_request(lambda h: soon if h == "Stream-Expires-At" else None, "s", 480).expires_at is not None


# --- Stream-Expires-At ----------------------------------------------------------------------

_T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("text", "epoch"),
    [
        ("2025-01-02T03:04:05Z", _T0),
        ("2025-01-02T03:04:05z", _T0),
        ("2025-01-02t03:04:05Z", _T0),
        ("2025-01-02 03:04:05Z", _T0),
        ("2025-01-02T03:04:05+00:00", _T0),
        ("2025-01-02T03:04:05-00:00", _T0),
        ("2025-01-02T05:04:05+02:00", _T0),
        ("2025-01-01T22:34:05-04:30", _T0),
        ("2025-01-02T03:04:05.5Z", _T0 + 0.5),
        ("2025-01-02T03:04:05.250Z", _T0 + 0.25),
        ("2025-01-02T03:04:05.123456Z", _T0 + 0.123456),
        ("2025-01-02T03:04:05.123456789Z", _T0 + 0.123456),  # nanoseconds: truncated to micro
        ("2024-02-29T00:00:00Z", datetime(2024, 2, 29, tzinfo=UTC).timestamp()),
        ("1970-01-01T00:00:00Z", 0.0),
    ],
)
def test_parse_expires_at_valid(text: str, epoch: float) -> None:
    assert P.parse_expires_at(text) == pytest.approx(epoch, abs=1e-6)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("tomorrow", id="word"),
        pytest.param("2025-13-01T00:00:00Z", id="month-13"),
        pytest.param("2025-00-10T00:00:00Z", id="month-0"),
        pytest.param("2025-02-30T00:00:00Z", id="feb-30"),
        pytest.param("2023-02-29T00:00:00Z", id="not-a-leap-year"),
        pytest.param("2025-01-32T00:00:00Z", id="day-32"),
        pytest.param("2025-01-01T24:00:00Z", id="hour-24"),
        pytest.param("2025-01-01T00:60:00Z", id="minute-60"),
        pytest.param("2025-01-01T00:00:00", id="missing-zone"),
        pytest.param("2025-01-01", id="date-only"),
        pytest.param("2025-01-01T00:00Z", id="no-seconds"),
        pytest.param("2025-01-01T00:00:00+0000", id="zone-without-colon"),
        pytest.param("2025-01-01T00:00:00+24:00", id="zone-out-of-range"),
        pytest.param("2025-01-01T00:00:00+25:00", id="zone-hours-25"),
        pytest.param("2025-01-01T00:00:00+05:60", id="zone-minutes-60"),
        pytest.param("2025-01-01T00:00:00-05:99", id="zone-minutes-99"),
        pytest.param("2025-01-01T00:00:00.Z", id="empty-fraction"),
        pytest.param("2025-01-01T00:00:00.1234567890Z", id="ten-fraction-digits"),
        pytest.param("20250101T000000Z", id="basic-format"),
        pytest.param("1735689600", id="epoch-seconds"),
        pytest.param("Wed, 01 Jan 2025 00:00:00 GMT", id="http-date"),
        pytest.param("２025-01-01T00:00:00Z", id="fullwidth-digit"),
        pytest.param("2025-01-01T00:00:00Z junk", id="trailing-junk"),
    ],
)
def test_parse_expires_at_invalid(text: str) -> None:
    with pytest.raises(BadRequest) as e:
        P.parse_expires_at(text)
    assert "Stream-Expires-At" in e.value.message
    assert "timedelta" not in e.value.message  # (Python's words for a zone out of range, once)


def test_format_rfc3339_round_trips() -> None:
    text = P.format_rfc3339(_T0 + 0.25)
    assert text == "2025-01-02T03:04:05.250Z"
    assert P.parse_expires_at(text) == pytest.approx(_T0 + 0.25)


# --- producer headers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pid", "epoch", "seq", "expected"),
    [
        (None, None, None, None),
        ("p", "0", "0", P.ProducerHeaders("p", 0, 0)),
        ("order-service-1", "3", "17", P.ProducerHeaders("order-service-1", 3, 17)),
        ("p", str(P.MAX_SAFE_INTEGER), str(P.MAX_SAFE_INTEGER),
         P.ProducerHeaders("p", P.MAX_SAFE_INTEGER, P.MAX_SAFE_INTEGER)),
        ("x" * 256, "0", "0", P.ProducerHeaders("x" * 256, 0, 0)),
    ],
)
def test_parse_producer_valid(pid: str | None, epoch: str | None, seq: str | None,
                              expected: P.ProducerHeaders | None) -> None:
    assert P.parse_producer(pid, epoch, seq) == expected


@pytest.mark.parametrize(
    ("pid", "epoch", "seq", "needle"),
    [
        pytest.param("p", None, None, "together", id="id-only"),
        pytest.param(None, "0", None, "together", id="epoch-only"),
        pytest.param(None, None, "0", "together", id="seq-only"),
        pytest.param("p", "0", None, "together", id="no-seq"),
        pytest.param("p", None, "0", "together", id="no-epoch"),
        pytest.param(None, "0", "0", "together", id="no-id"),
        pytest.param("", "0", "0", "Producer-Id", id="empty-id"),
        pytest.param("x" * 257, "0", "0", "Producer-Id", id="id-over-256-bytes"),
        pytest.param("é" * 129, "0", "0", "Producer-Id", id="id-over-256-bytes-multibyte"),
        pytest.param("p", "1abc", "0", "Producer-Epoch", id="epoch-1abc"),
        pytest.param("p", "1e3", "0", "Producer-Epoch", id="epoch-1e3"),
        pytest.param("p", "-1", "0", "Producer-Epoch", id="epoch-negative"),
        pytest.param("p", "", "0", "Producer-Epoch", id="epoch-empty"),
        pytest.param("p", " 1", "0", "Producer-Epoch", id="epoch-space"),
        pytest.param("p", "1.0", "0", "Producer-Epoch", id="epoch-decimal"),
        pytest.param("p", "１", "0", "Producer-Epoch", id="epoch-fullwidth"),
        pytest.param("p", str(P.MAX_SAFE_INTEGER + 1), "0", "Producer-Epoch", id="epoch-over-2^53-1"),
        pytest.param("p", "0", "1abc", "Producer-Seq", id="seq-1abc"),
        pytest.param("p", "0", "1e3", "Producer-Seq", id="seq-1e3"),
        pytest.param("p", "0", "-1", "Producer-Seq", id="seq-negative"),
        pytest.param("p", "0", "+1", "Producer-Seq", id="seq-plus"),
        pytest.param("p", "0", str(P.MAX_SAFE_INTEGER + 1), "Producer-Seq", id="seq-over-2^53-1"),
        pytest.param("p", "0", "9" * 5000, "Producer-Seq", id="seq-over-int-str-digits-limit"),
        pytest.param("p", "9" * 5000, "0", "Producer-Epoch", id="epoch-over-int-str-digits-limit"),
        # aiohttp decodes header bytes that are not UTF-8 with surrogateescape
        pytest.param("p\udcff", "0", "0", "Producer-Id", id="id-not-utf8"),
    ],
)
def test_parse_producer_invalid(pid: str | None, epoch: str | None, seq: str | None, needle: str) -> None:
    with pytest.raises(BadRequest) as e:
        P.parse_producer(pid, epoch, seq)
    assert needle in e.value.message


# --- Stream-Closed flag -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False), ("", False), ("true", True), ("TRUE", True), ("True", True), (" true ", True),
        ("false", False), ("1", False), ("yes", False), ("truee", False), ("t", False), ("true,true", False),
    ],
)
def test_flag_true(value: str | None, expected: bool) -> None:
    assert P.flag_true(value) is expected


# --- stream paths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "a", "stream", "a/b", "a/b/c/d/e", "users/42/events", "a.b", "...", ".hidden", "a..b",
        "with space", "é/ü/漢字", "emoji-🎉", "a%2Fb", "x" * 480, "é" * 240,
    ],
)
def test_validate_stream_path_valid(path: str) -> None:
    assert P.validate_stream_path(path, 480) == path


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        pytest.param("", "empty", id="empty"),
        pytest.param("/a", "empty segment", id="leading-slash"),
        pytest.param("a/", "empty segment", id="trailing-slash"),
        pytest.param("a//b", "empty segment", id="double-slash"),
        pytest.param(".", "'.'", id="dot"),
        pytest.param("..", "'..'", id="dotdot"),
        pytest.param("a/./b", "'.'", id="inner-dot"),
        pytest.param("a/../b", "'..'", id="inner-dotdot"),
        pytest.param("a/..", "'..'", id="trailing-dotdot"),
        pytest.param("a\x00b", "NUL", id="nul"),
        pytest.param("a\nb", "control", id="newline"),
        pytest.param("a\rb", "control", id="cr"),
        pytest.param("a\tb", "control", id="tab"),
        pytest.param("a\x1fb", "control", id="unit-separator"),
        pytest.param("a\x7fb", "control", id="del"),
        pytest.param("x" * 481, "longer than 480 bytes", id="481-ascii"),
        pytest.param("é" * 241, "longer than 480 bytes", id="482-bytes-in-241-chars"),
        pytest.param("漢" * 161, "longer than 480 bytes", id="483-bytes-in-161-chars"),
        pytest.param("a\udcffb", "UTF-8", id="not-utf8"),
    ],
)
def test_validate_stream_path_invalid(path: str, needle: str) -> None:
    with pytest.raises(BadRequest) as e:
        P.validate_stream_path(path, 480)
    assert needle in e.value.message


def test_validate_stream_path_limit_is_the_configured_one() -> None:
    assert P.validate_stream_path("x" * 10, 10) == "x" * 10
    with pytest.raises(BadRequest):
        P.validate_stream_path("x" * 11, 10)


# --- content types ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "media", "json", "sse_text", "valid"),
    [
        (None, "", False, False, False),
        ("", "", False, False, False),
        ("application/json", "application/json", True, True, True),
        ("Application/JSON; charset=utf-8", "application/json", True, True, True),
        ("  application/json  ;charset=utf-8", "application/json", True, True, True),
        ("application/json-seq", "application/json-seq", False, False, True),
        ("application/ndjson", "application/ndjson", False, False, True),
        ("text/plain", "text/plain", False, True, True),
        ("TEXT/HTML; charset=utf-8", "text/html", False, True, True),
        ("text/event-stream", "text/event-stream", False, True, True),
        ("application/octet-stream", "application/octet-stream", False, False, True),
        ("application/x-protobuf", "application/x-protobuf", False, False, True),
        ("image/png", "image/png", False, False, True),
        ("textual/plain", "textual/plain", False, False, True),
        ("application/vnd.api+json", "application/vnd.api+json", False, False, True),
        ("json", "json", False, False, False),
        ("application/", "application/", False, False, False),
        ("/json", "/json", False, False, False),
        ("a/b/c", "a/b/c", False, False, False),
        ("text/plain x", "text/plain x", False, True, False),
    ],
)
def test_content_types(content_type: str | None, media: str, json: bool, sse_text: bool, valid: bool) -> None:
    assert P.media_type(content_type) == media
    assert P.is_json(content_type) is json
    assert P.is_text_for_sse(content_type) is sse_text
    if content_type is not None:
        assert P.is_valid_content_type(content_type) is valid


# --- cursors -------------------------------------------------------------------------------

_NOW = P.CURSOR_EPOCH + 1_000_000.0
_CURRENT = int(1_000_000 // P.CURSOR_INTERVAL_S)


@pytest.mark.parametrize(
    "client",
    [None, "", "abc", "-5", "1.5", "0", "1", str(_CURRENT - 1), "0" * 30 + "1", "１"],
)
def test_response_cursor_is_the_current_interval_for_old_or_bogus_cursors(client: str | None) -> None:
    assert P.response_cursor(client, now=_NOW) == str(_CURRENT)


# (19 digits and more used to get the current interval back, behind the client's cursor)
@pytest.mark.parametrize("client", [str(_CURRENT), str(_CURRENT + 1), str(_CURRENT + 500), "9" * 18, "9" * 19,
                                    "9" * 20, "99999999999999999999", "0" + "9" * 1000])
def test_response_cursor_moves_past_a_cursor_at_or_ahead_of_now(client: str) -> None:
    for _ in range(50):  # jitter is random: every draw must be strictly greater
        result = P.response_cursor(client, now=_NOW)
        assert result.isdigit()
        assert int(result) > int(client)
        assert int(result) <= int(client) + 3600 // P.CURSOR_INTERVAL_S


@pytest.mark.parametrize("client", ["9" * 1001, "1" + "0" * 5000, "9" * 8000])
def test_response_cursor_passes_a_cursor_too_long_for_int(client: str) -> None:
    result = P.response_cursor(client, now=_NOW)
    assert result.isdigit() and (len(result), result) > (len(client), client)


def test_response_cursor_tracks_time() -> None:
    later = P.response_cursor(None, now=_NOW + P.CURSOR_INTERVAL_S)
    assert int(later) == _CURRENT + 1


def test_response_cursor_chain_is_strictly_increasing() -> None:
    cursor: str | None = None
    seen: list[int] = []
    for _ in range(20):  # a client echoing each cursor within the same interval
        cursor = P.response_cursor(cursor, now=_NOW)
        seen.append(int(cursor))
    assert all(a < b for a, b in itertools.pairwise(seen))


@pytest.mark.parametrize(("if_none_match", "etag", "matches"), [
    ('"abc"', '"abc"', True),
    ('W/"abc"', '"abc"', True),  # If-None-Match compares weakly (RFC 9110 13.1.2)
    ('"abc"', 'W/"abc"', True),
    ('"x", "abc"', '"abc"', True),
    ('"x",W/"abc" ', '"abc"', True),
    ("*", '"abc"', True),
    ('"abcd"', '"abc"', False),
    ('"ab"', '"abc"', False),
    ("", '"abc"', False),
    (None, '"abc"', False),
    ('"abc"', None, False),
    ('"abc"', "", False),
])
def test_etag_matches(if_none_match: str | None, etag: str | None, matches: bool) -> None:
    assert P.etag_matches(if_none_match, etag) is matches
