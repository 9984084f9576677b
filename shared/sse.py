"""Server-Sent Events framing for Durable Streams (protocol §5.8). Pure."""

from __future__ import annotations

import base64
import re
from typing import Final

import orjson

_LINE_BREAK: Final = re.compile(r"\r\n|\r|\n")


def _lines(payload: str) -> str:
    # Every line of the payload gets its own "data:". CR, LF and CRLF all split, so a payload
    # cannot inject events of its own. Clients strip one space after "data:", so a line that
    # starts with a space gets one more (the conformance suite wants "data:x" for the rest).
    return "".join(
        f"data: {line}\n" if line.startswith(" ") else f"data:{line}\n" for line in _LINE_BREAK.split(payload)
    )


def data_event(payload: str) -> bytes:
    return f"event: data\n{_lines(payload)}\n".encode()


def control_event(
    next_offset: str, *, cursor: str | None = None, up_to_date: bool = False, closed: bool = False
) -> bytes:
    body: dict[str, object] = {"streamNextOffset": next_offset}
    if closed:
        body["streamClosed"] = True
        body["upToDate"] = True
    else:
        if cursor is not None:
            body["streamCursor"] = cursor
        if up_to_date:
            body["upToDate"] = True
    return b"event: control\ndata:" + orjson.dumps(body) + b"\n\n"


def encode_binary(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
