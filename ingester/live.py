"""Wake-ups for long-poll and SSE readers when a commit changes a stream.

Each stream path has a version that the writer's durable-commit callback bumps (on the
event loop). A reader notes the version before it reads; if no data was there it waits
for the version to move past what it noted, so a commit landing between its read and its
wait is never missed."""

from __future__ import annotations

import asyncio


class Notifier:
    def __init__(self) -> None:
        self._versions: dict[str, int] = {}
        self._events: dict[str, asyncio.Event] = {}
        self.waiting = 0

    def version(self, path: str) -> int:
        return self._versions.get(path, 0)

    def bump(self, paths: set[str]) -> None:
        for path in paths:
            self._versions[path] = self._versions.get(path, 0) + 1
            ev = self._events.pop(path, None)
            if ev is not None:
                ev.set()

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

    def wake_all(self) -> None:
        """Shutdown: release every waiter."""
        for ev in self._events.values():
            ev.set()
        self._events.clear()
