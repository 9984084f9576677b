"""Following an ownership record (shared/ownership.py) to where an ingester runs now.

Readers follow the store prefix's owner (issue 14 item 5): a reader started without
`--ingester` (and without a cluster description) forwards to the ingester the ownership record
names (`_ds3/owner.json`: its advertised URL). A standby that takes the prefix over writes its
own URL there; readers read the record every REFRESH_SECONDS (and at once after a failed
forward) and move to it without a restart. An explicit `--ingester` is used as given (a proxy or
load balancer in between, a test's gate), never second-guessed.

A released or lapsed record still names the last owner: it is where the data is, and the
ingester itself answers 503 while it does not own the prefix (or a standby names the owner).

In a cluster (MemberOwners) each member owns its own namespace (`_ds3/ingesters/<id>/`), and a
member's standby takes it over like the single owner's does, but the description still names
the machine it replaced. The description's URL stays the first choice (the admin's, known to
be reachable); once a call to it fails, the caller reads that member's record, and while a live
lease there names another URL, that member's calls go there, until the description names it
too (`ds3 cluster set`) or the lease ends. Readers do this for forwarded requests, ingesters for
their calls to each other (moves, forks across ingesters).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from shared.errors import DS3Error
from shared.objectstore.base import ObjectStore
from shared.objectstore.scoped import ScopedStore, ingester_scope
from shared.ownership import OwnerRecord, read_owner

log = logging.getLogger("ds3.owner")

REFRESH_SECONDS: Final = 2.0
MIN_EARLY_SECONDS: Final = 0.25  # a failed forward asks again at most this often
MAX_SKEW_SECONDS: Final = 1.0
STALL_SECONDS: Final = 1.0  # a call unanswered this long: is the member still where it was?
T = TypeVar("T")  # a member's lease counts as live this long past its end (our clock may be ahead)


class OwnerWatcher:
    """The ownership record as last read; `url` is the owner's advertised URL, or None."""

    def __init__(self, objects: ObjectStore, interval: float = REFRESH_SECONDS,
                 label: str = "the store prefix's owner") -> None:
        self.objects = objects
        self.interval = interval
        self.record: OwnerRecord | None = None
        self.error: str | None = None
        self.changes = 0  # times the owner's URL changed under this reader
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._last_read = 0.0
        self.label = label  # whose record, for the log
        self.on_change: Callable[[], None] | None = None  # called when the URL it names changed

    @property
    def url(self) -> str | None:
        return None if self.record is None else self.record.advertise_url.rstrip("/")

    async def refresh(self) -> None:
        """Read the record once (a failure keeps the last one and says why in `error`)."""
        self._last_read = time.monotonic()
        try:
            record = await read_owner(self.objects)
        except (DS3Error, ValueError, OSError) as e:
            self.error = str(e)
            return
        self.error = None
        before = self.url
        self.record = record
        if self.url != before and self.url is not None:
            self.changes += before is not None
            log.info("%s is %s (epoch %d)%s", self.label, self.url, record.epoch if record else 0,
                     f"; was {before}" if before else "")
            if self.on_change is not None:
                self.on_change()

    def poke(self) -> None:
        """A forward to the owner failed: read the record again soon (rate-limited)."""
        if time.monotonic() - self._last_read >= MIN_EARLY_SECONDS:
            self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="ds3-owner-watch")

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()
            await self.refresh()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class MemberOwners:
    """Where each cluster member runs now, when its ownership record says otherwise than the
    description (see the module's docstring). A member's record is read only after a call to
    it failed, then every REFRESH_SECONDS. Without a store (a `--cluster` file and no
    `--store`) there are no records: the description's URLs are used as they are."""

    def __init__(self, objects: ObjectStore | None) -> None:
        self.objects = objects
        self._watchers: dict[str, OwnerWatcher] = {}
        self.on_change: Callable[[str], None] | None = None  # a member's record named a new URL

    @property
    def active(self) -> bool:
        """Whether any member's record is followed (no call has failed yet: none is)."""
        return bool(self._watchers)

    def url(self, ingester_id: str, described: str) -> str:
        """The URL for member `ingester_id`'s requests (`described`: the description's)."""
        w = self._watchers.get(ingester_id)
        if w is None:
            return described
        record, url = w.record, w.url
        if record is None or url is None or url == described or record.lapsed(time.time(), MAX_SKEW_SECONDS):
            return described
        return url

    async def call(self, peer_id: str, described: str, send: Callable[[str], Awaitable[T]],
                   stall: float = STALL_SECONDS) -> T:
        """`send(url)` to member `peer_id` at where it runs (url(), with `described`). A frozen or
        cut-off member fails nothing, so a call unanswered for `stall` seconds makes its record
        read (as a failed one does), and once the record names another URL (a standby took it
        over) the call is dropped: ConnectionError, for the caller's retry to go there."""
        url = self.url(peer_id, described)
        calling = asyncio.ensure_future(send(url))
        try:
            while True:
                done, _ = await asyncio.wait((calling,), timeout=stall)
                if done:
                    return calling.result()
                self.failed(peer_id)
                now = self.url(peer_id, described)
                if now != url:
                    raise ConnectionError(f"ingester {peer_id} at {url} did not answer, and a standby of it holds "
                                          f"its lease at {now}")
        finally:
            if not calling.done():
                calling.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await calling
            elif not calling.cancelled():
                # Done, but this call is leaving without its outcome (cancelled itself, a
                # shutdown, just as the send failed): retrieved, or asyncio logs "Task exception
                # was never retrieved" with the send's traceback.
                calling.exception()

    def failed(self, ingester_id: str) -> None:
        """A call to this member failed: read its record (soon, rate-limited)."""
        if self.objects is None:
            return
        w = self._watchers.get(ingester_id)
        if w is None:
            w = self._watchers[ingester_id] = OwnerWatcher(
                ScopedStore(self.objects, ingester_scope(ingester_id)),
                label=f"cluster member {ingester_id}, by its ownership record,")
            w.on_change = functools.partial(self._changed, ingester_id)
            w.start()
        w.poke()

    def _changed(self, ingester_id: str) -> None:
        if self.on_change is not None:
            self.on_change(ingester_id)

    async def stop(self) -> None:
        for w in self._watchers.values():
            await w.stop()
