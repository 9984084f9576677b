"""chain.sealed_chunk_at: the sealed chunk holding a position, found by seeking the manifest
(a binary search over chunk ids), not by walking it from the first chunk on every read."""

from __future__ import annotations

import lmdb
import pytest

from ingester import chain
from ingester.records import SEALED, SEALING, ChunkInfo, chunk_key
from tests.wal_harness import Harness

CHUNKS = 2000
SIZE = 100
FIRST = 7_000_000  # chunk ids start anywhere; the first ones were dropped by retention


def _manifest(h: Harness, sid: int, other: int) -> None:
    def put(txn: lmdb.Transaction) -> None:
        for i in range(CHUNKS):
            state = SEALING if i >= CHUNKS - 3 else SEALED  # the newest are still uploading
            info = ChunkInfo(i * SIZE, (i + 1) * SIZE, 1, False, 0.0, state)
            if i >= 5:  # (ids FIRST..FIRST+4 gone: released before the earliest snapshot)
                txn.put(chunk_key(sid, FIRST + i), info.encode(), db=h.wal.chunks)
            txn.put(chunk_key(other, i), info.encode(), db=h.wal.chunks)  # a neighbour's manifest

    h.run(put)


def test_sealed_chunk_at_finds_each_chunk_in_few_seeks(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    h.create("s")
    h.create("neighbour")
    meta, other = h.meta("s"), h.meta("neighbour")
    assert meta is not None and other is not None
    _manifest(h, meta.sid, other.sid)
    decoded = 0
    real_decode = ChunkInfo.decode

    def counting(raw: bytes | memoryview) -> ChunkInfo:
        nonlocal decoded
        decoded += 1
        return real_decode(raw)

    monkeypatch.setattr(chain.ChunkInfo, "decode", staticmethod(counting))
    with h.wal.env.begin(buffers=False) as txn:
        for position in [0, 499, 500, 501, 12_345, 150_000, (CHUNKS - 4) * SIZE + 99, (CHUNKS - 3) * SIZE,
                         CHUNKS * SIZE - 1, CHUNKS * SIZE, 10**9]:
            decoded = 0
            got = chain.sealed_chunk_at(txn, h.wal, meta, position)
            i = position // SIZE
            expected = (FIRST + i, ChunkInfo(i * SIZE, (i + 1) * SIZE, 1, False, 0.0, SEALED)) \
                if 5 <= i < CHUNKS - 3 else None
            assert got == expected, position
            # before: every chunk from the first to the one holding the position (~2,000)
            assert decoded <= 30, (position, decoded)
