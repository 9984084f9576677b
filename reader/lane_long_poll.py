"""Long-polls on the reader's forwarding lane (reader/forwardlane.py): a plain long-poll at a
concrete offset that the stream's live channel follows parks on the channel with a callback
instead of a handler task, and is answered from the channel's answers (reader/fanout.py) as
reader/http.py handle_get's first branch answers it, with the limits' live cap and the live
gauge of the access middleware; a client that leaves frees its place at once."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final

from reader.fanout import Answer
from reader.proxy import DROP_RESPONSE, Upstream
from shared import protocol as P
from shared.errors import Unavailable
from shared.http.lane import Message
from shared.http.lane_connection import LaneHandler
from shared.http.lane_live import live_slot
from shared.logs import REQUEST_ID_HEADER

if TYPE_CHECKING:
    from reader.forwardlane import ForwardLane

# The ingester's own answer headers that the reader writes itself (shared.http.lane_connection, LaneHandler._reply):
# hop-by-hop ones, Date, Server, the request id and the common headers.
DROP_ANSWER_HEADERS: Final = frozenset(n.encode("ascii") for n in DROP_RESPONSE) | {
    REQUEST_ID_HEADER.lower().encode(), b"x-content-type-options", b"cross-origin-resource-policy",
    b"access-control-allow-origin", b"access-control-expose-headers", b"content-security-policy",
}


def serve_long_poll(lane: ForwardLane, handler: LaneHandler, msg: Message, rid: str, started: float) -> None:
    """Answered from the stream's live channel (reader.fanout.LiveHub.join), as
    reader.http.handle_get's first branch answers it, with the limits' live cap and the
    live gauge of the access middleware."""
    st, http = lane.st, lane.http
    assert st is not None and http is not None
    offset, cursor = msg.note
    path = lane.stream_path(handler, msg)
    release = live_slot(lane, handler, msg)
    try:
        joined = st.sse.join(path, offset)
    except BaseException:
        release()
        raise
    if joined is None:  # (the channel moved on between accepts() and now: cannot happen)
        release()
        raise Unavailable("the live channel moved on; retry", 1)
    if isinstance(joined, Answer):
        release()
        answer_page(handler, msg, joined, cursor, rid, started)
        return
    ch, fut = joined

    gone = False

    def done(f: asyncio.Future[Answer | Upstream | None]) -> None:
        ch.waiters.pop(f, None)
        if gone or f.cancelled():
            return
        release()
        handler.pending_cancel = None
        e = f.exception()
        if e is not None:
            handler.answer_failure(msg, e, rid, started)
            return
        result = f.result()
        if result is None:
            headers = st.sse.no_content_headers(offset, cursor)
            handler.answer(msg, 204, headers, b"", rid, started)
        elif isinstance(result, Answer):
            answer_page(handler, msg, result, cursor, rid, started)
        else:
            handler.answer(msg, result.status, {}, result.body, rid, started, head=upstream_head(result))

    def cancel() -> None:  # the client left (or the server stops) while it waited
        nonlocal gone
        gone = True
        ch.waiters.pop(fut, None)
        fut.cancel()
        release()
        handler.abandoned(msg, started)

    fut.add_done_callback(done)
    handler.pending_cancel = cancel

def answer_page(handler: LaneHandler, msg: Message, ans: Answer, cursor: str | None, rid: str,
                 started: float) -> None:
    head = ans.raw_head
    if head is None:
        head = ans.raw_head = b"".join(
            f"{k}: {v}\r\n".encode("latin-1", "replace") for k, v in ans.headers.items()
            if k.lower().encode("latin-1", "replace") not in DROP_ANSWER_HEADERS
        ) + b"Content-Length: %d\r\n" % len(ans.body)
    cursor_line = b"Stream-Cursor: " + P.response_cursor(cursor).encode() + b"\r\n"
    handler.answer(msg, 200, {}, ans.body, rid, started, head=head + cursor_line)


def upstream_head(up: Upstream) -> bytes:
    """An upstream answer's headers as reader.proxy.to_response passes them on."""
    lines = [f"{k}: {v}\r\n".encode("latin-1", "replace") for k, v in up.headers.items()
             if k.lower().encode("latin-1", "replace") not in DROP_ANSWER_HEADERS]
    if up.status not in (204, 304):
        lines.append(b"Content-Length: %d\r\n" % len(up.body))
    return b"".join(lines)
