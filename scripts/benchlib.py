"""What the bench scripts share: where things are, and free ports on 127.0.0.1.
(Imported as a sibling module: the scripts run as `python scripts/bench_*.py`.)"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DS3 = ROOT / ".venv" / "bin" / "ds3"
MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine_speed() -> dict[str, float]:
    """How fast this machine runs Python and syscalls right now (best of 5 short probes): this
    VM's speed moves from day to day (a Python loop step 50-150 ns), and ds3's figures with it,
    more than the Node reference's, so a result is read with the speed it was measured at."""

    def best(f: Callable[[], None], n: int) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return round(min(times) / n * 1e9, 1)

    def loop() -> None:
        x = 0
        for i in range(200_000):
            x += i

    def calls() -> None:
        for _ in range(50_000):
            os.getppid()

    return {"python_loop_ns": best(loop, 200_000), "syscall_ns": best(calls, 50_000)}
