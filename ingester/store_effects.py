"""`--durability local`: what a commit sets off in the object store waits for the store's log.

In local mode an append is acknowledged after the local fsync, and the log ships up to
`--ship-interval` later; a lost disk loses that much, as documented. But what a commit set off
in the store itself ran at once: a close sealed its chunk and published the stream's
descriptor (closed, with that chunk), a delete removed the stream's objects, a snapshot's
retention deleted chunks. The disk lost before the log held that commit, the next owner
(restored from the log) had the stream open and without those bytes while readers served the
sealed chunk and the closed descriptor from the store, as immutable, and a reader that had
cached it went on answering with it after the new owner appended other bytes at those offsets
(found by QA); a lost delete would have left a stream whose chunks were gone.

So in local mode, as in store mode (ingester/visibility.py), a logged commit's store effects
(chunks to upload, objects to delete, descriptors to publish, objects made unreachable) are held
until the shipper says the store holds the commit (`release`, Shipper.on_stored); readers are
woken at once (local mode serves the WAL's data before the store has it: that is its promise).
While effects wait, the shipper ships at once instead of gathering half an interval (`urgent`).
A create or a delete is answered once readers see its descriptor (IngesterService.create and
delete: `released`, then the publisher): one segment PUT more than before, not the interval.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

from ingester.writes import Committed


class StoreEffects:
    def __init__(self, deliver: Callable[[Committed], None], wake: Callable[[], object]) -> None:
        self.deliver = deliver  # the service's on_durable, on the event loop
        self.wake = wake  # the shipper's, from any thread
        self._lock = threading.Lock()
        self._held: deque[tuple[int, Committed]] = deque()  # (seq, store effects), commit order
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []  # (seq, released), the loop's
        self.released_upto = 0

    def hold(self, seq: int, news: Committed) -> Committed | None:
        """Writer thread, commit `seq` is in LMDB: keep its store effects until the store's log
        has it; returns what to deliver now (the readers to wake), None for nothing."""
        if not (news.rolled or news.removed or news.descriptors or news.released):
            return news
        effects = Committed(rolled=news.rolled, removed=news.removed, descriptors=news.descriptors,
                            released=news.released)
        with self._lock:
            if seq <= self.released_upto:
                return news
            self._held.append((seq, effects))
        self.wake()
        return Committed(changed=news.changed) if news.changed else None

    def after(self, seq: int, effects: Committed) -> None:
        """Effects of commit `seq` found after it (a snapshot's superseded objects): delivered
        now if the store holds the commit, else once it does."""
        with self._lock:
            held = seq > self.released_upto
            if held:
                i = len(self._held)
                while i > 0 and self._held[i - 1][0] > seq:
                    i -= 1
                self._held.insert(i, (seq, effects))
        if held:
            self.wake()
        else:
            self.deliver(effects)

    def urgent(self) -> bool:
        """Whether store effects wait for the log (the shipper ships at once then)."""
        return bool(self._held)

    def release(self, upto: int) -> None:
        """Event loop: the store holds every commit up to `upto`; deliver their effects."""
        out: list[Committed] = []
        with self._lock:
            if upto <= self.released_upto:
                return
            self.released_upto = upto
            while self._held and self._held[0][0] <= upto:
                out.append(self._held.popleft()[1])
        for effects in out:
            self.deliver(effects)
        waiting, self._waiters = self._waiters, []
        for seq, fut in waiting:
            if seq > upto:
                self._waiters.append((seq, fut))
            elif not fut.done():
                fut.set_result(None)

    async def released(self, seq: int, timeout: float) -> bool:
        """Event loop: wait (bounded) until the effects of commits up to `seq` are delivered."""
        if seq <= self.released_upto:
            return True
        entry = (seq, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    @property
    def held(self) -> int:
        """Commits whose store effects wait for the log."""
        return len(self._held)
