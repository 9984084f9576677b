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
member's scope, included; a local store beside the data dir, as `ds3 dev`'s, also by its place
relative to it, so that the directory holding both can be moved), written at each start with a store, after any restore; a start
without a store, or with another one, is refused, naming the store it belongs with. A WAL from
before the record, which only a run with a store gives a commit seq, is refused without a store
too (its store is unknown). A WAL never used with a store may start with one: that is how a
store is added (ingester/shipper.py checkpoints it first). A WAL bound to a prefix's root may
start as a cluster member on that prefix (its namespace below the root): that is how a single
ingester grows into a cluster (ingester/membership.py)."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Final
from urllib.parse import unquote, urlsplit

from ingester.logstore import StartRefused, wal_is_empty
from ingester.wal import WalEnv
from shared.objectstore.scoped import INGESTERS_PREFIX

log = logging.getLogger("ds3.ingester")

BOUND_TO: Final = b"store"  # in `sys`: the URL of the store whose log holds this WAL's commits
IN_DATA_DIR: Final = "data-dir:"  # recorded for a local store in or beside the data dir: its path from there


def bound_store(wal: WalEnv) -> tuple[str | None, bool]:
    """(the store this WAL is bound to, whether it logged commits to a store at all)."""
    with wal.env.begin() as txn:
        raw = txn.get(BOUND_TO, db=wal.sys)
        return (None if raw is None else bytes(raw).decode()), wal.commit_seq(txn) > 0


def check(wal: WalEnv, wal_dir: Path, store: str | None, *, may_join: bool = False) -> None:
    """StartRefused unless this WAL may run with `store` (its URL; None: no store). `may_join`:
    this ingester adopts a single ingester's streams (shared/adoption.py): a WAL bound to the
    prefix's root may become its."""
    recorded, logged = bound_store(wal)
    bound = None if recorded is None else _urls(recorded, wal_dir.parent)[0]
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
    if store is not None and bound is not None and may_join and _joins(bound, store):
        log.info("the write-ahead log in %s held the streams of %s alone: it joins the cluster as %s (its log "
                 "goes on there; streams placed on other members move to them)", wal_dir, bound, store)
        return
    if store is not None and recorded is not None and not _accepts(recorded, store, wal_dir.parent):
        raise StartRefused(
            f"not starting: the write-ahead log in {wal_dir} belongs with the object store {bound}, not "
            f"{store} (--store, DS3_STORE, and --ingester-id in a cluster): its commit log and sealed chunks "
            "are there. Start with that store; to restore from this one instead, start on an empty --data-dir")


def check_dir(wal_dir: Path, map_size: int, store: str | None, *, may_join: bool = False) -> None:
    """check() on a WAL nobody has open yet (before a restore may replace it), if there is one."""
    if wal_is_empty(wal_dir):
        return
    wal = WalEnv(wal_dir, map_size)
    try:
        check(wal, wal_dir, store, may_join=may_join)
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


def _accepts(recorded: str, store: str, data_dir: Path) -> bool:
    """Whether `store` is the one recorded: at the recorded URL, or (a local store in or beside
    the data dir) at the same place relative to the data dir, wherever that is now."""
    return _same(_normal(store)) in {_same(url) for url in _urls(recorded, data_dir)}


def _joins(bound: str, store: str) -> bool:
    """A lone ingester's WAL (bound to the prefix's root) started as a member of a cluster on
    that prefix: how a single ingester grows into a cluster (ingester/membership.py)."""
    head, sep, _ = _normal(store).partition("/" + INGESTERS_PREFIX)
    return bool(sep) and _same(head) == _same(_normal(bound))


def _recorded(url: str, data_dir: Path) -> str:
    """What is recorded of a store's URL. A local store in the data dir or beside it (`ds3 dev
    --ingesters N`: the store next to each member's data dir) is recorded by its place relative
    to the data dir and by its URL (a line each): moved together, or the data dir alone, they
    still match."""
    if url.startswith("file://"):
        path = _path(url)
        base = data_dir.resolve()
        for root in (base, base.parent):
            with contextlib.suppress(ValueError):
                path.relative_to(root)
                return f"{IN_DATA_DIR}{os.path.relpath(path, base)}\n{path.as_uri()}"
    return url


def _urls(recorded: str, data_dir: Path) -> list[str]:
    """The URLs a recorded value accepts, the first the one to name (a value recorded before
    the URL line was added holds one relative path)."""
    urls = []
    for line in recorded.splitlines():
        if line.startswith(IN_DATA_DIR):
            line = (data_dir.resolve() / line.removeprefix(IN_DATA_DIR)).resolve().as_uri()
        urls.append(line)
    return urls


def _normal(url: str) -> str:
    return _path(url).as_uri() if url.startswith("file://") else url


def _path(url: str) -> Path:
    return Path(unquote(urlsplit(url).path)).resolve()


def _setting_of(bound: str) -> str:
    """The --store value that names `bound` (a cluster member's scope is not part of it)."""
    head, sep, _ = bound.partition("/" + INGESTERS_PREFIX)
    return head if sep else bound
