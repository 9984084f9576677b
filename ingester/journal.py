"""The journal: where appended messages land first, in commit order, before they are folded
in bulk into `records` (keyed by stream).

Why: `records` is keyed (sid, end position) so that a stream reads back in order, but then a
group commit of appends to N streams dirties N leaf pages (and their branch pages), all
written and fsynced. With 32 writers on their own streams that was ~27 pages (~110 KB) per
commit of ~14 appends. Journal keys rise with every message, so a commit touches the last
leaf page or two of `journal`, plus one page of `jtail` (a few bytes per stream). A fold
moves every journal record into `records` in one transaction, touching each stream's pages
once for hundreds of messages. Everything stays in LMDB, so a read transaction sees records
and journal from the same snapshot, and a crash keeps exactly what was committed.

Named databases (in the WAL environment, next to records.py's):

    journal  key: serial u64 BE         value: JournalHeader | message bytes
    jtail    key: sid u64 BE            value: serial u64 BE of the stream's newest journal record

    0        8        16       24       32  33
    +--------+--------+--------+--------+---+---------------------+
    | prev   | sid    | end    | chunk  | f | message bytes ...   |
    +--------+--------+--------+--------+---+---------------------+
    prev:  serial of the same stream's previous journal record; 0 = none (serials start at 1)
    end, chunk, f: as a `records` entry (records.py): end position, chunk id, flags

Bytes 8-24 are the record's `records` key (sid | end) and bytes 24- its `records` value
(chunk | f | message): folding a record is two slices and a put.

Invariant: a stream's journal records all lie after its `records` entries (appends go to the
journal; anything that writes `records` for a stream folds that stream's journal first), so
a read takes `records` up to where they stop and then the journal chain.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final, Protocol

import lmdb

from ingester.records import SID, Record, encode_record, record_key

HEADER: Final = struct.Struct(">QQQQB")
SERIAL: Final = struct.Struct(">Q")
NONE: Final = 0
_KEY_AT: Final = 8  # where a journal value's `records` key starts (see the layout above)
_VALUE_AT: Final = 24  # and its `records` value
# Fold once the journal holds this many messages: reads walk a stream's chain backwards from
# its newest record, so the bound keeps that walk short; a fold of this size costs a few ms.
FOLD_RECORDS: Final = 1024
# Messages larger than this go straight to `records`: journaling them would write their
# bytes twice for little saving (their pages are dirtied by their own size anyway).
JOURNAL_MAX_MESSAGE: Final = 1024


class JournalDbs(Protocol):
    records: lmdb._Database
    journal: lmdb._Database
    jtail: lmdb._Database


def _decode(value: bytes | memoryview) -> tuple[int, int, Record]:
    """(prev serial, sid, record) of a journal value."""
    prev, sid, end, chunk, flags = HEADER.unpack_from(value)
    return prev, sid, Record(end, chunk, flags, bytes(value[HEADER.size :]))


def newest_serial(txn: lmdb.Transaction, dbs: JournalDbs, sid: int) -> int:
    raw = txn.get(SID.pack(sid), db=dbs.jtail)
    return SERIAL.unpack(raw)[0] if raw is not None else NONE


def _chain(txn: lmdb.Transaction, dbs: JournalDbs, sid: int) -> Iterator[tuple[int, Record]]:
    """The stream's journal records, newest first, with their serials."""
    serial = newest_serial(txn, dbs, sid)
    while serial != NONE:
        raw = txn.get(SERIAL.pack(serial), db=dbs.journal)
        if raw is None:  # cannot happen in a committed snapshot; never loop on a broken chain
            raise LookupError(f"journal record {serial} of stream {sid} is missing")
        prev, _sid, rec = _decode(raw)
        yield serial, rec
        serial = prev


def newest(txn: lmdb.Transaction, dbs: JournalDbs, sid: int) -> Record | None:
    """The stream's last journaled message, if any."""
    return next((rec for _serial, rec in _chain(txn, dbs, sid)), None)


def records_after(txn: lmdb.Transaction, dbs: JournalDbs, sid: int, position: int) -> list[Record]:
    """The stream's journal records ending after `position`, oldest first."""
    out: list[Record] = []
    for _serial, rec in _chain(txn, dbs, sid):
        if rec.end <= position:
            break
        out.append(rec)
    out.reverse()
    return out


def fold_all(txn: lmdb.Transaction, dbs: JournalDbs) -> int:
    """Move every journal record into `records` and empty `journal` and `jtail` (on a raw
    transaction: the writer's fold, and replay's of a logged FOLD); returns how many moved."""
    pairs = ((value[_KEY_AT:_VALUE_AT], value[_VALUE_AT:]) for value in txn.cursor(dbs.journal).iternext(
        keys=False, values=True))
    moved, _added = txn.cursor(dbs.records).putmulti(pairs)
    txn.drop(dbs.journal, delete=False)
    txn.drop(dbs.jtail, delete=False)
    return int(moved)


class JournalWriter:
    """The writer thread's side: appends, folds, drops. Caches each stream's newest serial
    and the next serial; `reset` forgets them when a batch aborts."""

    def __init__(self, dbs: JournalDbs) -> None:
        self.dbs = dbs
        self._next: int | None = None
        self._newest: dict[int, int] = {}

    def reset(self) -> None:
        self._next = None
        self._newest.clear()

    def _newest_of(self, txn: lmdb.Transaction, sid: int) -> int:
        serial = self._newest.get(sid)
        if serial is None:
            serial = self._newest[sid] = newest_serial(txn, self.dbs, sid)
        return serial

    def _next_serial(self, txn: lmdb.Transaction) -> int:
        if self._next is None:
            cur = txn.cursor(self.dbs.journal)
            self._next = SERIAL.unpack(cur.key())[0] + 1 if cur.last() else 1
        serial = self._next
        self._next += 1
        return serial

    def append(self, txn: lmdb.Transaction, sid: int, end: int, chunk: int, flags: int, data: bytes) -> None:
        """Write one message of stream `sid` ending at `end`."""
        if len(data) > JOURNAL_MAX_MESSAGE:
            self.fold_stream(txn, sid)
            txn.put(record_key(sid, end), encode_record(chunk, flags, data), db=self.dbs.records)
            return
        prev = self._newest_of(txn, sid)
        serial = self._next_serial(txn)
        key = SERIAL.pack(serial)
        if not txn.put(key, HEADER.pack(prev, sid, end, chunk, flags) + data, db=self.dbs.journal, append=True):
            raise RuntimeError(f"journal serial {serial} is not past the last one")  # aborts the batch
        txn.put(SID.pack(sid), key, db=self.dbs.jtail)
        self._newest[sid] = serial

    def entries(self, txn: lmdb.Transaction) -> int:
        return int(txn.stat(self.dbs.journal)["entries"])

    def fold(self, txn: lmdb.Transaction) -> int:
        """Move every journal record into `records`; returns how many moved. Through a
        LoggedTxn the fold is logged as one FOLD write (replay folds the same journal), not as
        a PUT of every record moved: that wrote each journaled message into the log twice."""
        logged = getattr(txn, "fold_journal", None)
        moved = logged(self.dbs) if logged is not None else fold_all(txn, self.dbs)
        self._newest.clear()  # every stream's chain is empty now (serials keep rising)
        return int(moved)

    def fold_stream(self, txn: lmdb.Transaction, sid: int) -> int:
        """Move one stream's journal records into `records` (before writing there directly)."""
        return self._take_stream(txn, sid, keep=True)

    def drop_stream(self, txn: lmdb.Transaction, sid: int) -> int:
        """Delete one stream's journal records (the stream is deleted)."""
        return self._take_stream(txn, sid, keep=False)

    def _take_stream(self, txn: lmdb.Transaction, sid: int, *, keep: bool) -> int:
        if self._newest_of(txn, sid) == NONE:
            return 0
        chain = list(_chain(txn, self.dbs, sid))
        for serial, rec in chain:
            if keep:
                txn.put(record_key(sid, rec.end), encode_record(rec.chunk, rec.flags, rec.data), db=self.dbs.records)
            txn.delete(SERIAL.pack(serial), db=self.dbs.journal)
        txn.delete(SID.pack(sid), db=self.dbs.jtail)
        self._newest[sid] = NONE
        return len(chain)
