"""shared/tasks.py: a background task nobody awaits is held until it ends, and its failure is
logged once, naming what failed, instead of asyncio's "Task exception was never retrieved"."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest

from shared.tasks import spawn


def _asyncio_reports(loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    reports: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reports.append(context))
    return reports


async def test_a_failure_is_logged_once_naming_the_task(caplog: pytest.LogCaptureFixture) -> None:
    reports = _asyncio_reports(asyncio.get_running_loop())
    tasks: set[asyncio.Task[Any]] = set()

    async def fails() -> None:
        raise OSError("the disk is full")

    with caplog.at_level(logging.WARNING, logger="ds3.tasks"):
        task = spawn(fails(), tasks, "deleting the abandoned snapshot s/1")
        assert task in tasks
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert tasks == set()
    del task
    gc.collect()
    failed = [r for r in caplog.records if r.name == "ds3.tasks"]
    assert [r.getMessage() for r in failed] == [
        "deleting the abandoned snapshot s/1 failed: OSError('the disk is full')"]
    assert failed[0].levelno == logging.WARNING
    assert reports == []  # asyncio had nothing left to report


async def test_the_callers_logger_is_used(caplog: pytest.LogCaptureFixture) -> None:
    tasks: set[asyncio.Task[Any]] = set()

    async def fails() -> None:
        raise ValueError("bad")

    own = logging.getLogger("ds3.sealing")
    with caplog.at_level(logging.WARNING):
        await asyncio.gather(spawn(fails(), tasks, "dropping", logger=own), return_exceptions=True)
        await asyncio.sleep(0)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("ds3.sealing", "dropping failed: ValueError('bad')")]


async def test_success_and_cancellation_are_silent(caplog: pytest.LogCaptureFixture) -> None:
    reports = _asyncio_reports(asyncio.get_running_loop())
    tasks: set[asyncio.Task[Any]] = set()
    never = asyncio.Event()
    with caplog.at_level(logging.DEBUG, logger="ds3.tasks"):
        done = spawn(asyncio.sleep(0, result=7), tasks, "sleeping")
        stuck = spawn(never.wait(), tasks, "waiting")
        assert await done == 7
        stuck.cancel()
        await asyncio.gather(stuck, return_exceptions=True)
        await asyncio.sleep(0)
    assert tasks == set()
    assert [r for r in caplog.records if r.name == "ds3.tasks"] == []
    assert reports == []


async def test_the_task_is_held_while_it_runs() -> None:
    """Only the caller's set refers to it: it still runs to its end (asyncio's own reference is weak)."""
    tasks: set[asyncio.Task[Any]] = set()
    finished = asyncio.Event()

    async def slow() -> None:
        for _ in range(5):
            await asyncio.sleep(0)
            gc.collect()
        finished.set()

    spawn(slow(), tasks, "slow")
    await asyncio.wait_for(finished.wait(), 5)
    await asyncio.sleep(0)
    assert tasks == set()
