"""Taking the store prefix at start, and restoring the WAL from the store's log.

With a store, an ingester owns its prefix (shared/ownership.py: the epoch record, its lease)
before it opens the WAL; an empty data dir is rebuilt from the log there (a checkpoint and the
segments after it, ingester/logstore.py). A standby restores the same way when it takes over
(ingester/standby.py); both renew the lease they just took while they do.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ingester.logstore import StartRefused, drop_wal_behind_log, list_log, restore, wal_is_empty
from shared.config import IngesterConfig
from shared.errors import ObjectStoreError, OwnedElsewhere, Superseded
from shared.localfile import write_durably
from shared.objectstore import ObjectStore
from shared.objectstore.scoped import ScopedStore, ingester_scope
from shared.ownership import LeaseKeeper, OwnerRecord, Ownership

log = logging.getLogger("ds3.ingester")


def owner_id(config: IngesterConfig) -> str:
    """--owner-id, else an id kept in the data dir: a restart on the same disk (a crash
    included) takes its own record back at once; a new disk waits for the lease."""
    if config.owner_id is not None:
        return config.owner_id
    path = config.data_dir / "owner-id"
    try:
        found = path.read_text().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    oid = f"ingester-{secrets.token_hex(8)}"
    write_durably(path, (oid + "\n").encode())
    return oid


def own_store(objects: ObjectStore, config: IngesterConfig) -> ObjectStore:
    """Where this ingester's commit log, checkpoints and ownership record live: the store's
    root, or, as one of a cluster's ingesters (--ingester-id), a namespace of its own
    (`_ds3/ingesters/<id>/`: the members share the store, not their logs)."""
    if config.ingester_id is None:
        return objects
    return ScopedStore(objects, ingester_scope(config.ingester_id))


async def own_and_restore(config: IngesterConfig, ownership: Ownership, own_objects: ObjectStore, *,
                          adopted_from: ObjectStore | None = None) -> None:
    """With a store: own its prefix, and restore an empty data dir from the store's log,
    before the WAL is opened. `adopted_from`: the prefix's root, whose log is that of the
    single ingester whose streams this member adopts (shared/adoption.py): restored from there
    while this member's own log is empty (the single ingester's disk lost)."""
    try:
        await ownership.acquire()
    except OwnedElsewhere as e:
        if config.ingester_id is not None:  # the prefix is this id's: most likely the same id twice
            raise StartRefused(
                f"not starting: ingester id {config.ingester_id!r} is already running at {e.advertise_url or '?'} "
                f"({e}): each ingester of a cluster needs an --ingester-id of its own. To replace that "
                "process, stop it first (or give this one its --owner-id to take over, or --standby)") from None
        raise StartRefused(f"not starting: {e} (its lease is renewed while it runs; start this one once "
                           "it stopped, give it the same --owner-id to take it over, or run it with "
                           "--standby to take over when the lease lapses)") from None
    except ObjectStoreError as e:
        raise StartRefused(f"not starting: cannot take ownership of {config.store}: {e}") from None
    say_if_weaker(ownership.previous_record, config)
    if ownership.previous_owner not in (None, ownership.owner_id) and not wal_is_empty(config.wal_dir):
        _set_wal_aside(config, ownership.previous_owner)
    if config.durability == "store":  # (see drop_wal_behind_log)
        await drop_wal_behind_log(own_objects, config.wal_dir, config.wal_map_size)
    # The lease just taken is renewed while the log is restored: a long log or a slow store
    # outlasted it, and the ingester then fenced itself at its first renewal and exited, at
    # every restart (found by QA: ~1,000 segments on moto against a 3 s lease).
    if wal_is_empty(config.wal_dir):
        await restore_keeping_the_lease(config, ownership, own_objects)
    if wal_is_empty(config.wal_dir) and adopted_from is not None:
        source = adopted_from
        await restore_keeping_the_lease(config, ownership, own_objects, lambda: restore_wal(config, source))


def say_if_weaker(previous: OwnerRecord | None, config: IngesterConfig) -> None:
    """Warn when we acknowledge less than the owner before us did: a standby (or a restart)
    left at the default --durability local after an owner in store mode lowered the guarantee
    without a word (found by QA)."""
    if previous is not None and previous.durability == "store" and config.durability == "local":
        log.warning("the previous owner of %s (%s, epoch %d) ran with --durability store (an append acknowledged "
                    "once the store's log held it); this ingester runs with --durability local: from now on appends "
                    "are acknowledged before the store has them (up to --ship-interval behind). Start it with "
                    "--durability store (DS3_DURABILITY) to keep that guarantee", config.store, previous.owner_id,
                    previous.epoch)


def _set_wal_aside(config: IngesterConfig, since: str | None) -> None:
    """Another ingester owned the prefix since this data dir's WAL was last written (a standby
    took over from this one, which now restarts on its old disk): the store's log went on
    from what that owner restored, so this WAL's commits beyond it (ones answered 503 in store
    mode, or not shipped yet in local mode: the takeover lost them already) are a history no
    one continued. Kept beside the data dir for inspection; the WAL is restored from the store.
    (Comparing commit seqs alone kept such a WAL whenever it held more commits than the new
    owner had written, and its checkpoint then replaced the new owner's acknowledged appends.)"""
    aside = config.wal_dir.with_name(f"{config.wal_dir.name}.superseded-{time.strftime('%Y%m%dT%H%M%S')}")
    config.wal_dir.rename(aside)
    log.warning("%s owned %s since this data dir's WAL was written: its history continues in the store's log, "
                "not in this WAL, which is set aside at %s (delete it once inspected) and restored from the store",
                since, config.store, aside)


async def restore_wal(config: IngesterConfig, own_objects: ObjectStore) -> None:
    """Rebuild the (empty) WAL dir from the store's log, if it holds one."""
    listing = await list_log(own_objects)
    if not listing.empty:
        log.info("no WAL in the data dir: restoring it from %s (%d checkpoints, %d segments)",
                 own_objects.url, len(listing.checkpoints), len(listing.segments))
        await restore(own_objects, config.wal_dir, config.wal_map_size, listing)


async def restore_keeping_the_lease(config: IngesterConfig, own: Ownership, own_objects: ObjectStore,
                                    restore: Callable[[], Coroutine[Any, Any, object]] | None = None) -> object:
    """Restore (restore_wal, or `restore`: a standby's followed log brought up to date) while
    renewing the lease just taken: a restore may outlast it (a long log, a slow store), and a
    lapsed lease would let another standby take the prefix meanwhile. Returns what `restore`
    did; Superseded if the lease is lost before the restore is done."""
    lease = LeaseKeeper(own)
    keeper = asyncio.create_task(lease.run(), name="ds3-lease-restoring")
    restoring = asyncio.create_task(restore() if restore is not None else restore_wal(config, own_objects),
                                    name="ds3-restore")
    try:
        await asyncio.wait({keeper, restoring}, return_when=asyncio.FIRST_COMPLETED)
        if not restoring.done():  # the keeper stopped: the lease is lost
            restoring.cancel()
            await asyncio.gather(restoring, return_exceptions=True)
            error = keeper.exception() if not keeper.cancelled() else None
            raise error if isinstance(error, Superseded) else Superseded(
                f"the ownership lease was lost while restoring ({error!r})", own.epoch)
        return restoring.result()
    except asyncio.CancelledError:
        keeper.cancel()  # we are being stopped: no waiting for a renewal (its answer may be lost)
        raise
    finally:
        # Stop the keeper, not cancel it: a renewal in flight is let finish, so that its ETag
        # is ours. Cancelled, its write would still land (the local store writes in a worker
        # thread) with the ownership none the wiser: the service's keeper, next, would find
        # the record changed under it.
        lease.stop()
        restoring.cancel()
        await asyncio.gather(keeper, restoring, return_exceptions=True)
