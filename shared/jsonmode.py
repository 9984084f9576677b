"""JSON mode (protocol §7.1): validate a body and split it into messages.

A POST body that is an array contributes each element as one message (one level of
flattening); any other JSON value is one message. Each message keeps its original text
(surrounding whitespace trimmed), so stored bytes are exactly what the client sent.

Stored framing: every JSON message is stored followed by one `,` (DELIMITER) and stream
positions count it, so any message-aligned range of a JSON stream is one contiguous byte
slice `m1,m2,...,mn,` and the GET body is `[` + slice without its last byte + `]`.
"""

from __future__ import annotations

import json
from typing import Any, Final

from shared.errors import BadRequest

_WS: Final = " \t\r\n"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# Values are only validated, never used: skipping int() also accepts integers of any length
# (int() refuses 4300+ digits).
_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant, parse_int=lambda _s: 0)


def split_messages(body: bytes, *, allow_empty_array: bool) -> list[bytes]:
    """Return the messages a JSON body contributes (raises BadRequest when invalid)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest("invalid JSON: body is not UTF-8") from e
    n = len(text)
    i = _skip_ws(text, 0)
    if i == n:
        raise BadRequest("invalid JSON: empty body")
    try:
        if text[i] != "[":
            _value, end = _DECODER.raw_decode(text, i)
            if _skip_ws(text, end) != n:
                raise BadRequest("invalid JSON: trailing characters after the value")
            return [text[i:end].encode("utf-8")]
        messages: list[bytes] = []
        i = _skip_ws(text, i + 1)
        if i < n and text[i] == "]":
            if _skip_ws(text, i + 1) != n:
                raise BadRequest("invalid JSON: trailing characters after the array")
            if not allow_empty_array:
                raise BadRequest("empty JSON array: an append must contain at least one message")
            return []
        while True:
            _value, end = _DECODER.raw_decode(text, i)
            messages.append(text[i:end].encode("utf-8"))
            i = _skip_ws(text, end)
            if i < n and text[i] == ",":
                i = _skip_ws(text, i + 1)
                continue
            if i < n and text[i] == "]":
                if _skip_ws(text, i + 1) != n:
                    raise BadRequest("invalid JSON: trailing characters after the array")
                return messages
            raise BadRequest("invalid JSON: expected ',' or ']' in array")
    except json.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON: {e.msg} at character {e.pos}") from e
    except ValueError as e:  # NaN / Infinity, or recursion limits
        raise BadRequest(f"invalid JSON: {e}") from e
    except RecursionError as e:
        raise BadRequest("invalid JSON: nested too deeply") from e


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


DELIMITER: Final = b","


def frame(message: bytes) -> bytes:
    """A message as stored: its text and the delimiter."""
    return message + DELIMITER


def unframe(stored: bytes) -> bytes:
    """A stored message back to the client's text."""
    return stored[:-1] if stored.endswith(DELIMITER) else stored


def render_stored(stored: bytes) -> bytes:
    """GET body for a message-aligned slice of a JSON stream: one array."""
    if not stored:
        return b"[]"
    return b"[" + unframe(stored) + b"]"
