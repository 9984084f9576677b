"""A write transaction that records what it writes: the write-set of a group commit.

The GroupCommitter (wal.py) hands operations a LoggedTxn instead of the raw LMDB transaction
when a log is configured. Every write method of lmdb.Transaction and lmdb.Cursor is
overridden here: it applies the write to LMDB first and, once LMDB took it, appends
(db id, op, key, value) to `writes` (the tuples of shared/logsegment.py). So the write-set
is by construction what the transaction did, in the order it did it; one description of a
commit's mutations drives both LMDB and the log segment, and the two cannot diverge.
Reads pass through untouched (attribute lookup falls through to the raw transaction or
cursor, and iteration is the raw cursor's iterator).

What is recorded:

    put / cursor put / putmulti       PUT key value  (only if LMDB wrote it: not when
                                      overwrite=False or append=True refused the key)
    replace                           PUT key value
    delete / pop / cursor delete      DELETE key     (only if a key was there)
    drop(db, delete=False)            CLEAR          (the database emptied)
    fold_journal(dbs)                 FOLD           (journal.fold_all: every journal record
                                      moved into `records`; one write, not one per record)

`drop(db, delete=True)` (removing a named database) cannot be logged and raises. None of
the WAL's databases is dupsort, so a delete removes the key whatever value is given.

Rollback: the committer has no savepoints. An operation that raises a DS3Error keeps what
it wrote before raising (LMDB commits it with the batch, so the write-set keeps it too);
any other failure aborts the whole LMDB transaction, and the committer runs the batch again
in a new transaction with a new LoggedTxn: the aborted attempt's write-set is dropped with
it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import lmdb

from ingester.journal import JournalDbs, fold_all
from shared.logsegment import CLEAR, DELETE, FOLD, PUT, Write


class UnloggedDatabase(LookupError):
    """A write to a database the log has no id for (the default database, or one opened
    outside WalEnv): a programming error, which aborts the batch."""


def _b(buf: Any) -> bytes:
    return buf if type(buf) is bytes else bytes(buf)


class LoggedTxn:
    """Duck-types lmdb.Transaction for the committer's operations (cast at the call site)."""

    __slots__ = ("_ids", "_put", "_txn", "get", "stat", "writes")

    def __init__(self, txn: lmdb.Transaction, ids: Mapping[lmdb._Database, int]) -> None:
        self._txn = txn
        self._ids = ids
        self.writes: list[Write] = []
        self._put = txn.put
        self.get = txn.get  # the hot reads: bound once, no __getattr__ on every call
        self.stat = txn.stat  # (an append checks the unsealed bytes when sealing is on)

    def __getattr__(self, name: str) -> Any:  # reads: stat, id, env ...
        return getattr(self._txn, name)

    def _id(self, db: lmdb._Database | None) -> int:
        try:
            return self._ids[db]  # type: ignore[index]
        except KeyError:
            raise UnloggedDatabase(f"write to a database the log does not know: {db!r}") from None

    def put(self, key: Any, value: Any, dupdata: bool = True, overwrite: bool = True, append: bool = False,
            db: lmdb._Database | None = None) -> bool:
        # The hot path (two per journaled append): helpers inlined.
        try:
            db_id = self._ids[db]  # type: ignore[index]
        except KeyError:
            raise UnloggedDatabase(f"write to a database the log does not know: {db!r}") from None
        if self._put(key, value, dupdata, overwrite, append, db):
            self.writes.append((db_id, PUT, key if type(key) is bytes else bytes(key),
                                value if type(value) is bytes else bytes(value)))
            return True
        return False

    def replace(self, key: Any, value: Any, db: lmdb._Database | None = None) -> Any:
        db_id = self._id(db)
        old = self._txn.replace(key, value, db)
        self.writes.append((db_id, PUT, _b(key), _b(value)))
        return old

    def pop(self, key: Any, db: lmdb._Database | None = None) -> Any:
        db_id = self._id(db)
        old = self._txn.pop(key, db)
        if old is not None:
            self.writes.append((db_id, DELETE, _b(key), b""))
        return old

    def delete(self, key: Any, value: Any = b"", db: lmdb._Database | None = None) -> bool:
        db_id = self._id(db)
        if self._txn.delete(key, value, db):
            self.writes.append((db_id, DELETE, _b(key), b""))
            return True
        return False

    def drop(self, db: lmdb._Database, delete: bool = True) -> None:
        db_id = self._id(db)
        if delete:
            raise UnloggedDatabase("dropping a named database cannot be logged (use delete=False to empty it)")
        self._txn.drop(db, delete=False)
        self.writes.append((db_id, CLEAR, b"", b""))

    def fold_journal(self, dbs: JournalDbs) -> int:
        """journal.fold_all on the raw transaction, logged as one FOLD of the journal."""
        db_id = self._id(dbs.journal)
        moved = fold_all(self._txn, dbs)
        self.writes.append((db_id, FOLD, b"", b""))
        return moved

    def cursor(self, db: lmdb._Database | None = None) -> LoggedCursor:
        return LoggedCursor(self._txn.cursor(db), self._id(db), self.writes)


class LoggedCursor:
    """Duck-types lmdb.Cursor: its writes are recorded into the transaction's write-set."""

    __slots__ = ("_cur", "_db_id", "_writes")

    def __init__(self, cur: lmdb.Cursor, db_id: int, writes: list[Write]) -> None:
        self._cur = cur
        self._db_id = db_id
        self._writes = writes

    def __getattr__(self, name: str) -> Any:  # reads and positioning: set_range, key, next ...
        return getattr(self._cur, name)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return iter(self._cur)

    def __enter__(self) -> LoggedCursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cur.close()

    def put(self, key: Any, value: Any, dupdata: bool = True, overwrite: bool = True, append: bool = False) -> bool:
        if self._cur.put(key, value, dupdata, overwrite, append):
            self._writes.append((self._db_id, PUT, _b(key), _b(value)))
            return True
        return False

    def putmulti(self, items: Iterable[tuple[Any, Any]], dupdata: bool = True, overwrite: bool = True,
                 append: bool = False) -> tuple[int, int]:
        if not overwrite or append:  # some pairs may be skipped: learn which, one put at a time
            consumed = added = 0
            for key, value in items:
                consumed += 1
                added += self.put(key, value, dupdata, overwrite, append)
            return consumed, added
        pairs = items if isinstance(items, list) else list(items)
        consumed, added = self._cur.putmulti(pairs, dupdata, overwrite, append)
        db_id = self._db_id
        self._writes.extend((db_id, PUT, _b(k), _b(v)) for k, v in pairs[:consumed])
        return consumed, added

    def replace(self, key: Any, value: Any) -> Any:
        old = self._cur.replace(key, value)
        self._writes.append((self._db_id, PUT, _b(key), _b(value)))
        return old

    def pop(self, key: Any) -> Any:
        old = self._cur.pop(key)
        if old is not None:
            self._writes.append((self._db_id, DELETE, _b(key), b""))
        return old

    def delete(self, dupdata: bool = False) -> bool:
        key = _b(self._cur.key())  # a copy: a buffer would point at the deleted entry
        if self._cur.delete(dupdata):
            self._writes.append((self._db_id, DELETE, key, b""))
            return True
        return False
