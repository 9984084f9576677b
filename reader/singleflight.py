"""Single flight: concurrent calls with the same key share one run of the work.

The work runs as a task of its own, and every caller (the one that started it included)
awaits it shielded. A caller that goes away (its client disconnected, so aiohttp cancelled
its handler) is cancelled alone: the work goes on and the other callers get its result.
Awaited directly by the first caller instead, the work would be cancelled with it, and the
CancelledError would become everybody's answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    def __init__(self, name: str) -> None:
        self.name = name
        self._running: dict[K, asyncio.Task[V]] = {}
        self.started = 0  # runs of the work
        self.joined = 0  # calls that shared a run another call started

    def __contains__(self, key: K) -> bool:
        return key in self._running

    async def do(self, key: K, work: Callable[[], Coroutine[Any, Any, V]]) -> V:
        task = self._running.get(key)
        if task is None:
            task = asyncio.create_task(work(), name=f"ds3-{self.name}")
            self._running[key] = task
            task.add_done_callback(lambda t: self._finished(key, t))
            self.started += 1
        else:
            self.joined += 1
        return await asyncio.shield(task)

    def _finished(self, key: K, task: asyncio.Task[V]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled():
            task.exception()  # retrieved: the callers re-raise it; with none left, nobody logs it as lost
