"""Exactly one writer per store prefix (issue 14, item 4): the ownership record.

The ingester that writes a store prefix owns it through one object, keys.OWNER_KEY:

    {"version": 1, "epoch": 3, "owner_id": "ingester-a", "advertise_url": "http://a:4437",
     "renewed_at": 1767225600.0, "lease_expires_at": 1767225610.0}

It is only ever written conditionally (ObjectStore.put with if_absent / if_match), so of
concurrent writers exactly one wins, on S3 as on the local store:

- acquire(): create the record (epoch 1) if there is none; take it over (epoch + 1, If-Match
  on the version read) if its lease has lapsed or it names our own owner_id (a restart);
  otherwise refuse with OwnedElsewhere, naming the owner and until when.
- renew(): rewrite our record with a fresh lease, If-Match on the version we wrote last. A
  precondition failure means someone took over: we are fenced (Superseded) for good. Unless
  the record is a version we sent ourselves whose answer we never got (see below).
- release(): on a clean shutdown, stop, then write a zero-length lease (lease_expires_at ==
  renewed_at): a standby may take over at once.
- current(): the record, for readers (the advertised URL of the ingester) and standbys.

Lost answers. A write of the record can land although its writer never learns it did: the
local store writes in a worker thread, which goes on when the coroutine awaiting it is
cancelled (a LeaseKeeper stopped mid-renewal, a timeout); an S3 PUT can be applied and its
answer lost. The record then holds a version of ours under an ETag we do not know, and our
next write's If-Match fails. So every version sent whose answer did not come is remembered
(`_unconfirmed`, until a later write of ours is confirmed); a precondition failure that finds
one of them, byte for byte (so: our owner_id, our epoch), adopts it and its ETag and writes
again. Anything else (another owner, a higher epoch, a version we never sent) still fences.
LeaseKeeper.stop() ends the renewal loop without cancelling a renewal in flight.

The epoch only grows; it is what later fences every write of the log (issue 14, item 4): a
writer stamps its epoch, and the record says which epoch is current.

Time. The record holds wall-clock times (Unix seconds), so that other machines can read it.
Assumptions: the wall clocks of all ingesters agree within `max_skew` seconds (NTP; default
1 s), and an owner's wall clock is not stepped by more than that while it owns the prefix
(NTP slews). Then:
- a standby treats a lease as lapsed only once its own clock passes lease_expires_at +
  max_skew (or the lease was released);
- the owner measures its own lease with the monotonic clock, from the moment it *sent* the
  write that granted it: valid until sent + lease_seconds. Its wall clock read then was at
  most max_skew from the standby's, so the owner's lease ends (by its own reckoning) no later
  than any standby may take over.
valid() / check() say whether this process may still acknowledge writes. They do not fence
writes already in flight when the lease ends: that is the epoch's job.

Clocks are injectable (Clock: wall() and monotonic()) so tests drive time. LeaseKeeper is the
renewal loop (every lease/3, backing off on store errors, fenced if the lease runs out); its
tick() is one step, for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

import orjson

from shared import keys
from shared.errors import (
    ObjectNotFound,
    ObjectStoreError,
    ObjectStoreUnavailable,
    OwnedElsewhere,
    PreconditionFailed,
    Superseded,
)
from shared.objectstore import ObjectStore

log = logging.getLogger(__name__)

# On an ingester's 503 when it does not own its store prefix (Superseded: fenced, its lease
# lapsed): a reader then looks the owner up again (a standby may hold the prefix now), since the
# ingester answering is alive and a failed connection would not tell it.
FENCED_HEADER: Final = "DS3-Fenced"
RECORD_VERSION: Final = 1  # format of the record; a newer one is refused, not overwritten
DEFAULT_LEASE: Final = 10.0
DEFAULT_MAX_SKEW: Final = 1.0
# acquire(): lost races in a row before giving up (each means another writer won just now).
_ACQUIRE_ATTEMPTS: Final = 5
# _rewrite(): versions of ours adopted in a row (each one a lost answer) before giving up.
_REWRITE_ATTEMPTS: Final = 4
# Versions sent whose answers were lost that are remembered (a store outage: one per try).
_UNCONFIRMED_KEPT: Final = 16


class Clock(Protocol):
    def wall(self) -> float:
        """Unix time, seconds: what the record holds."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary start, never stepped: what the owner's own lease runs on."""


class SystemClock:
    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK: Final = SystemClock()


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    epoch: int
    owner_id: str
    advertise_url: str
    lease_expires_at: float  # wall clock, seconds
    renewed_at: float  # wall clock, seconds: when the owner sent this version
    version: int = RECORD_VERSION
    # what the owner acknowledges after ("store": the store's log holds it; "local": its disk);
    # optional (records written before it have none), so a taker can say when it acknowledges
    # less than its predecessor did
    durability: str | None = None

    @property
    def released(self) -> bool:
        """A zero-length lease: the owner stopped before writing it (release())."""
        return self.lease_expires_at <= self.renewed_at

    def lapsed(self, now: float, max_skew: float) -> bool:
        """Whether a standby whose wall clock reads `now` may take over."""
        return self.released or now > self.lease_expires_at + max_skew

    def encode(self) -> bytes:
        return orjson.dumps({
            "version": self.version, "epoch": self.epoch, "owner_id": self.owner_id,
            "advertise_url": self.advertise_url, "renewed_at": self.renewed_at,
            "lease_expires_at": self.lease_expires_at,
            **({"durability": self.durability} if self.durability is not None else {}),
        })

    @classmethod
    def decode(cls, data: bytes, key: str = keys.OWNER_KEY) -> OwnerRecord:
        """Raises ObjectStoreError for anything but a record this version can read: a record
        that cannot be understood must not be overwritten."""
        try:
            d = orjson.loads(data)
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            version = _field(d, "version", int)
            if version > RECORD_VERSION:
                raise ValueError(f"format version {version}, newer than this server's {RECORD_VERSION}")
            rec = cls(epoch=_field(d, "epoch", int), owner_id=_field(d, "owner_id", str),
                      advertise_url=_field(d, "advertise_url", str),
                      lease_expires_at=float(_field(d, "lease_expires_at", (int, float))),
                      renewed_at=float(_field(d, "renewed_at", (int, float))), version=version,
                      durability=d["durability"] if isinstance(d.get("durability"), str) else None)
            if rec.epoch < 1 or not rec.owner_id or not all(map(math.isfinite, (rec.lease_expires_at,
                                                                                 rec.renewed_at))):
                raise ValueError("epoch < 1, empty owner_id or a time that is not finite")
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise ObjectStoreError(f"ownership record {key} is unreadable: {exc}") from exc
        return rec


def _field(d: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = d.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{name}: {value!r}")
    return value


async def read_owner(store: ObjectStore, key: str = keys.OWNER_KEY) -> OwnerRecord | None:
    """The ownership record, or None if the prefix was never owned."""
    try:
        data, _ = await store.get_with_etag(key)
    except ObjectNotFound:
        return None
    return OwnerRecord.decode(data, key)


class Ownership:
    """This process's claim on a store prefix. One per process and prefix; owner_id names the
    process (unique, or stable across restarts of one node: acquire() takes a record naming
    its own owner_id over at once, with a new epoch)."""

    def __init__(
        self,
        store: ObjectStore,
        owner_id: str,
        advertise_url: str = "",
        *,
        lease_seconds: float = DEFAULT_LEASE,
        max_skew: float = DEFAULT_MAX_SKEW,
        clock: Clock = SYSTEM_CLOCK,
        key: str = keys.OWNER_KEY,
        durability: str | None = None,
    ) -> None:
        if not owner_id:
            raise ValueError("owner_id must not be empty")
        if not (lease_seconds > 0 and math.isfinite(lease_seconds)):
            raise ValueError(f"lease_seconds must be positive: {lease_seconds}")
        if not (max_skew >= 0 and math.isfinite(max_skew)):
            raise ValueError(f"max_skew must be >= 0: {max_skew}")
        self.store = store
        self.owner_id = owner_id
        self.advertise_url = advertise_url
        self.lease_seconds = lease_seconds
        self.max_skew = max_skew
        self.clock = clock
        self.key = key
        self.durability = durability  # written in our record (OwnerRecord.durability)
        self._lock = asyncio.Lock()  # one write of the record at a time
        self._record: OwnerRecord | None = None  # the version we wrote last
        # Whose the record was when acquire() took it (None: there was none): another owner's
        # means the store's log went on without this process since it last owned the prefix.
        self.previous_owner: str | None = None
        self.previous_record: OwnerRecord | None = None  # (the record itself, as acquire() found it)
        self._etag = ""
        # Versions sent since the last one confirmed, whose answers did not come (oldest first):
        # any may be in the store now.
        self._unconfirmed: list[OwnerRecord] = []
        self._valid_until = -math.inf  # monotonic
        self._fenced: str | None = None  # why, once fenced

    # ------------------------------------------------------------ state
    @property
    def record(self) -> OwnerRecord | None:
        """The record as we last wrote it (None before acquire())."""
        return self._record

    @property
    def epoch(self) -> int:
        return self._record.epoch if self._record is not None else 0

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    def remaining(self) -> float:
        """Seconds left on our lease by our own clock (0 when not owning)."""
        if self._record is None or self._fenced is not None:
            return 0.0
        return max(0.0, self._valid_until - self.clock.monotonic())

    def valid(self) -> bool:
        """Whether this process owns the prefix now and may acknowledge writes."""
        return self.remaining() > 0

    def check(self) -> int:
        """The epoch if valid(); else Superseded (and, if the lease ran out, fenced for good:
        a lapsed lease may have been taken over meanwhile)."""
        if self._record is None:
            raise Superseded("this process does not own the store prefix", 0)
        if self._fenced is None and self.remaining() <= 0:
            self._fence("its lease lapsed before it was renewed")
        if self._fenced is not None:
            raise Superseded(f"ownership of the store prefix (epoch {self.epoch}) is lost: {self._fenced}",
                             self.epoch)
        return self._record.epoch

    def _fence(self, why: str) -> None:
        if self._fenced is None:
            self._fenced = why
            log.error("ownership of %s (epoch %d) lost: %s; writing nothing more", self.store.url,
                      self.epoch, why)

    # ------------------------------------------------------------ reads
    async def current(self) -> OwnerRecord | None:
        """The record as stored now (whoever wrote it), or None."""
        return await read_owner(self.store, self.key)

    async def _read(self) -> tuple[bytes, str] | None:
        try:
            return await self.store.get_with_etag(self.key)
        except ObjectNotFound:
            return None

    def sent(self, rec: OwnerRecord) -> bool:
        """Whether `rec` is a version of the record this process wrote whose answer it never
        got (an acquire or renewal that landed although it was cancelled or failed)."""
        return rec in self._unconfirmed

    async def _put(self, rec: OwnerRecord, body: bytes, **cond: Any) -> str:
        """Write `rec` (encoded: `body`) under `cond`; its ETag. Until the answer comes, `rec` is
        one of the versions that may have landed unseen (cancelled, failed, timed out)."""
        if rec not in self._unconfirmed:
            self._unconfirmed.append(rec)
            del self._unconfirmed[:-_UNCONFIRMED_KEPT]
        etag = await self.store.put(self.key, body, content_type="application/json", **cond)
        self._unconfirmed.clear()  # this one is the newest version; none before it can land now
        return etag

    async def _landed(self, body: bytes) -> str | None:
        """After a PreconditionFailed: the ETag if the record is our very write (its answer was
        lost and the retry found it done), else None."""
        found = await self._read()
        return found[1] if found is not None and found[0] == body else None

    # ------------------------------------------------------------ writes
    async def acquire(self) -> OwnerRecord:
        """Own the prefix: create the record or take a lapsed (or our own) one over with the
        next epoch. OwnedElsewhere if another owner's lease is live."""
        async with self._lock:
            if self._record is not None and self._fenced is None:
                raise RuntimeError(f"already own {self.store.url} (epoch {self.epoch})")
            for _ in range(_ACQUIRE_ATTEMPTS):
                found = await self._read()
                wall, mono = self.clock.wall(), self.clock.monotonic()
                if found is None:
                    rec = self._new_record(1, wall)
                    cond: dict[str, Any] = {"if_absent": True}
                    previous, previous_owner, old = "a new record", None, None
                else:
                    old = OwnerRecord.decode(found[0], self.key)
                    if old.owner_id != self.owner_id and not old.lapsed(wall, self.max_skew):
                        wait = old.lease_expires_at + self.max_skew - wall
                        raise OwnedElsewhere(old.owner_id, old.advertise_url, old.epoch, old.lease_expires_at,
                                             retry_after=max(1, math.ceil(wait)))
                    rec = self._new_record(old.epoch + 1, wall)
                    cond = {"if_match": found[1]}
                    previous, previous_owner = f"taken over from {old.owner_id}, epoch {old.epoch}", old.owner_id
                body = rec.encode()
                try:
                    etag = await self._put(rec, body, **cond)
                except PreconditionFailed:
                    landed = await self._landed(body)
                    if landed is None:
                        continue  # another writer won this round: look again
                    etag = landed
                self._record, self._etag, self._fenced = rec, etag, None
                self.previous_owner, self.previous_record = previous_owner, old
                self._unconfirmed.clear()
                self._valid_until = mono + self.lease_seconds
                log.info("own %s: epoch %d (%s), lease %.1f s", self.store.url, rec.epoch, previous,
                         self.lease_seconds)
                return rec
            raise ObjectStoreUnavailable(f"ownership of {self.store.url}: lost {_ACQUIRE_ATTEMPTS} races "
                                         "for its record in a row")

    def _new_record(self, epoch: int, wall: float) -> OwnerRecord:
        return OwnerRecord(epoch=epoch, owner_id=self.owner_id, advertise_url=self.advertise_url,
                           lease_expires_at=wall + self.lease_seconds, renewed_at=wall, durability=self.durability)

    async def renew(self) -> OwnerRecord:
        """Extend our lease. Superseded (and fenced) if another owner took over or our lease
        already ran out; store errors propagate and leave us as we were (retry until the lease
        runs out: LeaseKeeper)."""
        async with self._lock:
            self.check()
            assert self._record is not None
            wall, mono = self.clock.wall(), self.clock.monotonic()
            rec = replace(self._record, renewed_at=wall, lease_expires_at=wall + self.lease_seconds)
            etag = await self._rewrite(rec)
            self._record, self._etag = rec, etag
            self._valid_until = max(self._valid_until, mono + self.lease_seconds)
            return rec

    async def release(self) -> bool:
        """Give the prefix up at once (clean shutdown): stop acknowledging (we are fenced from
        here on), then write a zero-length lease so a standby need not wait for it to lapse.
        False if we did not own it any more; store errors propagate (the lease then lapses)."""
        async with self._lock:
            if self._record is None or self._fenced is not None:
                return False
            self._fenced = "released"  # before the write: nothing is acknowledged once a standby may own
            wall = self.clock.wall()
            rec = replace(self._record, renewed_at=wall, lease_expires_at=wall)
            try:
                self._etag = await self._rewrite(rec)
            except Superseded:
                return False
            self._record = rec
            log.info("released %s (epoch %d)", self.store.url, rec.epoch)
            return True

    async def _rewrite(self, rec: OwnerRecord) -> str:
        """Write our next version over the one we wrote last; its ETag. Superseded (fenced) if
        the record is another's now. A version of ours whose answer was lost, found in its
        place, is adopted (record and ETag) and written over."""
        body = rec.encode()
        for _ in range(_REWRITE_ATTEMPTS):
            expected = self._etag
            try:
                return await self._put(rec, body, if_match=expected)
            except PreconditionFailed:
                pass
            found = await self._read()
            if found is not None and found[0] == body:
                self._unconfirmed.clear()
                return found[1]  # it was ours: the answer was lost and a retry found it done
            if found is not None and found[1] == expected:
                # Still our version: the write lost to concurrent conditional writes that all
                # failed (S3 409s). Not superseded; the caller retries.
                raise ObjectStoreUnavailable(f"ownership record {self.key}: concurrent writes, none won")
            mine = self._unconfirmed_found(found)
            if mine is None:
                now_there = "no record" if found is None else _describe(found[0], self.key)
                self._fence(f"superseded: the record is now {now_there}")
                raise Superseded(f"ownership of the store prefix (epoch {rec.epoch}) was taken over: "
                                 f"{now_there}", rec.epoch)
            assert found is not None
            # An earlier write of ours landed though its answer never came (cancelled, timed
            # out): the record is still ours. Carry on from it. (The lease we count on stays
            # the one we know of: shorter than the one it granted.)
            log.info("ownership record of %s: a version of ours (epoch %d, renewed at %.3f) landed "
                     "unanswered; carrying on from it", self.store.url, mine.epoch, mine.renewed_at)
            self._record, self._etag = mine, found[1]
            del self._unconfirmed[:self._unconfirmed.index(mine) + 1]  # it, and the ones it followed
        raise ObjectStoreUnavailable(f"ownership record {self.key}: {_REWRITE_ATTEMPTS} versions of ours "
                                     "whose answers were lost found in a row")

    def _unconfirmed_found(self, found: tuple[bytes, str] | None) -> OwnerRecord | None:
        """The version of ours `found` holds, if it is one we sent unanswered at our epoch."""
        if found is None or self._record is None:
            return None
        try:
            rec = OwnerRecord.decode(found[0], self.key)
        except ObjectStoreError:
            return None
        if rec.owner_id != self.owner_id or rec.epoch != self._record.epoch or rec not in self._unconfirmed:
            return None
        return rec


def _describe(data: bytes, key: str) -> str:
    try:
        rec = OwnerRecord.decode(data, key)
    except ObjectStoreError:
        return "unreadable"
    return f"{rec.owner_id}'s, epoch {rec.epoch}"


class LeaseKeeper:
    """Renews an Ownership's lease: every `interval` (lease/3) while renewals succeed; after a
    store error, again after a backoff doubling from min_backoff up to max_backoff (but within
    half the time the lease has left, or min_backoff). If the lease runs out first, the ownership is
    fenced and tick() / run() raise Superseded: the service must stop acknowledging writes.

        keeper = LeaseKeeper(ownership)
        task = asyncio.create_task(keeper.run())   # ends with Superseded when fenced
        ...
        keeper.stop(); await task; await ownership.release()
    """

    def __init__(
        self,
        ownership: Ownership,
        *,
        interval: float | None = None,
        min_backoff: float = 0.1,
        max_backoff: float | None = None,
    ) -> None:
        self.ownership = ownership
        self.interval = interval if interval is not None else ownership.lease_seconds / 3
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff if max_backoff is not None else self.interval
        if not (0 < self.interval < ownership.lease_seconds):
            raise ValueError(f"renewal interval must be within (0, lease): {self.interval}")
        self.failures = 0  # store errors in a row
        self._stopping = asyncio.Event()

    async def tick(self) -> float:
        """One renewal; returns the seconds to wait before the next. Raises Superseded once
        the ownership is fenced (taken over, or the lease ran out)."""
        own = self.ownership
        own.check()
        try:
            # A renewal that cannot finish while the lease lasts is too late anyway.
            async with asyncio.timeout(own.remaining()):
                await own.renew()
        except (ObjectStoreError, TimeoutError) as exc:  # Superseded is none of these: it propagates
            self.failures += 1
            own.check()  # fenced now if the lease ran out meanwhile
            delay = min(self.min_backoff * 2.0 ** (self.failures - 1), self.max_backoff)
            delay = min(delay, max(own.remaining() / 2, self.min_backoff))  # try again before it ends
            log.warning("renewing ownership of %s failed (%d in a row, %.1f s of lease left): %s; "
                        "again in %.2f s", own.store.url, self.failures, own.remaining(),
                        getattr(exc, "message", None) or repr(exc), delay)
            return delay
        self.failures = 0
        return self.interval

    async def run(self) -> None:
        """tick() until stop(): otherwise returns only by raising Superseded (or being
        cancelled)."""
        while not self._stopping.is_set():
            delay = await self.tick()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stopping.wait()

    def stop(self) -> None:
        """Make run() return once the renewal in flight, if any, is done. Unlike cancelling
        run(), this does not cut a renewal off from its answer while its write may still land
        (the local store writes in a worker thread, which a cancellation does not stop)."""
        self._stopping.set()
