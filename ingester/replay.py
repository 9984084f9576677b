"""Replaying logged commits (shared/logsegment.py) into a WAL, in commit order.

A commit's write-set is what its LMDB transaction did (logged_txn.py), so applying the
write-sets of commits 1..n in order to an empty WalEnv (or commits c+1..n to a checkpoint
taken at commit c) rebuilds every named database exactly. Replay is idempotent: a commit
whose seq is at or below the WAL's persisted commit seq (wal.COMMIT_SEQ) is skipped, so a
segment applied twice, or segments that overlap, leave the same state. A commit that does
not follow the persisted seq (a segment is missing) is refused: nothing of that call is
applied.

Run it before a Store and GroupCommitter open the WAL (they cache what they read, and the
committer reads the persisted seq when it is made).
"""

from __future__ import annotations

from collections.abc import Iterable

import lmdb

from ingester.journal import fold_all
from ingester.wal import COMMIT_SEQ, SEQ, WalEnv
from shared.logsegment import CLEAR, DELETE, FOLD, PUT, Commit, LogSegmentError


class ReplayGap(ValueError):
    """A commit does not follow the WAL's persisted commit seq: a segment is missing."""


def apply(txn: lmdb.Transaction, wal: WalEnv, commit: Commit) -> None:
    """Apply one commit's writes in `txn` (no seq checks: see replay) and persist its seq."""
    dbs = wal.log_dbs
    for db_id, op, key, value in commit.writes:
        db = dbs.get(db_id)
        if db is None:
            raise LogSegmentError(f"commit {commit.seq}: unknown database id {db_id}")
        if op == PUT:
            txn.put(key, value, db=db)
        elif op == DELETE:
            txn.delete(key, db=db)
        elif op == CLEAR:
            txn.drop(db, delete=False)
        elif op == FOLD:  # the same journal, folded the same way: the same records
            fold_all(txn, wal)
        else:
            raise LogSegmentError(f"commit {commit.seq}: unknown op {op}")
    txn.put(COMMIT_SEQ, SEQ.pack(commit.seq), db=wal.sys)  # the write-set holds it too; never rely on that


def replay(wal: WalEnv, commits: Iterable[Commit]) -> int:
    """Apply `commits` (in commit order) in one durable transaction, skipping those already
    applied; returns how many were applied. Raises ReplayGap (and applies nothing) if a
    commit does not follow the one before it."""
    applied = 0
    with wal.env.begin(write=True) as txn:
        seq = wal.commit_seq(txn)
        for commit in commits:
            if commit.seq <= seq:
                continue
            if commit.seq != seq + 1:
                raise ReplayGap(f"commit {commit.seq} does not follow commit {seq}: a log segment is missing")
            apply(txn, wal, commit)
            seq = commit.seq
            applied += 1
    return applied
