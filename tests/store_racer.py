"""A process racing others on one local store (tests/test_objectstore.py): started with the
'spawn' method, so it is a module of its own, cheap to import."""

from __future__ import annotations

import asyncio
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

from shared.errors import PreconditionFailed
from shared.objectstore import LocalStore


def race(root: str, ident: int, rounds: int, barrier: Barrier, results: Queue[tuple[str, int, int, bool]]) -> None:
    """Each round: every process reads the same version of "cas", then all replace it with
    if_match at once; then all create "new/<round>" with if_absent at once. Reports
    (kind, round, ident, won) for each attempt."""
    asyncio.run(_race(Path(root), ident, rounds, barrier, results))


async def _race(root: Path, ident: int, rounds: int, barrier: Barrier,
                results: Queue[tuple[str, int, int, bool]]) -> None:
    async with LocalStore(root) as store:
        for r in range(rounds):
            _, etag = await store.get_with_etag("cas")
            barrier.wait()  # everyone holds the same version
            try:
                await store.put("cas", f"round {r} by {ident}".encode(), if_match=etag)
                results.put(("if_match", r, ident, True))
            except PreconditionFailed:
                results.put(("if_match", r, ident, False))
            barrier.wait()
            try:
                await store.put(f"new/{r}", f"{ident}".encode(), if_absent=True)
                results.put(("if_absent", r, ident, True))
            except PreconditionFailed:
                results.put(("if_absent", r, ident, False))
            barrier.wait()  # the round is over before anyone reads "cas" again
