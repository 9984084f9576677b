"""MemberOwners.call (shared/owner_watch.py), the way an ingester calls another cluster member:
a call that is itself cancelled (a shutdown) just as its send failed leaves no "Task exception
was never retrieved" behind (ds3 dev stopped with Ctrl-C while a member moved streams logged
one, with the refused connection's traceback, as an ERROR)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from shared.owner_watch import MemberOwners


async def test_a_call_cancelled_as_its_send_fails_leaves_no_unretrieved_exception() -> None:
    loop = asyncio.get_running_loop()
    reported = _report_into(loop)
    members = MemberOwners(None)
    go = asyncio.Event()

    async def send(url: str) -> int:
        await go.wait()
        raise ConnectionRefusedError(111, f"Connect call failed ({url})")

    outer = asyncio.ensure_future(members.call("i3", "http://127.0.0.1:9", send))
    for _ in range(3):
        await asyncio.sleep(0)  # the call waits on its send
    go.set()
    await asyncio.sleep(0)  # the send fails; the call has not resumed yet
    outer.cancel()  # ... and is cancelled before it does
    with pytest.raises(asyncio.CancelledError):
        await outer
    del outer
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()
    assert not _never_retrieved(reported), reported


async def test_a_failed_send_still_reaches_the_caller() -> None:
    members = MemberOwners(None)

    async def send(url: str) -> int:
        raise ConnectionRefusedError(111, f"Connect call failed ({url})")

    with pytest.raises(ConnectionRefusedError):
        await members.call("i3", "http://127.0.0.1:9", send)
    assert await members.call("i3", "http://127.0.0.1:9", _answer) == 7


async def _answer(url: str) -> int:
    return 7


async def test_a_move_done_failing_as_the_ingester_stops_is_not_logged_as_lost() -> None:
    """A move that finished as the ingester stopped: its move-done to the old owner failed on the
    closed session ("Session is closed") before Mover.stop could cancel it, and asyncio logged
    "Task exception was never retrieved" as an ERROR (tests/test_dev_settings.py's Ctrl-C test,
    about 1 run in 12). The done callback retrieves it, and forgets the task."""
    import functools
    from types import SimpleNamespace

    from ingester.moves import Mover

    loop = asyncio.get_running_loop()
    reported = _report_into(loop)

    async def closed() -> None:
        raise RuntimeError("Session is closed")

    mover = SimpleNamespace(_telling=set())
    task = loop.create_task(closed())
    mover._telling.add(task)
    task.add_done_callback(functools.partial(Mover._told, mover))  # type: ignore[arg-type]
    await asyncio.wait([task])
    await asyncio.sleep(0)  # (done callbacks run soon after)
    assert mover._telling == set()
    del task
    gc.collect()
    assert not _never_retrieved(reported), reported


def _report_into(loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    """What the loop's exception handler is given from now on (asyncio's "never retrieved"
    reports among them), collected instead of logged."""
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    return reported


def _never_retrieved(reported: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in reported if "never retrieved" in str(c.get("message", ""))]
