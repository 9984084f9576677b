"""Request bodies' content codings (RFC 9110 §8.4): the one place both services decode them.

aiohttp's server decoding is off in both services (shared.http.lane_runner.LaneRunner): it
took a gzip stream cut off before its trailer for a whole one (a partial body was appended),
and passed a body in a coding it does not decode (`foo`, `x-gzip`, `gzip, gzip`) on still
encoded (appended as such). read_body (shared.http.handlers) reads the body as sent and decodes
it here, for the ingester and the reader alike (the reader forwards the decoded body):

- identity, gzip, x-gzip (gzip's alias, RFC 9110 §8.4.1.3) and deflate (the zlib format,
  RFC 1950; a raw RFC 1951 stream, which some clients send as deflate, is taken too, as aiohttp
  took it), names in any case. A list is decoded last-applied first (it names the codings in
  the order they were applied), at most MAX_CODINGS of them; identity is no coding at all.
  Any other coding is 415 naming the ones accepted (UnsupportedMediaType);
- each stream must be whole (its end reached, its checksum right) with nothing after it: else
  400, and nothing is stored;
- the decoded body is held to the request's body limit (413) as it is decoded, not after: a
  small body that inflates far beyond the limit (a "gzip bomb") never takes more memory.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable, Sequence
from typing import Final

from shared.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

ACCEPTED: Final = "identity, gzip, x-gzip, deflate"  # also sent as the 415's Accept-Encoding
MAX_CODINGS: Final = 4  # codings one body may be encoded with (each decoded up to the limit)
_NAMES: Final = {"gzip": "gzip", "x-gzip": "gzip", "deflate": "deflate"}
_IN_A_THREAD: Final = 8 * 1024  # bodies sent larger than this are decoded off the event loop


def parse(values: Iterable[str]) -> tuple[str, ...]:
    """The codings Content-Encoding header values name, in the order they were applied, each
    "gzip" or "deflate" (identity and empty list elements left out); UnsupportedMediaType for
    any other coding, or for more than MAX_CODINGS."""
    out: list[str] = []
    for value in values:
        for item in value.split(","):
            name = item.strip(" \t")
            coding = _NAMES.get(name.lower()) if name.isascii() else None
            if coding is not None:
                out.append(coding)
            elif name and name.lower() != "identity":
                raise UnsupportedMediaType(
                    f"Content-Encoding {name[:40]!r} is not supported: send the body in one of {ACCEPTED}"
                )
    if len(out) > MAX_CODINGS:
        raise UnsupportedMediaType(f"Content-Encoding names {len(out)} codings: at most {MAX_CODINGS} are decoded "
                                   f"(of {ACCEPTED})")
    return tuple(out)


def decode(body: bytes, codings: Sequence[str], limit: int) -> bytes:
    """`body` as sent, encoded with `codings` (parse's), decoded: BadRequest if a stream is not
    whole or has bytes after its end, PayloadTooLarge if it decodes to more than `limit` bytes.
    An empty body stays empty (no body at all: nothing was encoded)."""
    if not body:
        return body
    for coding in reversed(codings):
        body = _inflate(body, coding, limit)
    return body


async def decode_async(body: bytes, codings: Sequence[str], limit: int) -> bytes:
    """decode, in a thread for a body of some size (zlib lets go of the GIL while it works: a
    body inflating to the limit takes tens of milliseconds the event loop keeps)."""
    if len(body) <= _IN_A_THREAD:
        return decode(body, codings, limit)
    return await asyncio.to_thread(decode, body, codings, limit)


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    if coding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0:
        wbits = zlib.MAX_WBITS  # the zlib format (RFC 9110 §8.4.1.2)
    else:
        wbits = -zlib.MAX_WBITS  # a raw deflate stream
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, limit + 1)  # stops one byte past the limit
    except zlib.error as e:
        raise BadRequest(f"the request body could not be read: it is not valid {coding} data "
                         f"(Content-Encoding {coding}: {e})") from None
    if len(out) > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes once decoded (Content-Encoding {coding})")
    if not d.eof:
        raise BadRequest(f"the request body could not be read: its {coding} stream is cut off before its end "
                         f"(Content-Encoding {coding})")
    if d.unused_data:  # (a second gzip member, too: one stream per coding)
        n = len(d.unused_data)
        raise BadRequest(f"the request body could not be read: it goes on for {n} byte{'s' * (n != 1)} after the "
                         f"end of its {coding} stream (Content-Encoding {coding})")
    return out
