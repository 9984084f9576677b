"""Signals that reach a drain-on-signal server twice (shared/http/lane_runner.py): the process
group's, then a supervisor's. While it starts, the first ends the start, a second is ignored;
after a drain, a second in the last moments of the exit is ignored too.

While starting, the second signal used to raise GracefulExit again while asyncio.run cancelled
the starting task, and the process ended with "Task was destroyed but it is pending!"
(tests/test_dev_settings.py's Ctrl-C test, once in a CI run)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# A server whose app's cleanup context is CONTEXT (a function named `context`), printing
# "started" once it serves and "exited" once asyncio.run is over.
SERVER = """
import asyncio, logging, sys, time
from aiohttp import web
from aiohttp.web_runner import GracefulExit
from shared.http.lane_runner import LaneRunner

logging.basicConfig(level=logging.INFO, stream=sys.stderr)

class Runner(LaneRunner):
    drain_on_signal = True

CONTEXT

async def serve():
    app = web.Application()
    app.cleanup_ctx.append(context)
    runner = Runner(app, handle_signals=True)
    try:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        print("started", flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()

try:
    asyncio.run(serve())
except (GracefulExit, KeyboardInterrupt):
    pass
print("exited", flush=True)
"""

SLOW_START = """
async def context(app):
    print("starting", flush=True)
    await asyncio.to_thread(time.sleep, 2.0)  # (a start that waits on a thread: a restore, a lease)
    yield
"""

THREAD_AFTER_CLEANUP = """
async def context(app):
    yield
    # (a thread still finishing when the app's cleanup is over: asyncio.run waits for it)
    asyncio.get_running_loop().run_in_executor(None, time.sleep, 1.5)
    print("cleaned", flush=True)
"""


def _run(context: str, signal_it: Callable[[subprocess.Popen[str]], None]) -> tuple[int, str, str]:
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", SERVER.replace("CONTEXT", context)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        signal_it(proc)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def test_two_signals_while_starting_end_the_process_cleanly() -> None:
    def signal_it(proc: subprocess.Popen[str]) -> None:
        assert _line(proc) == "starting"
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)

    code, out, err = _run(SLOW_START, signal_it)
    assert code == 0, err
    assert "exited" in out and "started" not in out, (out, err)
    assert "destroyed but it is pending" not in err, err
    assert "while starting: stopping" in err, err


def test_a_signal_after_the_drain_does_not_kill_the_exit() -> None:
    """The drain's last step (aiohttp's cleanup) removed the signal handlers: a second SIGTERM
    in the last moments of the exit (a supervisor's, after the process group's) killed it."""
    def signal_it(proc: subprocess.Popen[str]) -> None:
        assert _line(proc) == "started"
        proc.send_signal(signal.SIGTERM)
        assert _line(proc) == "cleaned"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)

    code, out, err = _run(THREAD_AFTER_CLEANUP, signal_it)
    assert code == 0, err
    assert "exited" in out, (out, err)
    assert "SIGTERM: draining" in err, err
