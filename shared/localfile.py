"""Writing a small local file so that a crash leaves the old content or the new, whole: a
temp file beside it, fsync, rename over it, fsync of the directory (without the last step
the rename itself may not survive a power cut)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path


def write_durably(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Locked(Exception):
    """Another process holds the lock (`holder`: the pid it wrote, or '?')."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by process {holder}")
        self.path = path
        self.holder = holder


def hold_lock(path: Path) -> int:
    """Take an exclusive lock on `path` (created if missing) for as long as this process runs
    (the descriptor is returned and never closed; the kernel drops the lock when the process
    ends, SIGKILL included). Locked if another process holds it. The pid is written into the
    file, for the message."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        finally:
            os.close(fd)
        raise Locked(path, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
