"""ingester/live.Notifier: what long-poll and SSE readers wait on. A change after the version a
reader noted is never missed, whether it waits with a task (`wait`) or a callback (`watch`, the
fast lane's long-polls), and a watch given up (`forget`) is never called."""

from __future__ import annotations

import asyncio

from ingester.live import Notifier


def test_a_watch_is_called_once_by_the_next_change() -> None:
    n = Notifier()
    calls: list[str] = []
    assert n.watch("/a", n.version("/a"), lambda: calls.append("a"))
    assert n.waiting == 1
    n.bump({"/b"})
    assert calls == []
    n.bump({"/a"})
    n.bump({"/a"})
    assert calls == ["a"] and n.waiting == 0


def test_a_change_before_the_watch_is_not_missed() -> None:
    n = Notifier()
    seen = n.version("/a")
    n.bump({"/a"})  # (a commit landed between the read and the watch)
    assert not n.watch("/a", seen, lambda: None)
    assert n.waiting == 0


def test_a_forgotten_watch_is_not_called_and_others_still_are() -> None:
    n = Notifier()
    calls: list[int] = []

    def first() -> None:
        calls.append(1)

    def second() -> None:
        calls.append(2)

    n.watch("/a", 0, first)
    n.watch("/a", 0, second)
    n.forget("/a", first)
    n.forget("/a", first)  # (twice: harmless)
    assert n.waiting == 1
    n.bump({"/a"})
    assert calls == [2] and n.waiting == 0


def test_a_failing_callback_does_not_keep_the_others_waiting() -> None:
    n = Notifier()
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    n.watch("/a", 0, broken)
    n.watch("/a", 0, lambda: calls.append("ok"))
    n.bump({"/a"})
    assert calls == ["ok"] and n.waiting == 0


def test_a_watch_made_by_a_callback_waits_for_the_next_change() -> None:
    """A long-poll woken by a commit reads, finds nothing for it (say) and watches again: that
    watch is for the next commit, not the one running its wake-ups."""
    n = Notifier()
    calls: list[str] = []

    def again() -> None:
        calls.append("woke")
        n.watch("/a", n.version("/a"), lambda: calls.append("next"))

    n.watch("/a", 0, again)
    n.bump({"/a"})
    assert calls == ["woke"] and n.waiting == 1
    n.bump({"/a"})
    assert calls == ["woke", "next"] and n.waiting == 0


def test_shutdown_wakes_tasks_and_callbacks() -> None:
    async def main() -> tuple[bool, list[str]]:
        n = Notifier()
        calls: list[str] = []
        n.watch("/a", 0, lambda: calls.append("cb"))
        waiter = asyncio.ensure_future(n.wait("/b", 0, 30))
        await asyncio.sleep(0)
        n.wake_all()
        return await asyncio.wait_for(waiter, 5), calls

    woke, calls = asyncio.run(main())
    assert woke and calls == ["cb"]
