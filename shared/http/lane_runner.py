"""Serving an app with fast-lane connections: LaneRunner is aiohttp's AppRunner whose server
makes LaneHandlers (shared/http/lane_connection.py), and whose SIGTERM/SIGINT can drain what
is in flight before the process ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_runner import GracefulExit

from shared.http.lane import LANE, Lane
from shared.http.lane_connection import LaneHandler

log = logging.getLogger("ds3.http")


class LaneServer(web.Server):
    """aiohttp's low-level server, making LaneHandlers."""

    def __init__(self, *args: Any, lane: Lane, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lane = lane

    def __call__(self) -> RequestHandler:
        return LaneHandler(self, lane=self.lane, loop=self._loop, **self._kwargs)

    def pre_shutdown(self) -> None:
        for conn in self._connections:
            if isinstance(conn, LaneHandler):
                conn.draining = True
        super().pre_shutdown()


class LaneRunner(web.AppRunner):
    """web.AppRunner whose connections get a fast lane (use it like an AppRunner). Subclasses
    name their Lane, and whether SIGTERM/SIGINT drain (`drain_on_signal`, see setup)."""

    lane_class: type[Lane] = Lane
    # With handle_signals, aiohttp's own handler raises GracefulExit out of the event loop: under
    # asyncio.run (ds3/cli.py _run) every task is then cancelled at once, handlers and live
    # channels included, so nothing in flight is answered; the runner's cleanup only runs
    # amid that. True: the signal starts the cleanup (stop listening, on_shutdown, wait up
    # to shutdown_timeout for the requests in flight, the app's cleanup) while everything
    # still runs, and GracefulExit is raised only once it is done.
    drain_on_signal: bool = False

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        # Request bodies reach the handlers as sent: read_body decodes their Content-Encoding
        # (shared.http.codings). aiohttp's own decoding took a truncated gzip stream for a whole
        # one and passed codings it does not decode on still encoded.
        super().__init__(app, **{**kwargs, "auto_decompress": False})
        self.lane = self.lane_class(app)
        app[LANE] = self.lane
        self._cleaning: asyncio.Future[None] | None = None
        self._leaving = False  # a signal came while the app started: leaving (setup)

    async def setup(self) -> None:
        self._cleaning = None
        self._leaving = False
        if not (self.drain_on_signal and self._handle_signals):
            await super().setup()
            return
        loop = asyncio.get_running_loop()
        # While the app starts, the first signal ends the start as aiohttp's own handler would
        # (GracefulExit out of the loop: asyncio.run cancels every task and waits for them); a
        # second one is ignored. Raised again (the process group's SIGINT, then a supervisor's
        # SIGTERM), it broke off that wait and the loop closed on a pending task ("Task was
        # destroyed but it is pending!").
        with contextlib.suppress(NotImplementedError):  # (no signal handlers on Windows)
            loop.add_signal_handler(signal.SIGINT, self._on_signal_starting, signal.SIGINT)
            loop.add_signal_handler(signal.SIGTERM, self._on_signal_starting, signal.SIGTERM)
        self._handle_signals = False  # (aiohttp's setup would install its own over ours)
        try:
            await super().setup()
        finally:
            # (its cleanup removes the handlers; not the ignoring ones of a start cut short)
            self._handle_signals = not self._leaving
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGINT, self._on_signal, signal.SIGINT)
            loop.add_signal_handler(signal.SIGTERM, self._on_signal, signal.SIGTERM)

    def _on_signal_starting(self, signum: int) -> None:
        if self._leaving:
            return
        self._leaving = True
        self._handle_signals = False  # (so the cleanup leaves this handler, ignoring, to the loop's close)
        log.info("%s while starting: stopping", signal.Signals(signum).name)
        raise GracefulExit()

    def _on_signal(self, signum: int) -> None:
        if self._cleaning is not None:
            return  # draining already (a process group's SIGTERM and the supervisor's both come)
        log.info("%s: draining (new connections refused, requests in flight get up to %g s)",
                 signal.Signals(signum).name, self._shutdown_timeout)
        # aiohttp's cleanup ends by removing the signal handlers, which put the default action
        # back for the rest of the exit (asyncio.run still cancels tasks and waits for threads):
        # a second SIGTERM then (a supervisor's, after the process group's) killed the process.
        # This handler stays, ignoring, until the loop closes.
        self._handle_signals = False
        self._cleaning = asyncio.ensure_future(super().cleanup())
        self._cleaning.add_done_callback(_leave)

    async def cleanup(self) -> None:
        """Once, however many callers ask (the drain started by a signal, and the code that made
        the runner, whose `finally` runs when GracefulExit ends the loop)."""
        if not self.drain_on_signal:
            await super().cleanup()
            return
        if self._cleaning is None:
            self._cleaning = asyncio.ensure_future(super().cleanup())
        await asyncio.shield(self._cleaning)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return LaneServer(
            server.request_handler, request_factory=server.request_factory, lane=self.lane,
            handler_cancellation=server.handler_cancellation, loop=server._loop, **server._kwargs,
        )


def _leave(cleaned: asyncio.Future[None]) -> None:
    """The drain is over: end the event loop as aiohttp's signal handler would have."""
    if not cleaned.cancelled() and cleaned.exception() is not None:
        log.error("the shutdown failed", exc_info=cleaned.exception())
    raise GracefulExit()
