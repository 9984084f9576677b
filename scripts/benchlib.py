"""What the bench scripts share: where things are, and free ports on 127.0.0.1.
(Imported as a sibling module: the scripts run as `python scripts/bench_*.py`.)"""

from __future__ import annotations

import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DS3 = ROOT / ".venv" / "bin" / "ds3"
MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
