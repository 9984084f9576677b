"""An S3 object body on its way to a reader's client (shared/objectstore/s3.py open_body).

Its own module so that a reader can tell one apart (reader/relay.py) without importing
botocore, which a process on the local-directory store never needs (~250 ms at start)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final

from .base import DEFAULT_CHUNK_SIZE

if TYPE_CHECKING:
    import aiohttp

    from .s3 import S3Store

_HOLD_BUFFER: Final = 8 * 1024 * 1024  # a held body's socket receive buffer, at most


class OpenBody:
    """An object body on its way: read it in pieces (pieces()), or, where the connection is
    plain HTTP and the body framed by its length, take it off the socket (detach()) to move it
    in the kernel (reader/relay.py splice_body) without reading it into Python. Such a body is
    held on its socket from the start (aiohttp stops reading it once the headers are in: a
    body asked for ahead waits in the kernel's buffers, not in Python's). close() releases the
    connection: back to the pool after a whole body read with pieces(), dropped otherwise."""

    def __init__(self, store: S3Store, key: str, resp: aiohttp.ClientResponse) -> None:
        self._store = store
        self._key = key
        self._resp = resp
        self._detached = False
        self._read = False
        self._held = self._hold()

    def _hold(self) -> tuple[bytes, int, int] | None:
        r = self._resp
        conn = r.connection
        if conn is None or conn.transport is None or conn.protocol is None:
            return None
        size = r.content_length
        if (size is None or r.url.scheme != "http" or conn.transport.get_extra_info("sslcontext") is not None
                or r.headers.get("Transfer-Encoding") or r.headers.get("Content-Encoding", "identity") != "identity"):
            return None
        sock = conn.transport.get_extra_info("socket")
        if sock is None:
            return None
        head = r.content.read_nowait()  # what came with the headers (this may resume reading:
        conn.protocol.pause_reading()   # paused again before the event loop runs)
        if size - len(head) > _HOLD_BUFFER // 8:
            with contextlib.suppress(OSError, AttributeError):
                # Room for the body in the kernel meanwhile: a body asked for ahead of its
                # request keeps arriving (the store sends on) until it is taken. (Fixed, and
                # large: the connection may be reused for other bodies.)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _HOLD_BUFFER)
        return head, sock.fileno(), size - len(head)

    async def pieces(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> AsyncIterator[bytes]:
        if self._detached:
            raise RuntimeError("the body was taken off its socket")
        self._read = True
        store = self._store
        if self._held is not None:  # aiohttp reads the rest after what was taken already
            head, self._held = self._held[0], None
            conn = self._resp.connection
            if conn is not None and conn.protocol is not None:
                conn.protocol.resume_reading()
            for at in range(0, len(head), chunk_size):
                piece = head[at:at + chunk_size]
                store.counters.bytes_in += len(piece)
                yield piece
        content = self._resp.content
        while True:
            with store._errors(self._key):
                piece = await content.read(chunk_size)
            if not piece:
                return
            store.counters.bytes_in += len(piece)
            yield piece

    def detach(self) -> tuple[bytes, int, int] | None:
        """(bytes read off the socket already, the socket's file descriptor, bytes still on
        it), aiohttp no longer reading it; or None (TLS, a body not framed by its length or
        encoded, or pieces() began): then read pieces()."""
        if self._held is None or self._read or self._detached:
            return None
        self._detached = True
        self._store.counters.bytes_in += len(self._held[0])
        return self._held

    def took(self, n: int) -> None:
        """`n` bytes of a detached body were moved (counted as read from the store)."""
        self._store.counters.bytes_in += n

    def close(self) -> None:
        if self._detached or self._held is not None:
            self._resp.close()  # the connection's parser never saw the rest: not reusable
        else:
            self._resp.release()
