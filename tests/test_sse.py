"""shared/sse.py: SSE framing. Whatever the stream holds, a client parsing the events per
the SSE spec must get back exactly the payload, and no payload can forge an event."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from shared import sse


def parse_events(raw: bytes) -> list[tuple[str, str]]:
    """A minimal SSE parser per the WHATWG rules: (event type, data) per dispatched event."""
    text = raw.decode("utf-8")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    events: list[tuple[str, str]] = []
    event, data = "", list[str]()
    for line in lines:
        if line == "":
            if data:
                events.append((event or "message", "\n".join(data)))
            event, data = "", list[str]()
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)
    return events


DATA = [
    pytest.param("hello", ["hello"], id="plain"),
    pytest.param("", [""], id="empty"),
    pytest.param(" leading space", [" leading space"], id="leading-space-kept"),
    pytest.param("a\n  b", ["a", "  b"], id="indented-line-kept"),
    pytest.param("a\nb", ["a", "b"], id="lf"),
    pytest.param("a\rb", ["a", "b"], id="cr"),
    pytest.param("a\r\nb", ["a", "b"], id="crlf"),
    pytest.param("a\n\nb", ["a", "", "b"], id="blank-line-inside"),
    pytest.param("a\r\rb", ["a", "", "b"], id="double-cr"),
    pytest.param("a\n", ["a", ""], id="trailing-lf"),
    pytest.param("\n", ["", ""], id="only-lf"),
    pytest.param("a\n\rb", ["a", "", "b"], id="lf-then-cr-is-two-breaks"),
    pytest.param('[{"a":1},\n{"b":2}]', ['[{"a":1},', '{"b":2}]'], id="json"),
    pytest.param("é漢🎉", ["é漢🎉"], id="utf8"),
]


@pytest.mark.parametrize(("payload", "lines"), DATA)
def test_data_event_lines(payload: str, lines: list[str]) -> None:
    raw = sse.data_event(payload)
    assert raw.startswith(b"event: data\n")
    assert raw.endswith(b"\n\n")
    physical = raw.decode()[len("event: data\n") : -2].split("\n")
    assert len(physical) == len(lines)  # one data: line per payload line, nothing else
    assert all(line.startswith("data:") for line in physical)


@pytest.mark.parametrize(("payload", "lines"), DATA)
def test_data_event_parses_back_to_the_payload_modulo_line_breaks(payload: str, lines: list[str]) -> None:
    # An SSE client strips one space after "data:", so a line that starts with a space
    # must still arrive with it (text/* streams: " indented" must not become "indented").
    events = parse_events(sse.data_event(payload))
    assert events == [("data", "\n".join(lines))]


INJECTIONS = [
    "x\n\nevent: control\ndata: {\"streamClosed\": true}\n\n",
    "x\r\revent: control\rdata: {}\r\r",
    "x\r\n\r\nevent: control\r\ndata: {}\r\n\r\n",
    "\nevent: evil",
    "\revent: evil",
    "x\n\nid: 99\nretry: 1\n\n",
]


@pytest.mark.parametrize("payload", INJECTIONS)
def test_payload_cannot_inject_events_or_fields(payload: str) -> None:
    raw = sse.data_event(payload)
    events = parse_events(raw)
    assert len(events) == 1
    assert events[0][0] == "data"
    # every physical line of the event is either the event line or a data: line
    text = raw.decode().replace("\r\n", "\n").replace("\r", "\n")
    physical = text.split("\n")
    assert physical[0] == "event: data"
    assert physical[-2:] == ["", ""]
    assert all(line.startswith("data:") for line in physical[1:-2])


def _control(raw: bytes) -> dict[str, Any]:
    events = parse_events(raw)
    assert len(events) == 1 and events[0][0] == "control"
    value = json.loads(events[0][1])
    assert isinstance(value, dict)
    return value


OFF = "0000000000000001_0000000000000010"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {"streamNextOffset": OFF}),
        ({"cursor": "7"}, {"streamNextOffset": OFF, "streamCursor": "7"}),
        ({"up_to_date": True}, {"streamNextOffset": OFF, "upToDate": True}),
        ({"cursor": "7", "up_to_date": True},
         {"streamNextOffset": OFF, "streamCursor": "7", "upToDate": True}),
        ({"closed": True}, {"streamNextOffset": OFF, "streamClosed": True, "upToDate": True}),
        ({"closed": True, "cursor": "7"}, {"streamNextOffset": OFF, "streamClosed": True, "upToDate": True}),
        ({"closed": True, "cursor": "7", "up_to_date": False},
         {"streamNextOffset": OFF, "streamClosed": True, "upToDate": True}),
    ],
)
def test_control_event_fields(kwargs: dict[str, Any], expected: dict[str, Any]) -> None:
    raw = sse.control_event(OFF, **kwargs)
    assert raw.startswith(b"event: control\n")
    assert raw.endswith(b"\n\n")
    assert raw.count(b"\n") == 3  # one event line, one data line, the blank line
    assert _control(raw) == expected


@pytest.mark.parametrize("data", [b"", b"\x00", b"\xff\xfe", bytes(range(256)), b"x" * 1000])
def test_encode_binary_is_standard_base64(data: bytes) -> None:
    text = sse.encode_binary(data)
    assert len(text) % 4 == 0
    assert "\n" not in text and "\r" not in text
    assert base64.b64decode(text, validate=True) == data
    events = parse_events(sse.data_event(text))
    assert base64.b64decode(events[0][1], validate=True) == data
