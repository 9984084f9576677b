"""A TCP relay on 127.0.0.1 that tests can cut and restore: "the object store is down".

Stopping moto's ThreadedMotoServer does not do it (werkzeug's shutdown leaves the listening
socket bound and keeps serving open keep-alive connections), so clients are pointed at a gate
in front of the store instead:

    gate = TcpGate(("127.0.0.1", moto_port)); gate.start()
    ... --s3-endpoint gate.url ...
    gate.down()     # refuse new connections and reset every open one
    gate.up()       # listen again on the same port
    gate.delay = 0.5  # add latency to each piece relayed towards the target (slow uploads)
    gate.stop()

The relay runs its own asyncio loop in a daemon thread, so synchronous and asyncio tests
can both drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class TcpGate:
    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target = target
        self.port = port
        self.delay = 0.0  # seconds slept before relaying each piece client -> target
        self.accepted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcpgate", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> TcpGate:
        self._thread.start()
        self.up()
        return self

    def up(self) -> None:
        self._call(self._listen())

    def down(self) -> None:
        self._call(self._close())

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def is_up(self) -> bool:
        return self._server is not None

    async def _listen(self) -> None:
        if self._server is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self._server = await asyncio.start_server(self._serve, sock=sock)

    async def _close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for w in list(self._writers):
            # An abortive close (RST): the peer sees a reset, as with a crashed store.
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:
            writer.transport.abort()
            return
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if slow and self.delay:
                        await asyncio.sleep(self.delay)
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        try:
            await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))
        finally:
            self._writers.discard(writer)
            self._writers.discard(up_writer)
