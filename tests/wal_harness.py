"""A write-ahead log on a directory, without HTTP: WalEnv + Store + GroupCommitter on a real
LMDB, with a settable clock, for tests of the write path (test_store, test_journal). Its
fixtures `clock` and `h` are registered in conftest.py.

With DS3_TEST_SHADOW_LOG=1 in the environment, every Harness logs its commits (ShadowLog) and,
when closed, replays them into an empty WAL and asserts that every database came out equal:
the write-path tests then check the commit log (logged_txn.py, replay.py) too."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import pytest

from ingester.reads import Reads
from ingester.records import SID, StreamMeta
from ingester.replay import replay
from ingester.store import Store
from ingester.wal import GroupCommitter, OnLogged, WalEnv
from ingester.writes import AppendRequest, AppendResult, Committed, CreateRequest, CreateResult, SealPolicy
from shared import offsets
from shared.config import MiB
from shared.logsegment import DB_IDS, Commit
from shared.protocol import ProducerHeaders

T = TypeVar("T")
TEXT = "text/plain"
JSON = "application/json"


class Clock:
    """A settable clock for Store (starts at the real time so Reads agree until moved)."""

    def __init__(self) -> None:
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now


def dump(wal: WalEnv) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every key and value of every named database."""
    with wal.env.begin(buffers=False) as txn:
        return {name: list(txn.cursor(getattr(wal, name))) for name in DB_IDS}


class ShadowLog:
    """An on_logged hook that keeps every commit, and checks them by replay."""

    def __init__(self) -> None:
        self.commits: list[Commit] = []
        self._lock = threading.Lock()

    def __call__(self, commit: Commit) -> None:
        with self._lock:
            self.commits.append(commit)

    def replayed(self, path: Path, commits: list[Commit] | None = None) -> WalEnv:
        """A new WAL at `path` (empty before) with the commits replayed."""
        wal = WalEnv(path, 64 * MiB)
        replay(wal, self.commits if commits is None else commits)
        return wal

    def verify(self, wal: WalEnv) -> None:
        """Replaying every commit from scratch gives `wal`'s databases exactly."""
        with tempfile.TemporaryDirectory(prefix="ds3-shadow-") as tmp:
            copy = self.replayed(Path(tmp) / "wal")
            try:
                assert dump(copy) == dump(wal), "the replayed log differs from the WAL"
            finally:
                copy.close()


# One ShadowLog per WAL directory, so a Harness reopened on it (a restart) continues it.
_shadows: dict[Path, ShadowLog] = {}
SHADOW = os.environ.get("DS3_TEST_SHADOW_LOG") == "1"


class Harness:
    """WalEnv + Store + GroupCommitter on a directory; close() and reopen like a restart."""

    def __init__(
        self, path: Path, clock: Clock, loop: asyncio.AbstractEventLoop | None = None, seal: SealPolicy | None = None,
        on_logged: OnLogged | None = None,
    ) -> None:
        self.path = path
        self.clock = clock
        self.wal = WalEnv(path, 64 * MiB)
        self.store = Store(self.wal, clock=clock, seal=seal)
        self._own_loop = loop is None
        self.loop = loop or asyncio.new_event_loop()
        self.durable: list[Committed] = []  # what each durable commit changed, as on_durable got it
        self.shadow: ShadowLog | None = None
        if on_logged is None and SHADOW:
            on_logged = self.shadow = _shadows.setdefault(path.resolve(), ShadowLog())
        self.committer = GroupCommitter(
            self.wal, self.loop, on_abort=self.store.reset, on_commit=self.store.flush,
            on_durable=self.durable.append, on_logged=on_logged,
        )
        self.committer.start()
        self.reads = Reads(self.wal, self.store.touches, threads=1)
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.committer.stop()
        self.reads.close()
        try:
            if self.shadow is not None:
                self.shadow.verify(self.wal)
        finally:
            self.wal.close()
        if self._own_loop:
            self.loop.close()

    def run(self, op: Callable[[lmdb.Transaction], T]) -> T:
        return self.committer.run_sync(op)

    # --- operations ------------------------------------------------------------------

    def create(self, path: str, content_type: str | None = TEXT, **kw: Any) -> CreateResult:
        req = CreateRequest(path=path, content_type=content_type, **kw)
        return self.run(lambda txn: self.store.create(txn, req))

    def append(
        self, path: str, body: bytes, content_type: str | None = TEXT, *,
        producer: tuple[str, int, int] | None = None, seq: str | None = None, close: bool = False,
    ) -> AppendResult:
        p = ProducerHeaders(*producer) if producer is not None else None
        req = AppendRequest(path, content_type, body, None, close=close, stream_seq=seq, producer=p)
        return self.run(lambda txn: self.store.append(txn, req))

    def delete(self, path: str) -> None:
        self.run(lambda txn: self.store.delete(txn, path))

    # --- what is durably stored ------------------------------------------------------------

    def meta(self, path: str) -> StreamMeta | None:
        with self.wal.env.begin(buffers=False) as txn:
            raw = txn.get(path.encode(), db=self.wal.streams)
            return StreamMeta.decode(raw) if raw is not None else None

    def keys(self, db: Any, sid: int) -> list[bytes]:
        prefix = SID.pack(sid)
        with self.wal.env.begin(buffers=False) as txn:
            cur = txn.cursor(db)
            out: list[bytes] = []
            if cur.set_range(prefix):
                for key in cur.iternext(keys=True, values=False):
                    if not key.startswith(prefix):
                        break
                    out.append(key)
            return out

    def stored(self, sid: int) -> int:
        """How many of the stream's messages the WAL holds: in `records` and in the journal."""
        with self.wal.env.begin(buffers=False) as txn:
            journaled = sum(1 for _k, v in txn.cursor(self.wal.journal) if SID.unpack(v[8:16])[0] == sid)
        return len(self.keys(self.wal.records, sid)) + journaled

    def offset_at(self, path: str, position: int) -> offsets.Offset:
        """The offset the stream issues for `position` (its chunk id is the chunk holding the
        byte before: reads refuse any other)."""
        at = self.reads.position_sync(path, position)
        assert at is not None, f"{path}: position {position} is past the tail"
        return offsets.Offset(at.chunk, position)

    def contents(self, path: str, max_bytes: int = 1 << 20, position: int = 0) -> bytes:
        """Every byte a catch-up reader gets from `position` (a read from the offset the stream
        issued for it), following Stream-Next-Offset page by page."""
        data = b""
        start: offsets.Offset | str = self.offset_at(path, position) if position else offsets.START
        while True:
            res = self.reads.read_sync(path, start, max_bytes)
            data += b"".join(res.messages)
            if res.up_to_date:
                return data
            start = offsets.parse(res.next_offset)

    def snapshot(self, path: str) -> tuple[StreamMeta | None, bytes]:
        meta = self.meta(path)
        return meta, (self.contents(path) if meta is not None and not meta.soft_deleted else b"")


class FailingCommits:
    """An LMDB environment whose write transactions fail to commit, as with EIO from
    fdatasync: LMDB aborts the transaction, so nothing it did is stored."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, write: bool = False, **kw: Any) -> Any:
        txn = self._env.begin(write=write, **kw)
        return _FailingCommit(txn) if write else txn


class _FailingCommit:
    def __init__(self, txn: lmdb.Transaction) -> None:
        self.txn = txn

    def __enter__(self) -> lmdb.Transaction:
        return self.txn

    def __exit__(self, exc_type: object, *rest: object) -> bool:
        self.txn.abort()
        if exc_type is None:
            raise lmdb.DiskError("injected: the commit failed")
        return False


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def h(tmp_path: Path, clock: Clock) -> Iterator[Harness]:
    harness = Harness(tmp_path / "wal", clock)
    yield harness
    harness.close()


def fork(h: Harness, path: str, source: str, offset: str | None = None, sub: int | None = None,
         content_type: str | None = None, **kw: Any) -> CreateResult:
    return h.create(path, content_type, fork_from=source, fork_offset=offset, fork_sub_offset=sub, **kw)
