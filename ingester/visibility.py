"""`--durability store`: readers see a commit once the store's log holds it, not when LMDB does.

An append is acknowledged only once its commit's segment is in the store, but LMDB commits it
first (the segment's PUT runs alongside). Served from the WAL at once, such a commit was a
dirty read: if the store then failed (the append answered 503) and a standby took over, the
bytes a reader had seen were gone and their offset was given to other bytes; and what the
commit set off (a rolled chunk's upload, a deleted stream's objects removed, descriptors)
ran although the store's log did not have it, so a takeover could find a stream whose
objects were gone. So, in store mode:

- Store.flush (writer thread, inside the commit's transaction) stages, for every stream path
  the commit changes, the metadata readers saw before it (read in a separate read
  transaction: LMDB's last committed state). Reads (ingester/reads.py) of a path with such
  an entry use it instead of the WAL's: its tail bounds what they return, and a stream the
  commit creates is not there yet.
- The committer hands the commit's `changed` (Committed: readers to wake, chunks to upload,
  objects to delete, descriptors) to `hold` instead of delivering it with the outcomes.
- `release(seq)` (the shipper, once the store holds everything up to `seq`) drops the staged
  entries of those commits and delivers their `changed`, in commit order: readers are woken
  then, and see the data.
A failed gate (503) keeps its commit hidden until a later upload or checkpoint carries it to
the store; a fenced owner's never shows. Listings (streams, buckets) and buckets' own metadata
read the WAL and wait, as an acknowledgement does, until the store holds the commit they read
(IngesterService.read_stored).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import lmdb

from ingester.chain import refresh_tail
from ingester.records import StreamMeta
from ingester.wal import WalEnv

HIDDEN_CHANGING = "this stream is being changed by a write the object store does not hold yet; retry"


class Visibility:
    def __init__(self, wal: WalEnv, deliver: Callable[[Any], None], clock: Callable[[], float]) -> None:
        self.wal = wal
        self.deliver = deliver  # the service's on_durable, on the event loop
        self.clock = clock
        self._lock = threading.Lock()
        # path -> (seq, what readers saw before commit seq), oldest first: readers see the head
        self._hidden: dict[str, deque[tuple[int, StreamMeta | None]]] = {}
        self._staged: tuple[int, list[str]] | None = None  # the commit being written
        self._held: deque[tuple[int, list[str], Any]] = deque()  # (seq, paths, changed), commit order
        self.released_upto = 0

    # --- the writer thread ------------------------------------------------------------

    def stage(self, txn: lmdb.Transaction, paths: Iterable[str]) -> None:
        """Commit `wal.commit_seq(txn) + 1` changes `paths`: hide it from readers."""
        seq = self.wal.commit_seq(txn) + 1
        now = self.clock()
        befores: list[tuple[str, StreamMeta | None]] = []
        with self.wal.env.begin(buffers=False) as before:  # the last committed state
            for path in paths:
                raw = before.get(path.encode(), db=self.wal.streams)
                meta = refresh_tail(before, self.wal, StreamMeta.decode(raw), now) if raw is not None else None
                befores.append((path, meta))
        with self._lock:
            if self._staged is not None:  # a batch before that committed nothing: it never happened
                self._unhide(*self._staged, last=True)
            for path, meta in befores:
                self._hidden.setdefault(path, deque()).append((seq, meta))
            self._staged = (seq, [p for p, _ in befores])

    def unstage(self) -> None:
        """The staged commit was aborted: it never happened."""
        with self._lock:
            staged, self._staged = self._staged, None
            if staged is not None:
                self._unhide(staged[0], staged[1], last=True)

    def hold(self, seq: int, changed: Any) -> Any:
        """Commit `seq` is in LMDB: keep `changed` until the store has it (returns None). The
        store already does (its segment landed while LMDB synced): returns it, to deliver now."""
        with self._lock:
            staged, self._staged = self._staged, None
            paths = staged[1] if staged is not None and staged[0] == seq else []
            if seq <= self.released_upto:
                return changed
            self._held.append((seq, paths, changed))
            return None

    # --- the event loop ---------------------------------------------------------------

    def release(self, upto: int) -> None:
        """The store holds every commit up to `upto`: show them, and deliver what they set off."""
        out: list[Any] = []
        with self._lock:
            if upto <= self.released_upto:
                return
            self.released_upto = upto
            while self._held and self._held[0][0] <= upto:
                seq, paths, changed = self._held.popleft()
                self._unhide(seq, paths)
                out.append(changed)
            if self._staged is not None and self._staged[0] <= upto:  # landed before LMDB committed it
                self._unhide(*self._staged)
        for changed in out:
            if changed:
                self.deliver(changed)

    def _unhide(self, seq: int, paths: list[str], last: bool = False) -> None:
        for path in paths:
            entries = self._hidden.get(path)
            if not entries:
                continue
            i = -1 if last else 0
            if entries[i][0] == seq:
                del entries[i]
            if not entries:
                del self._hidden[path]

    # --- readers (any thread) -----------------------------------------------------------

    def hidden(self, path: str) -> tuple[bool, StreamMeta | None]:
        """(True, what readers see) while a commit the store lacks changed `path`'s stream;
        (False, None) otherwise (the WAL's state is the one to read)."""
        if not self._hidden:  # (no lock: the common case, nothing pending)
            return False, None
        with self._lock:
            entries = self._hidden.get(path)
            if not entries:
                return False, None
            return True, entries[0][1]

    @property
    def held(self) -> int:
        """Commits in LMDB that readers do not see yet."""
        return len(self._held)
