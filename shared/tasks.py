"""Background tasks that nobody awaits: one way to start them.

asyncio keeps only a weak reference to a task, so a task started and dropped can be collected
mid-run; and a task that fails with nobody retrieving its exception makes asyncio log "Task
exception was never retrieved" as an ERROR when it is collected, often long after, with no word
of what the task was for. `spawn` keeps the task in a set the caller owns (its shutdown cancels
and awaits that set) until it ends, then retrieves the outcome: a failure is logged once, at
WARNING, naming what failed; a cancellation is silent (shutdown does that)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("ds3.tasks")


def spawn(coro: Coroutine[Any, Any, T], tasks: set[asyncio.Task[Any]], what: str,
          *, logger: logging.Logger | None = None) -> asyncio.Task[T]:
    """Start `coro` as a task held in `tasks` until it ends; `what` names it in the log line
    if it fails ("closing a relay failed: ...")."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(partial(_ended, tasks, what, logger or log))
    return task


def _ended(tasks: set[asyncio.Task[Any]], what: str, logger: logging.Logger, task: asyncio.Task[Any]) -> None:
    tasks.discard(task)
    if task.cancelled():
        return
    error = task.exception()  # (retrieved: asyncio no longer reports it)
    if error is not None:
        logger.warning("%s failed: %r", what, error, exc_info=error)
