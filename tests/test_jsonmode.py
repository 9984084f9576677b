"""shared/jsonmode.py: JSON-mode validation, one-level array flattening and the stored
framing. Clients get back exactly the messages they posted, as one JSON array."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared import jsonmode
from shared.errors import BadRequest

SPLIT = [
    pytest.param(b'{"event": "created"}', [b'{"event": "created"}'], id="object"),
    pytest.param(b"42", [b"42"], id="number"),
    pytest.param(b'"hi"', [b'"hi"'], id="string"),
    pytest.param(b"null", [b"null"], id="null"),
    pytest.param(b"true", [b"true"], id="true"),
    pytest.param(b"-0.5e-3", [b"-0.5e-3"], id="exponent-number"),
    pytest.param(b'[{"event": "a"}, {"event": "b"}]', [b'{"event": "a"}', b'{"event": "b"}'],
                 id="array-of-objects"),
    pytest.param(b"[1,2,3]", [b"1", b"2", b"3"], id="array-of-numbers"),
    pytest.param(b"[[1,2], [3,4]]", [b"[1,2]", b"[3,4]"], id="nested-arrays-flatten-one-level"),
    pytest.param(b"[[[1]]]", [b"[[1]]"], id="triple-nested"),
    pytest.param(b"[[]]", [b"[]"], id="array-holding-empty-array"),
    pytest.param(b"[{}]", [b"{}"], id="array-holding-empty-object"),
    pytest.param(b"[null, null]", [b"null", b"null"], id="nulls"),
    pytest.param(b'  \n\t{"a": 1}\r\n ', [b'{"a": 1}'], id="whitespace-trimmed-around-value"),
    pytest.param(b' [ 1 ,\n 2 ] ', [b"1", b"2"], id="whitespace-trimmed-around-elements"),
    pytest.param(b'[{ "a" :\n  1 }]', [b'{ "a" :\n  1 }'], id="whitespace-kept-inside-element"),
    pytest.param(b'{\n  "a": [1, 2],\n  "b": "x"\n}', [b'{\n  "a": [1, 2],\n  "b": "x"\n}'],
                 id="pretty-object"),
    pytest.param(b'["a,b", "c]d", "[e"]', [b'"a,b"', b'"c]d"', b'"[e"'], id="strings-with-commas-brackets"),
    pytest.param(b'["line1\\nline2", "tab\\t"]', [b'"line1\\nline2"', b'"tab\\t"'], id="escaped-newlines"),
    pytest.param(b'["\\"quoted\\"", "back\\\\slash"]', [b'"\\"quoted\\""', b'"back\\\\slash"'], id="escapes"),
    pytest.param('["é", "漢字", "🎉"]'.encode(), ['"é"'.encode(), '"漢字"'.encode(), '"🎉"'.encode()],
                 id="utf8"),
    pytest.param(b'["\\u00e9\\ud83c\\udf89"]', [b'"\\u00e9\\ud83c\\udf89"'],
                 id="unicode-escapes-kept-verbatim"),
    pytest.param(b'{"a": {"b": {"c": [1, {"d": null}]}}}', [b'{"a": {"b": {"c": [1, {"d": null}]}}}'],
                 id="deep-object"),
    pytest.param(b'[1e400]', [b"1e400"], id="float-overflow-is-still-valid-json"),
    pytest.param(b"[" + b"1" * 5000 + b"]", [b"1" * 5000], id="5000-digit-integer-is-valid-json"),
]


@pytest.mark.parametrize(("body", "messages"), SPLIT)
def test_split_messages(body: bytes, messages: list[bytes]) -> None:
    assert jsonmode.split_messages(body, allow_empty_array=False) == messages
    assert jsonmode.split_messages(body, allow_empty_array=True) == messages


@pytest.mark.parametrize("body", [b"[]", b"[ ]", b" [\n] ", b"[\t]"])
def test_empty_array_only_on_create(body: bytes) -> None:
    assert jsonmode.split_messages(body, allow_empty_array=True) == []
    with pytest.raises(BadRequest) as e:
        jsonmode.split_messages(body, allow_empty_array=False)
    assert "empty JSON array" in e.value.message


INVALID = [
    pytest.param(b"", id="empty"),
    pytest.param(b"   \n", id="only-whitespace"),
    pytest.param(b"{", id="unterminated-object"),
    pytest.param(b"[1, 2", id="unterminated-array"),
    pytest.param(b"[1,]", id="trailing-comma"),
    pytest.param(b"[,1]", id="leading-comma"),
    pytest.param(b"[1 2]", id="missing-comma"),
    pytest.param(b"[1]]", id="extra-bracket"),
    pytest.param(b"[1] x", id="garbage-after-array"),
    pytest.param(b"[] x", id="garbage-after-empty-array"),
    pytest.param(b'{"a":1} {"b":2}', id="two-values"),
    pytest.param(b'{"a":1}x', id="garbage-after-object"),
    pytest.param(b"1 2", id="two-numbers"),
    pytest.param(b"NaN", id="NaN"),
    pytest.param(b"[NaN]", id="NaN-element"),
    pytest.param(b"Infinity", id="Infinity"),
    pytest.param(b"[-Infinity]", id="minus-Infinity"),
    pytest.param(b'{"a": NaN}', id="NaN-inside"),
    pytest.param(b"{'a': 1}", id="single-quotes"),
    pytest.param(b"{a: 1}", id="unquoted-key"),
    pytest.param(b"undefined", id="undefined"),
    pytest.param(b"01", id="leading-zero"),
    pytest.param(b"+1", id="plus"),
    pytest.param(b".5", id="bare-fraction"),
    pytest.param(b"0x10", id="hex"),
    pytest.param(b'"unterminated', id="unterminated-string"),
    pytest.param(b'"raw\nnewline"', id="raw-newline-in-string"),
    pytest.param(b'"raw\x01control"', id="raw-control-in-string"),
    pytest.param(b'"bad \\x escape"', id="bad-escape"),
    pytest.param(b"\xff\xfe[1]", id="not-utf8-bom"),
    pytest.param(b'["\xc3"]', id="truncated-utf8"),
    pytest.param(b'["\xed\xa0\x80"]', id="utf8-encoded-surrogate"),
    pytest.param("\ufeff[1]".encode(), id="utf8-bom"),
    pytest.param(b"[1]\x00", id="trailing-nul"),
    pytest.param(b"// comment\n1", id="comment"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-array-nesting"),
    pytest.param(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, id="deep-object-nesting"),
    pytest.param(b"[[" * 50_000 + b"]]" * 50_000, id="deep-nesting-inside-element"),
]


@pytest.mark.parametrize("body", INVALID)
def test_split_messages_rejects_invalid(body: bytes) -> None:
    for allow in (False, True):
        with pytest.raises(BadRequest) as e:
            jsonmode.split_messages(body, allow_empty_array=allow)
        assert "JSON" in e.value.message
        assert len(e.value.message) < 500


@pytest.mark.parametrize(
    "message", [b"1", b"{}", b'{"a": [1, 2]}', b'"a,b,"', b'"x"', b"[1,2]", "\"é\"".encode()]
)
def test_frame_unframe(message: bytes) -> None:
    stored = jsonmode.frame(message)
    assert stored == message + b","
    assert jsonmode.unframe(stored) == message


@pytest.mark.parametrize(
    "values",
    [
        [],
        [1],
        [{"a": 1}, {"b": [1, 2]}],
        ["a,b", "c]d", "[e", "line\nbreak"],
        [[1, 2], [3, 4], [], {}],
        [None, True, False, 0, -1.5, "é漢🎉"],
    ],
)
def test_render_stored_is_the_array_of_the_messages(values: list[Any]) -> None:
    stored = b"".join(jsonmode.frame(json.dumps(v).encode()) for v in values)
    rendered = jsonmode.render_stored(stored)
    assert json.loads(rendered) == values


def test_split_then_store_then_render_preserves_every_message() -> None:
    bodies = [
        b'{"n": 1}',
        b'[{"n": 2}, {"n": 3}]',
        b' [ [4, 5] , "six,6" ]\n',
        b'{\n  "n": 7,\n  "text": "a\\nb"\n}',
    ]
    expected: list[Any] = [{"n": 1}, {"n": 2}, {"n": 3}, [4, 5], "six,6", {"n": 7, "text": "a\nb"}]
    stored = b"".join(
        jsonmode.frame(m) for body in bodies for m in jsonmode.split_messages(body, allow_empty_array=False)
    )
    assert json.loads(jsonmode.render_stored(stored)) == expected
    # any message-aligned sub-slice renders to the matching sub-list
    messages = [
        jsonmode.frame(m) for body in bodies for m in jsonmode.split_messages(body, allow_empty_array=False)
    ]
    for i in range(len(messages)):
        for j in range(i, len(messages) + 1):
            assert json.loads(jsonmode.render_stored(b"".join(messages[i:j]))) == expected[i:j]


def test_render_empty_is_empty_array() -> None:
    assert jsonmode.render_stored(b"") == b"[]"
