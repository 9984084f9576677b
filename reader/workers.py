"""`ds3 reader --workers N`: N reader processes on one port, supervised by a parent.

A reader is stateless, so it scales over cores by running it N times. The parent starts each
worker as `ds3 reader` with the same arguments and DS3_READER_WORKER=<index> in its
environment. The parent makes the public listening sockets, one set per worker, bound with
SO_REUSEPORT, and keeps them open; worker i inherits set i. The kernel spreads new connections
over the sets by their addresses, so each worker gets its share (with one accept queue shared
by all, the worker that was awake took most of a burst of connections: 29 of 32 in the append
benchmark, one core busy and the other idle). Because the parent holds every set, a worker
that dies loses only the connections it had accepted: those queued on its socket wait there
for its replacement, which inherits the same socket. The parent serves nothing itself:

- a worker that dies is started again (after a short, capped pause); if workers keep dying as
  they start (a port in use, a bad setting the parent could not see), the parent gives up and
  exits 1 rather than spin;
- SIGTERM or SIGINT is passed to every worker, which drains like a single reader does
  (reader.forwardlane.ForwardLaneRunner: no new connections, parked long-polls are answered
  503 with Retry-After and SSE responses end, other requests in flight get up to 5 s), then the
  parent exits 0. The parent closes its copies of the listening sockets first: once the
  workers close theirs, new connections are refused rather than queued for nobody;
- workers stay in the parent's process group (a `kill -9 -PGID` takes them all) and leave by
  themselves when the parent is gone (they watch their parent pid).

Each worker also listens on a private unix socket, `<run dir>/worker-<index>.sock`, so the
worker that receives a scrape of /metrics can gather every sibling's (reader/worker_metrics.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

log = logging.getLogger("ds3.reader.workers")

WORKER_ENV: Final = "DS3_READER_WORKER"  # this process's index, 0..N-1 (set by the parent)
WORKERS_ENV: Final = "DS3_READER_WORKERS"  # N
RUN_DIR_ENV: Final = "DS3_READER_RUN_DIR"  # where the workers' metrics sockets live
PARENT_ENV: Final = "DS3_READER_PARENT"  # the parent's pid: a worker leaves when it changes
LISTEN_FDS_ENV: Final = "DS3_READER_LISTEN_FDS"  # the inherited listening sockets' descriptors, comma-separated
LISTEN_BACKLOG: Final = 1024
RUN_DIR_PREFIX: Final = "ds3-reader-"  # run dirs in the temp dir; a SIGKILLed parent's are swept later
PARENT_FILE: Final = "parent.pid"

QUICK_DEATH: Final = 2.0  # a worker that exits sooner than this after starting failed to start
MAX_QUICK_DEATHS: Final = 5  # in a row, over all workers: give up
RESTART_PAUSE_MAX: Final = 5.0


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What a worker knows of its place among its siblings (None when it runs alone)."""

    index: int
    count: int
    run_dir: Path
    parent: int

    def socket_path(self, index: int) -> Path:
        return self.run_dir / f"worker-{index}.sock"


def identity() -> WorkerIdentity | None:
    """This process's place among the reader's workers, from the parent's environment."""
    index = os.environ.get(WORKER_ENV)
    if index is None:
        return None
    return WorkerIdentity(int(index), int(os.environ[WORKERS_ENV]), Path(os.environ[RUN_DIR_ENV]),
                          int(os.environ[PARENT_ENV]))


@dataclass
class _Worker:
    index: int
    popen: subprocess.Popen[bytes]
    started: float


def listen(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """Listening sockets on `host`:`port` (one per address `host` resolves to), made by the
    parent for a worker to inherit; `reuse_port`: bound with SO_REUSEPORT, so that several sets
    share the port. OSError when one cannot be made (the port is taken)."""
    made: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE):
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            made.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(LISTEN_BACKLOG)
            sock.set_inheritable(True)
    except OSError:
        for sock in made:
            sock.close()
        raise
    return made


def listen_per_worker(host: str, port: int, count: int) -> list[list[socket.socket]]:
    """`count` sets of listening sockets sharing `host`:`port` (SO_REUSEPORT), one per worker.
    The port is first bound without SO_REUSEPORT, so that one another program holds (even a
    second ds3 reader, whose sockets would otherwise join the group) is refused: OSError."""
    for probe in listen(host, port):
        if port == 0:  # an ephemeral port: every set takes the one the kernel gave the probe
            port = probe.getsockname()[1]
        probe.close()
    sets: list[list[socket.socket]] = []
    try:
        for _ in range(count):
            sets.append(listen(host, port, reuse_port=True))
    except OSError:
        for made in sets:
            for sock in made:
                sock.close()
        raise
    return sets


def inherited_sockets() -> list[socket.socket] | None:
    """A worker's listening sockets, made by its parent; None when it has none (a lone reader)."""
    fds = os.environ.get(LISTEN_FDS_ENV)
    if not fds:
        return None
    return [socket.socket(fileno=int(fd)) for fd in fds.split(",")]


def supervise(argv: list[str], count: int, host: str, port: int) -> int:
    """Run `count` workers of `ds3 reader` with `argv`, each with its own listening sockets on
    `host`:`port` (listen_per_worker), until SIGTERM/SIGINT; the exit code."""
    stopping = False
    try:
        sets = listen_per_worker(host, port, count)
    except OSError as e:
        log.error("ds3 reader: cannot listen on %s port %d: %s", host, port, e)
        return 1

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sweep_stale_run_dirs()
    with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as run_dir:
        (Path(run_dir) / PARENT_FILE).write_text(str(os.getpid()))
        base_env = {**os.environ, WORKERS_ENV: str(count), RUN_DIR_ENV: run_dir, PARENT_ENV: str(os.getpid())}

        def start(index: int) -> _Worker:
            fds = [s.fileno() for s in sets[index]]
            env = {**base_env, WORKER_ENV: str(index), LISTEN_FDS_ENV: ",".join(map(str, fds))}
            popen = subprocess.Popen([sys.executable, "-m", "ds3.cli", "reader", *argv], env=env, pass_fds=fds)
            return _Worker(index, popen, time.monotonic())

        workers = [start(i) for i in range(count)]
        log.info("ds3 reader: %d workers (pids %s)", count, ", ".join(str(w.popen.pid) for w in workers))
        quick_deaths = 0
        code = 0
        try:
            while not stopping:
                time.sleep(0.1)
                for i, w in enumerate(workers):
                    rc = w.popen.poll()
                    if rc is None or stopping:
                        continue
                    lived = time.monotonic() - w.started
                    quick_deaths = quick_deaths + 1 if lived < QUICK_DEATH else 0
                    if quick_deaths >= MAX_QUICK_DEATHS:
                        log.error("reader workers keep exiting as they start (last: code %s); giving up", rc)
                        code = 1
                        stopping = True
                        break
                    pause = min(RESTART_PAUSE_MAX, 0.1 * 2 ** quick_deaths) if quick_deaths else 0.0
                    log.warning("reader worker %d (pid %d) exited with code %s after %.1f s; starting it again",
                                w.index, w.popen.pid, rc, lived)
                    time.sleep(pause)
                    if not stopping:
                        workers[i] = start(w.index)
        finally:
            for made in sets:  # (the workers hold them until they stop listening)
                for sock in made:
                    sock.close()
            _stop_all(workers)
    return code


def sweep_stale_run_dirs(tmp: Path | None = None) -> int:
    """Remove run dirs (and their worker sockets) left by parents that were SIGKILLed (their
    TemporaryDirectory never cleaned up): those whose parent pid is gone. How many went."""
    removed = 0
    for d in (tmp or Path(tempfile.gettempdir())).glob(RUN_DIR_PREFIX + "*"):
        try:
            pid = int((d / PARENT_FILE).read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being made
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_all(workers: list[_Worker], grace: float = 15.0) -> None:
    for w in workers:
        if w.popen.poll() is None:
            w.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("reader worker %d did not stop in %.0f s; killing it", w.index, grace)
            w.popen.kill()
            w.popen.wait()
