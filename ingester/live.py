"""Wake-ups for long-poll and SSE readers when a commit changes a stream.

Each stream path has a version that the writer's durable-commit callback bumps (on the
event loop). A reader notes the version before it reads; if no data was there it waits
for the version to move past what it noted, so a commit landing between its read and its
wait is never missed. Handler tasks await `wait`; the fast lane's long-polls, which have no
task, `watch` with a callback instead."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("ds3.ingester.live")


class Notifier:
    def __init__(self) -> None:
        self._versions: dict[str, int] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._watchers: dict[str, set[Callable[[], None]]] = {}
        self.waiting = 0

    def version(self, path: str) -> int:
        return self._versions.get(path, 0)

    def bump(self, paths: set[str]) -> None:
        for path in paths:
            self._versions[path] = self._versions.get(path, 0) + 1
            ev = self._events.pop(path, None)
            if ev is not None:
                ev.set()
            watchers = self._watchers.pop(path, None)
            if watchers:
                self._call(watchers)

    async def wait(self, path: str, seen: int, timeout: float) -> bool:
        """True when `path` changed after version `seen`; False on timeout."""
        if self.version(path) != seen:
            return True
        ev = self._events.get(path)
        if ev is None:
            ev = self._events[path] = asyncio.Event()
        self.waiting += 1
        try:
            await asyncio.wait_for(ev.wait(), timeout)
            return True
        except TimeoutError:
            return self.version(path) != seen
        finally:
            self.waiting -= 1

    def watch(self, path: str, seen: int, callback: Callable[[], None]) -> bool:
        """Call `callback` once, on the loop, when `path` changes after version `seen` (or at
        shutdown). False, with nothing registered, when it already has; forget() a watch that
        is no longer wanted."""
        if self.version(path) != seen:
            return False
        self._watchers.setdefault(path, set()).add(callback)
        self.waiting += 1
        return True

    def forget(self, path: str, callback: Callable[[], None]) -> None:
        watchers = self._watchers.get(path)
        if watchers is not None and callback in watchers:
            watchers.discard(callback)
            self.waiting -= 1
            if not watchers:
                del self._watchers[path]

    def _call(self, watchers: set[Callable[[], None]]) -> None:
        self.waiting -= len(watchers)
        for callback in watchers:
            try:
                callback()
            except Exception:  # one waiter's failure must not keep the others (or the commit) waiting
                log.exception("a long-poll's wake-up failed")

    def wake_all(self) -> None:
        """Shutdown: release every waiter."""
        for ev in self._events.values():
            ev.set()
        self._events.clear()
        watchers, self._watchers = self._watchers, {}
        for ws in watchers.values():
            self._call(ws)
