"""Offset codec: an offset names the chunk that holds a stream position and the position.

Layout (33 ASCII characters, every field zero-padded decimal, so plain string order is
stream order):

    0000000000000003_0000000000123456
    |--- chunk id --| |-- position --|
       16 digits    _    16 digits

- position: the byte position in the stream's logical data (the offset points *after*
  the byte at position-1, i.e. it is where the next read starts).
- chunk id: the chunk whose data ends at or after `position - 1`, i.e. the chunk that
  held the stream's tail when this position was the tail.  Position 0 is named by the
  stream's first chunk (random per incarnation; reads take any chunk at position 0).  A
  reader can turn an offset into an object key without asking anyone (design §4); a
  position that is the exact end of a sealed chunk keeps naming that chunk, so an offset
  once issued never changes spelling.

`-1` (start) and `now` (tail) are sentinels; they are never issued.  This module is pure:
no aiohttp, no lmdb.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

DIGITS: Final = 16
MAX_FIELD: Final = 10**DIGITS - 1
_OFFSET_RE: Final = re.compile(r"\A([0-9]{16})_([0-9]{16})\Z")

START: Final = "-1"
NOW: Final = "now"


class OffsetSyntaxError(ValueError):
    """The text is neither a sentinel nor a well-formed ds3 offset."""


@dataclass(frozen=True, slots=True, order=True)
class Offset:
    chunk: int
    position: int

    def __post_init__(self) -> None:
        if not (0 <= self.chunk <= MAX_FIELD and 0 <= self.position <= MAX_FIELD):
            raise OffsetSyntaxError(f"offset field out of range: {self.chunk}, {self.position}")

    def __str__(self) -> str:
        return f"{self.chunk:016d}_{self.position:016d}"


ZERO: Final = Offset(0, 0)


def encode(chunk: int, position: int) -> str:
    return f"{chunk:016d}_{position:016d}"


def parse(text: str) -> Offset:
    """Parse a concrete offset (not a sentinel)."""
    m = _OFFSET_RE.match(text)
    if m is None:
        raise OffsetSyntaxError(f"malformed offset {text[:80]!r}: expected 16 digits '_' 16 digits")
    return Offset(int(m.group(1)), int(m.group(2)))


def parse_query(text: str | None) -> Offset | str:
    """Parse the `offset` query parameter: START, NOW, or an Offset. None means START."""
    if text is None or text == START:
        return START
    if text == NOW:
        return NOW
    m = _OFFSET_RE.match(text)
    if m is None:  # (here the sentinels are offsets too: the message names them)
        raise OffsetSyntaxError(f"malformed offset {text[:80]!r}: expected -1, now, or 16 digits '_' 16 digits")
    return Offset(int(m.group(1)), int(m.group(2)))
