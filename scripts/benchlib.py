"""What the bench scripts share: where things are, and free ports on 127.0.0.1.
(Imported as a sibling module: the scripts run as `python scripts/bench_*.py`.)"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DS3 = ROOT / ".venv" / "bin" / "ds3"
MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def best_of(runs: int, f: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of `runs` calls of `f`: (seconds, its result)."""
    best: tuple[float, Any] | None = None
    for _ in range(runs):
        t = time.perf_counter()
        out = f()
        took = time.perf_counter() - t
        if best is None or took < best[0]:
            best = (took, out)
    assert best is not None
    return best
