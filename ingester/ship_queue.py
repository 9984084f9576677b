"""The shipper's queue: the logged commits not yet in the object store, and the gates (store
mode) their writes wait on.

One lock guards it all: the writer thread appends (ingester/log_hook.py), the event loop takes
commits for segments, advances past the ones that landed and fails gates. Gates are completed
outside the lock (a gate's callbacks may run at once).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from typing import Final

from shared.logsegment import Commit

MAX_SEGMENT_BYTES: Final = 16 * 1024 * 1024  # a segment is cut at about this many bytes of writes

Gate = ConcurrentFuture[None]


def commit_size(commit: Commit) -> int:
    return 12 + sum(10 + len(k) + len(v) for _, _, k, v in commit.writes)


def fail_gate(gate: Gate, exc: BaseException) -> None:
    if not gate.done():
        gate.set_exception(exc)


class ShipQueue:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Guarded by the lock (the writer thread appends, the loop takes):
        self.commits: deque[Commit] = deque()
        self.sizes: deque[int] = deque()  # commit_size of each queued commit (counted once)
        self.times: deque[float] = deque()  # monotonic time each queued commit arrived
        self.bytes = 0
        # Since when (monotonic) a logged commit has not been in the store: the oldest queued
        # one's arrival, or, once the queue was dropped for a checkpoint, the oldest dropped
        # one's until that checkpoint lands. None: the store holds everything logged.
        self.unshipped_since: float | None = None
        self.dropped_upto = 0  # the last commit dropped for a checkpoint
        self.gates: deque[list[object]] = deque()  # [last seq, gate], in seq order
        self.open_gate: list[object] | None = None  # the entry commits join until the next take
        self.taken_upto = 0  # queued commits up to this seq are in an upload in flight
        self.early_seq = 0  # commits up to this seq were queued before their LMDB commit
        self.landed_seq = 0  # commits up to this seq are in the store (advance)

    def __len__(self) -> int:
        return len(self.commits)

    @property
    def oldest_at(self) -> float | None:
        """When the oldest queued commit arrived (monotonic), None if none is queued."""
        times = self.times
        return times[0] if times else None

    def lag_seconds(self, now: float | None = None) -> float:
        """How long the oldest commit not yet in the store has waited (0: nothing waits)."""
        since = self.unshipped_since
        return 0.0 if since is None else max(0.0, (time.monotonic() if now is None else now) - since)

    # --- the writer thread, under the lock ---------------------------------------------------

    def append(self, commit: Commit) -> bool:
        """Under the lock: append to the queue; whether it was empty."""
        first = not self.commits
        size = commit_size(commit)
        now = time.monotonic()
        self.commits.append(commit)
        self.sizes.append(size)
        self.times.append(now)
        self.bytes += size
        if self.unshipped_since is None:
            self.unshipped_since = now
        return first

    def own_gate(self, seq: int) -> Gate:
        """Under the lock: a gate of its own for the commit at `seq` (its segment may be cut
        already, the next commit's may not); later commits get a new one."""
        own: list[object] = [seq, ConcurrentFuture()]
        self.gates.append(own)
        self.open_gate = None
        return own[1]  # type: ignore[return-value]

    def join_gate(self, seq: int) -> Gate:
        """Under the lock: the gate shared by every commit gathered until the next take."""
        entry = self.open_gate
        if entry is None:
            entry = self.open_gate = [seq, ConcurrentFuture()]
            self.gates.append(entry)
        entry[0] = seq
        return entry[1]  # type: ignore[return-value]

    # --- the loop ----------------------------------------------------------------------------

    def take(self) -> tuple[list[Commit], int]:
        """The queued commits for one segment (at most about MAX_SEGMENT_BYTES) that no upload
        in flight holds, and their size; the open gate closes: commits from now on get a new
        one."""
        with self.lock:
            self.open_gate = None
            out: list[Commit] = []
            size = 0
            for c, n in zip(self.commits, self.sizes, strict=True):
                if c.seq <= self.taken_upto:
                    continue
                out.append(c)
                size += n
                if size >= MAX_SEGMENT_BYTES:
                    break
            return out, size

    def untaken(self) -> bool:
        with self.lock:
            return bool(self.commits) and self.commits[-1].seq > self.taken_upto

    def untaken_since(self) -> float | None:
        """When the oldest commit no upload in flight holds arrived (monotonic); None: none."""
        with self.lock:
            for c, t in zip(self.commits, self.times, strict=True):
                if c.seq > self.taken_upto:
                    return t
            return None

    def advance(self, seq: int) -> list[Gate]:
        """Everything up to `seq` is in the store: drop it from the queue; the gates to open."""
        done: list[Gate] = []
        with self.lock:
            while self.commits and self.commits[0].seq <= seq:
                self.commits.popleft()
                self.bytes -= self.sizes.popleft()
                self.times.popleft()
            if not self.commits:
                self.bytes = 0
            if seq >= self.dropped_upto:  # (else dropped commits still wait for their checkpoint)
                self.unshipped_since = self.times[0] if self.times else None
            self.landed_seq = max(self.landed_seq, seq)
            while self.gates and self.gates[0][0] <= seq:  # type: ignore[operator]
                entry = self.gates.popleft()
                if entry is self.open_gate:
                    self.open_gate = None
                done.append(entry[1])  # type: ignore[arg-type]
        return done

    def landed(self, seq: int) -> None:
        """Commits up to `seq` are known to be in the store (what the store's log holds at start)."""
        with self.lock:
            self.landed_seq = max(self.landed_seq, seq)

    def fail_upto(self, upto: int, exc: BaseException) -> None:
        """The gates of the commits up to `upto` fail with `exc`."""
        with self.lock:
            failing = [entry[1] for entry in self.gates if entry[0] <= upto]  # type: ignore[operator]
            self.gates = deque(e for e in self.gates if e[0] > upto)  # type: ignore[operator]
            if self.open_gate is not None and self.open_gate not in self.gates:
                self.open_gate = None
        for g in failing:
            fail_gate(g, exc)  # type: ignore[arg-type]

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Every waiting gate fails (with an error of its own)."""
        with self.lock:
            gates = [g for _, g in self.gates]
            self.gates.clear()
            self.open_gate = None
        for g in gates:
            fail_gate(g, error())  # type: ignore[arg-type]

    def drop(self, error: Callable[[], BaseException]) -> None:
        """A checkpoint covers the queue: drop it; every waiting gate fails."""
        with self.lock:
            if self.commits:
                self.dropped_upto = max(self.dropped_upto, self.commits[-1].seq)
            self.commits.clear()
            self.sizes.clear()
            self.times.clear()  # (unshipped_since stays: they are not in the store yet)
            # ... but not a commit handed over before LMDB commits it, if that happens after
            # the checkpoint's copy: its on_logged must queue it again.
            self.early_seq = 0
            self.bytes = 0
            gates = [entry[1] for entry in self.gates]
            self.gates.clear()
            self.open_gate = None
        for g in gates:
            fail_gate(g, error())  # type: ignore[arg-type]
