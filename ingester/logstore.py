"""The commit log in the object store (issue 14): what is there, and restoring a WAL from it.

    log/<first seq, 20 digits>-<last seq, 20 digits>.seg        segments (shared/logsegment.py)
    checkpoint/<seq, 20 digits>-<epoch, 20 digits>.mdb          a compacted copy of the whole
                                                                LMDB env after commit <seq>

A checkpoint at S plus the segments after it, replayed in commit order (ingester/replay.py),
rebuild the WAL as it was after the last shipped commit. Overlapping segments are harmless
(a segment re-cut after an upload whose answer was lost; replay skips commits already
applied), and so are segments entirely at or below the checkpoint (deleted after a newer
checkpoint). Fencing: along the chain the epochs never fall, and where segments of several
epochs hold a commit, the highest epoch wins, at every commit (a segment is taken only up to
where one of a higher epoch starts), so what a superseded owner wrote after a takeover is
never replayed over the new owner's log: not even a late re-cut segment of its that reaches
from before the takeover past it.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from ingester.replay import ReplayGap, replay
from ingester.wal import WalEnv
from shared.localfile import write_durably
from shared.logsegment import LOG_DIR, PRELUDE_SIZE, Commit, decode, parse_prelude, parse_segment_key
from shared.objectstore import ObjectStore

log = logging.getLogger("ds3.logstore")

CHECKPOINT_DIR: Final = "checkpoint/"
FETCH_CONCURRENCY: Final = 16  # segment GETs in flight while restoring
REPLAY_BATCH: Final = 256  # segments replayed in one transaction while restoring
# Segments of the log's epoch that may follow a hole (a failed upload): the shipper's uploads
# in flight (ingester/shipper.py UPLOADS_IN_FLIGHT) minus the failed one.
ORPHANS_MAX: Final = 3
_CHECKPOINT_RE: Final = re.compile(r"(\d{20})-(\d{20})\.mdb")


def checkpoint_key(seq: int, epoch: int) -> str:
    return f"{CHECKPOINT_DIR}{seq:020d}-{epoch:020d}.mdb"


def parse_checkpoint_key(key: str) -> tuple[int, int] | None:
    """(seq, epoch) of a checkpoint key; None for any other key."""
    if not key.startswith(CHECKPOINT_DIR):
        return None
    m = _CHECKPOINT_RE.fullmatch(key, len(CHECKPOINT_DIR))
    return None if m is None else (int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True, slots=True)
class SegmentRef:
    key: str
    first: int
    last: int


@dataclass(slots=True)
class LogListing:
    checkpoints: list[tuple[int, int, str]] = field(default_factory=list)  # (seq, epoch, key), sorted
    segments: list[SegmentRef] = field(default_factory=list)  # by key: by first seq

    @property
    def empty(self) -> bool:
        return not self.checkpoints and not self.segments

    @property
    def latest_checkpoint(self) -> tuple[int, int, str] | None:
        return self.checkpoints[-1] if self.checkpoints else None

    @property
    def shipped_seq(self) -> int:
        """The highest commit seq the store holds (a checkpoint's or a segment's)."""
        seqs = [c[0] for c in self.checkpoints] + [s.last for s in self.segments]
        return max(seqs, default=0)

    @property
    def chain_end(self) -> int:
        """Where the log a restore can replay ends: the latest checkpoint, then segments
        without a hole (the store may hold segments past a hole: store mode uploads a few at
        a time, and a process killed while an earlier one was in flight leaves the later ones
        beyond a commit the store lacks; they were never acknowledged)."""
        cp = self.latest_checkpoint
        end = cp[0] if cp is not None else 0
        for ref in sorted(self.segments, key=lambda r: (r.first, r.last)):
            if ref.first > end + 1:
                break
            end = max(end, ref.last)
        return end

    def beyond_chain(self) -> list[SegmentRef]:
        """The segments past a hole (see chain_end)."""
        end = self.chain_end
        return [ref for ref in self.segments if ref.first > end + 1]


async def list_log(objects: ObjectStore) -> LogListing:
    out = LogListing()
    async for info in objects.list(CHECKPOINT_DIR):
        parsed = parse_checkpoint_key(info.key)
        if parsed is not None:
            out.checkpoints.append((parsed[0], parsed[1], info.key))
    out.checkpoints.sort()
    async for info in objects.list(LOG_DIR):
        rng = parse_segment_key(info.key)
        if rng is not None:
            out.segments.append(SegmentRef(info.key, rng[0], rng[1]))
    return out


async def segment_epoch(objects: ObjectStore, key: str) -> int:
    """The epoch a segment in the store was written under (its prelude alone is read)."""
    return parse_prelude(await objects.get(key, 0, PRELUDE_SIZE))[2]


async def _drop_orphans(objects: ObjectStore, listing: LogListing, nxt: int, epoch: int, seq: int) -> None:
    """The log ends at commit nxt - 1; segments after it are orphans: ones that landed while
    an earlier segment's upload failed (at most ORPHANS_MAX of the chain's epoch: store mode
    keeps that many uploads in flight, and goes one at a time after a failure; their commits
    were never acknowledged in store mode), or a superseded owner's late writes (an older
    epoch). They are deleted, so that our next segments cannot collide with their keys and
    the log ends where the WAL does. More of them than uploads could leave is a real gap:
    refused."""
    orphans = [ref for ref in listing.segments if ref.first > nxt]
    current = 0
    for ref in orphans:
        if await segment_epoch(objects, ref.key) >= epoch:
            current += 1
    if current > ORPHANS_MAX:
        raise RestoreError(f"the store's log has a gap: no segment holds commit {nxt} (next segment: "
                           f"{orphans[0].key}, {current} after it); restored up to commit {seq}")
    for ref in orphans:
        log.warning("the log ends at commit %d: deleting %s beyond it (never acknowledged in store mode)",
                    seq, ref.key)
        await objects.delete(ref.key)


async def drop_dead_beyond(objects: ObjectStore, listing: LogListing, seq: int) -> LogListing:
    """Segments reaching past commit `seq` (where this WAL ends) under an epoch below the one
    the log holds `seq` under are a superseded owner's late writes: no restore takes them (at
    every commit the highest epoch wins, and the chain's epoch never falls). Delete them (call
    only as the prefix's owner) and return the listing without them, so that they do not pass
    for a log ahead of the WAL. (A late re-cut segment reaching past the new owner's end made a
    restart of it on its own disk refuse to start, StoreAhead.)"""
    beyond = [ref for ref in listing.segments if ref.last > seq]
    holding = [ref for ref in listing.segments if ref.first <= seq <= ref.last]
    if not beyond or not holding:
        return listing
    epochs = {ref.key: await segment_epoch(objects, ref.key) for ref in beyond + holding}
    at = max(epochs[ref.key] for ref in holding)
    dead = [ref for ref in beyond if epochs[ref.key] < at]
    for ref in dead:
        log.warning("deleting %s: a superseded owner's late write (epoch %d) past commit %d of epoch %d",
                    ref.key, epochs[ref.key], seq, at)
        await objects.delete(ref.key)
    gone = {ref.key for ref in dead}
    return LogListing(listing.checkpoints, [ref for ref in listing.segments if ref.key not in gone])


class StartRefused(RuntimeError):
    """The ingester must not start (another owner is live, the log cannot be restored, the
    data dir is behind the store); the message says why and what to do."""


class RestoreError(StartRefused):
    """The store's log cannot rebuild a WAL (a gap, or an unreadable segment)."""


def wal_is_empty(wal_dir: Path) -> bool:
    """No WAL yet in this data dir (a new machine, or a lost disk)."""
    return not (wal_dir / "data.mdb").exists()


async def drop_wal_behind_log(objects: ObjectStore, wal_dir: Path, map_size: int) -> bool:
    """Store mode, at start: if the store's log reaches further than this data dir's WAL,
    delete the WAL (the caller restores it from the store) and return True.

    In store mode a segment's upload starts before LMDB commits it (ingester/shipper.py), so
    a process killed between the two leaves the log one or a few commits ahead of the WAL:
    commits that were never acknowledged, made on exactly the WAL's last state. (Or another
    ingester owned the prefix since and wrote more.) Either way the store holds every
    acknowledged commit, and the log is the history to continue: what the local WAL has
    beyond a hole in it was never acknowledged in store mode. Local mode keeps refusing such a
    WAL (shipper.StoreAhead): there, its unshipped commits were acknowledged."""
    if wal_is_empty(wal_dir):
        return False
    wal = WalEnv(wal_dir, map_size)
    try:
        with wal.env.begin() as txn:
            local = wal.commit_seq(txn)
    finally:
        wal.close()
    # (the chain's end, not the highest seq: a restore replays no further, and segments past a
    # hole were never acknowledged; the shipper's start covers the hole with a checkpoint)
    shipped = (await drop_dead_beyond(objects, await list_log(objects), local)).chain_end
    if local >= shipped:
        return False
    log.warning("the store's log reaches commit %d, this data dir's WAL only %d: restoring the WAL from the store "
                "(everything acknowledged in store mode is there)", shipped, local)
    shutil.rmtree(wal_dir)
    return True


@dataclass(slots=True)
class Chain:
    """Where a WAL rebuilt from the log stands: the checkpoint it started from, the last commit
    applied and the epoch of the segment that held it, the epoch at each seq since the
    checkpoint (`runs`: (first seq, epoch) wherever it changed), and every segment key that was
    in a listing it was extended with (ingester/log_follow.py checks those at a takeover)."""

    base: tuple[int, int, str] | None  # the latest checkpoint (seq, epoch, key) when it started
    seq: int
    epoch: int
    runs: list[tuple[int, int]] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)

    def epoch_at(self, seq: int) -> int:
        """The epoch of the segment whose commit `seq` was applied (the checkpoint's at or
        below its seq)."""
        found = self.base[1] if self.base is not None else 0
        for first, epoch in self.runs:
            if first > seq:
                break
            found = epoch
        return found


async def restore(objects: ObjectStore, wal_dir: Path, map_size: int, listing: LogListing | None = None) -> int:
    """Rebuild an empty WAL dir from the store's latest checkpoint and the segments after it;
    returns the seq restored to. Raises RestoreError (and leaves no WAL behind) on a gap."""
    return (await restore_chain(objects, wal_dir, map_size, listing)).seq


async def restore_chain(objects: ObjectStore, wal_dir: Path, map_size: int, listing: LogListing | None = None,
                        *, final: bool = True) -> Chain:
    """restore(), returning the Chain. `final` (a restore to serve from): the log must end
    where the chain does (orphans beyond it are deleted, more than uploads could leave are a
    gap); otherwise (a standby following the log) the chain just stops where the next commit
    has not landed yet, and nothing is deleted."""
    if listing is None:
        listing = await list_log(objects)
    wal_dir.mkdir(parents=True, exist_ok=True)
    cp = listing.latest_checkpoint
    try:
        if cp is not None:
            data = await objects.get(cp[2])
            write_durably(wal_dir / "data.mdb", data)
            del data
        chain = Chain(cp, cp[0] if cp else 0, cp[1] if cp else 0)
        wal = WalEnv(wal_dir, map_size)
        try:
            with wal.env.begin() as txn:
                seq = wal.commit_seq(txn)
            if seq != chain.seq:
                raise RestoreError(f"checkpoint {cp[2] if cp else '-'} holds commit seq {seq}, its key says {chain.seq}")
            applied = await extend(objects, wal, chain, listing, final=final)
        finally:
            wal.close()
        log.info("restored the WAL from the store: checkpoint at %d, %d commits replayed, now at commit %d",
                 cp[0] if cp else 0, applied, chain.seq)
        return chain
    except BaseException:
        shutil.rmtree(wal_dir, ignore_errors=True)  # never leave a half-restored WAL behind
        raise


async def extend(objects: ObjectStore, wal: WalEnv, chain: Chain, listing: LogListing, *, final: bool) -> int:
    """Apply to `wal` (at chain.seq) the commits the listing's segments hold after it, the
    way a restore chooses them: for each next commit the segment of the highest epoch (not
    below the chain's: an older one is a superseded owner's late write) that holds it,
    reaching furthest. Returns how many commits were applied; `final` as in restore_chain."""
    seq, epoch = chain.seq, chain.epoch
    chain.seen.update(ref.key for ref in listing.segments)
    # Fetch the segments after the chain ahead, a few at a time (S3 round trips add up).
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)

    async def fetch(key: str) -> bytes:
        async with gate:
            return await objects.get(key)

    fetched = {ref.key: asyncio.ensure_future(fetch(ref.key)) for ref in listing.segments if ref.last > seq}
    applied = 0
    # Commits chosen but not yet applied: replayed REPLAY_BATCH segments' worth at a time, in
    # one durable transaction (one per segment was an fsync per segment: 2 s for 480 segments
    # on a busy disk, while a standby's new lease runs).
    pending: list[Commit] = []
    batched = 0

    def flush() -> int:
        nonlocal pending, batched
        try:
            n = replay(wal, pending)
        except ReplayGap as e:
            raise RestoreError(str(e)) from e
        pending, batched = [], 0
        chain.seq = seq
        return n

    try:
        # By first commit: those holding the next commit are found from a moving start, not
        # by a scan of the whole listing per step (thousands of segments after a checkpoint).
        segments = sorted(listing.segments, key=lambda r: (r.first, r.last))
        firsts = [r.first for r in segments]
        reached, holding = 0, list[SegmentRef]()
        while True:
            nxt = seq + 1
            while reached < len(segments) and segments[reached].first <= nxt:
                holding.append(segments[reached])
                reached += 1
            holding = [ref for ref in holding if ref.last >= nxt]
            candidates = []
            for ref in holding:
                segment = decode(await fetched[ref.key])
                if segment.epoch >= epoch:  # an older epoch's: a superseded owner's late write
                    candidates.append((segment.epoch, ref.last, ref, segment))
            if not candidates:
                applied += flush()
                if final:
                    await _drop_orphans(objects, listing, nxt, epoch, seq)
                break
            # Highest epoch first, then the one reaching furthest.
            candidates.sort(key=lambda c: (c[0], c[1]))
            chosen = candidates[-1]
            if chosen[0] != epoch:
                chain.runs.append((nxt, chosen[0]))
            epoch = chain.epoch = chosen[0]
            # Taken only up to where a segment of a higher epoch starts: the newer epoch wins
            # at every commit it holds. (A superseded owner's late re-cut segment may reach
            # past where the new owner took over; its tail must not hide the new owner's.)
            upto = chosen[1]
            for ref in segments[bisect.bisect_right(firsts, nxt):bisect.bisect_right(firsts, upto)]:
                if parse_prelude(await fetched[ref.key])[2] > epoch:
                    upto = ref.first - 1
                    break
            # (what of it follows seq: segments may overlap; replay checks it is contiguous)
            pending.extend(c for c in chosen[3].commits if seq < c.seq <= upto)
            batched += 1
            if pending and pending[-1].seq > seq:
                seq = pending[-1].seq
            else:  # pragma: no cover - the chosen segment holds nxt
                raise RestoreError(f"segment {chosen[2].key} did not advance the log past {seq}")
            if batched >= REPLAY_BATCH:
                applied += flush()
        with wal.env.begin() as txn:
            if wal.commit_seq(txn) != seq:  # pragma: no cover - replay applies what it is given
                raise RestoreError(f"replayed to commit {wal.commit_seq(txn)}, expected {seq}")
        return applied
    finally:
        for task in fetched.values():
            task.cancel()
