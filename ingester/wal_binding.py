"""Which object store a WAL belongs with, checked at every start.

Once an ingester has run with a store, its WAL and that store are one history: the store's
commit log holds the WAL's commits in order (a restore on an empty disk, a standby's takeover
rebuild the WAL from it), and the WAL's chunk records name sealed objects there. Started once
without the store, the ingester acknowledged writes the log never got: the commit counter does
not move without a log, so when the store came back nothing noticed the gap, and a restore
after a lost disk lacked those streams, or broke on the records they left (found by QA: 404s,
then 500s naming a missing journal record). Started with another store (a typo in the prefix),
it copied the WAL there as if it were that prefix's history.

So the WAL records, in `sys`, the URL of the store it logs to (the prefix, and a cluster
member's scope, included; a local store inside the data dir, as `ds3 dev`'s, by its place there,
so that the data dir can be moved), written at each start with a store, after any restore; a start
without a store, or with another one, is refused, naming the store it belongs with. A WAL from
before the record, which only a run with a store gives a commit seq, is refused without a store
too (its store is unknown). A WAL never used with a store may start with one: that is how a
store is added (ingester/shipper.py checkpoints it first)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Final
from urllib.parse import unquote, urlsplit

from ingester.logstore import StartRefused, wal_is_empty
from ingester.wal import WalEnv
from shared.objectstore.scoped import INGESTERS_PREFIX

BOUND_TO: Final = b"store"  # in `sys`: the URL of the store whose log holds this WAL's commits
IN_DATA_DIR: Final = "data-dir:"  # recorded for a local store inside the data dir: its path there


def bound_store(wal: WalEnv) -> tuple[str | None, bool]:
    """(the store this WAL is bound to, whether it logged commits to a store at all)."""
    with wal.env.begin() as txn:
        raw = txn.get(BOUND_TO, db=wal.sys)
        return (None if raw is None else bytes(raw).decode()), wal.commit_seq(txn) > 0


def check(wal: WalEnv, wal_dir: Path, store: str | None) -> None:
    """StartRefused unless this WAL may run with `store` (its URL; None: no store)."""
    recorded, logged = bound_store(wal)
    bound = None if recorded is None else _url(recorded, wal_dir.parent)
    if store is None and bound is not None:
        raise StartRefused(
            f"not starting: the write-ahead log in {wal_dir} belongs with the object store {bound}: its "
            "commit log and sealed chunks are there, and without it what this ingester acknowledges would "
            f"be missing from that log. Start with --store {_setting_of(bound)} (DS3_STORE), or use another "
            "--data-dir")
    if store is None and logged:
        raise StartRefused(
            f"not starting: the write-ahead log in {wal_dir} was used with an object store (its commits "
            "were logged there): start with that --store (DS3_STORE), or use another --data-dir")
    if store is not None and recorded is not None and _same(recorded) != _same(_recorded(store, wal_dir.parent)):
        raise StartRefused(
            f"not starting: the write-ahead log in {wal_dir} belongs with the object store {bound}, not "
            f"{store} (--store, DS3_STORE, and --ingester-id in a cluster): its commit log and sealed chunks "
            "are there. Start with that store; to restore from this one instead, start on an empty --data-dir")


def check_dir(wal_dir: Path, map_size: int, store: str | None) -> None:
    """check() on a WAL nobody has open yet (before a restore may replace it), if there is one."""
    if wal_is_empty(wal_dir):
        return
    wal = WalEnv(wal_dir, map_size)
    try:
        check(wal, wal_dir, store)
    finally:
        wal.close()


def bind(wal: WalEnv, wal_dir: Path, store: str) -> None:
    """Record that this WAL logs to `store` (before the writer starts: nobody else writes)."""
    value = _recorded(store, wal_dir.parent).encode()
    with wal.env.begin(write=True) as txn:
        if txn.get(BOUND_TO, db=wal.sys) != value:
            txn.put(BOUND_TO, value, db=wal.sys)


def _same(url: str) -> str:
    return url.rstrip("/")


def _recorded(url: str, data_dir: Path) -> str:
    """What is recorded of a store's URL: a local store inside the data dir by its place there."""
    if url.startswith("file://"):
        path = Path(unquote(urlsplit(url).path)).resolve()
        with contextlib.suppress(ValueError):
            return IN_DATA_DIR + path.relative_to(data_dir.resolve()).as_posix()
    return url


def _url(recorded: str, data_dir: Path) -> str:
    if recorded.startswith(IN_DATA_DIR):
        return (data_dir.resolve() / recorded.removeprefix(IN_DATA_DIR)).as_uri()
    return recorded


def _setting_of(bound: str) -> str:
    """The --store value that names `bound` (a cluster member's scope is not part of it)."""
    head, sep, _ = bound.partition("/" + INGESTERS_PREFIX)
    return head if sep else bound
