"""Long-polls on the fast lanes (both services): which queries are plain long-polls, and a
long-poll's place among the live requests (the per-client live cap and the live gauge, as
shared/http/limits.py and shared/http/access.py count aiohttp's)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

from shared.errors import TooManyRequests
from shared.http.lane import CONCRETE_OFFSET, Lane, Message
from shared.http.lane_connection import LaneHandler
from shared.http.limits import LIVE_RETRY_AFTER

_CURSOR: Final = re.compile(rb"\d{1,18}")


def long_poll_query(query: bytes) -> tuple[str, str | None] | None:
    """(offset, cursor) of a plain long-poll query (offset=<concrete offset>&live=long-poll
    [&cursor=<digits>], any order, each once), else None."""
    offset = cursor = None
    live = False
    for part in query.split(b"&"):
        key, _, value = part.partition(b"=")
        if key == b"offset" and offset is None and CONCRETE_OFFSET.fullmatch(value):
            offset = value.decode()
        elif key == b"live" and not live and value == b"long-poll":
            live = True
        elif key == b"cursor" and cursor is None and _CURSOR.fullmatch(value):
            cursor = value.decode()
        else:
            return None
    return (offset, cursor) if offset is not None and live else None


def live_slot(lane: Lane, handler: LaneHandler, msg: Message) -> Callable[[], None]:
    """Take a long-poll's place: the client's live cap (TooManyRequests when it is full; a
    reader's own requests to the ingester are not counted, the reader caps its clients) and the
    live gauge. The release it returns may be called more than once."""
    lim, http = lane.limits, lane.http
    assert lim is not None and http is not None
    client = None if msg.internal else handler.client(msg)
    if client is not None and not lim.live.acquire(client):
        raise TooManyRequests(
            f"too many live connections: at most {lim.live.cap} long-poll or SSE {'stream' if lim.live.cap == 1 else 'streams'} at once per client",
            LIVE_RETRY_AFTER,
        )
    http.live["long-poll"] += 1
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            http.live["long-poll"] -= 1
            if client is not None:
                lim.live.release(client)

    return release
