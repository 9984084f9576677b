"""What the parts of the WAL store share (ingester/store.py's Store and its mixins,
store_sealing.SealingBook and store_expiry.ExpiryBook), as a protocol their methods take as
`self`: the cached metadata and the hooks every write goes through, in one place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import lmdb

from ingester.journal import JournalWriter
from ingester.records import StreamMeta
from ingester.wal import WalEnv
from ingester.writes import Committed, SealPolicy, Touches


class StoreCore(Protocol):
    wal: WalEnv
    clock: Callable[[], float]
    seal: SealPolicy | None
    journal: JournalWriter
    touches: Touches
    last_writes: dict[str, float]
    _dirty: dict[str, StreamMeta]
    _news: Committed
    _expiry: list[tuple[float, str]]  # (deadline hint, path) min-heap
    _aging: list[tuple[float, str]]  # (open chunk's first record time, path) min-heap

    def _load(self, txn: lmdb.Transaction, path: str) -> StreamMeta | None: ...

    def _save(self, meta: StreamMeta) -> None: ...

    def _live(self, txn: lmdb.Transaction, path: str, now: float, own: bool = True) -> StreamMeta | None: ...

    def _remove(self, txn: lmdb.Transaction, meta: StreamMeta) -> None: ...

    def _roll(self, txn: lmdb.Transaction, meta: StreamMeta, now: float) -> None: ...

    def release_retained(self, txn: lmdb.Transaction, meta: StreamMeta) -> list[str]: ...

    def _track_expiry(self, meta: StreamMeta) -> None: ...

    def _stored_covers(self, txn: lmdb.Transaction, path: str, touched: float) -> bool: ...
