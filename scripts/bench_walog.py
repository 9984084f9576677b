"""The cost of recording write-sets for the commit log (ingester/logged_txn.py), per append.

    .venv/bin/python scripts/bench_walog.py                       # 100k appends, 1000 per commit
    .venv/bin/python scripts/bench_walog.py --appends 200000 --per-commit 100 --rounds 5

Runs N appends through the real Store on the WAL writer thread (GroupCommitter.run_sync of
an operation doing `--per-commit` appends, round-robin over `--streams` streams), on a fresh
WAL per run, in three modes:

  off      no log configured: operations get the raw LMDB transaction (the default);
  logged   a hook that keeps each commit's write-set (what a shipper would queue);
  encoded  the same, and the hook also encodes each commit as a log segment (the shipper's
           work, which would run off the writer thread: shown for its cost only).

Each mode runs `--rounds` times, interleaved; the best round counts. Reported: CPU time of
the process per append (what recording costs; steadier than wall time on a shared machine),
wall time per append, and the CPU overhead over `off`. Commits fsync (LMDB sync=True) as in
production.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingester.store import Store
from ingester.wal import GroupCommitter, OnLogged, WalEnv
from ingester.writes import AppendRequest, CreateRequest, SealPolicy
from shared.logsegment import Commit, encode

MiB = 1 << 20


def run(mode: str, args: argparse.Namespace, root: Path) -> tuple[float, float, int, int]:
    """(CPU seconds and wall seconds for the appends, commits logged, bytes of writes logged)."""
    path = Path(tempfile.mkdtemp(dir=root))
    wal = WalEnv(path, 4096 * MiB)
    # --seal: as with an object store configured (appends check the unsealed bytes; chunks
    # never roll here, nothing is uploaded)
    store = Store(wal, seal=SealPolicy(1 << 40, 1e9, 1 << 40) if args.seal else None)
    loop = asyncio.new_event_loop()  # never runs: run_sync answers on the writer thread
    commits: list[Commit] = []
    encoded = [0]

    def keep(commit: Commit) -> None:
        commits.append(commit)

    def keep_and_encode(commit: Commit) -> None:
        commits.append(commit)
        encoded[0] += len(encode([commit]))

    hook: OnLogged | None = {"off": None, "logged": keep, "encoded": keep_and_encode}[mode]
    committer = GroupCommitter(wal, loop, on_abort=store.reset, on_commit=store.flush,
                               on_durable=lambda news: None, on_logged=hook)
    committer.start()
    try:
        paths = [f"bench/{i}" for i in range(args.streams)]
        for p in paths:
            committer.run_sync(lambda txn, p=p: store.create(txn, CreateRequest(p, "application/octet-stream")))
        reqs = [AppendRequest(p, "application/octet-stream", b"x" * args.body, None) for p in paths]
        n, per = args.appends, args.per_commit

        def batch(start: int, count: int) -> Callable[[object], None]:
            def op(txn: object) -> None:
                for i in range(start, start + count):
                    store.append(txn, reqs[i % len(reqs)])
            return op

        commits.clear()
        began, cpu = time.perf_counter(), time.process_time()
        for start in range(0, n, per):
            committer.run_sync(batch(start, min(per, n - start)))
        cpu, elapsed = time.process_time() - cpu, time.perf_counter() - began
        logged_bytes = sum(len(k) + len(v) for c in commits for _db, _op, k, v in c.writes)
        return cpu, elapsed, len(commits), logged_bytes
    finally:
        committer.stop()
        wal.close()
        loop.close()
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--appends", type=int, default=100_000)
    ap.add_argument("--per-commit", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--body", type=int, default=100, help="bytes per append")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="off,logged,encoded")
    ap.add_argument("--seal", action="store_true", help="a seal policy, as with an object store")
    args = ap.parse_args()
    modes = args.modes.split(",")
    times: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    info: dict[str, tuple[int, int]] = {}
    root = Path(tempfile.mkdtemp(prefix="ds3-bench-walog-"))
    try:
        for _ in range(args.rounds):
            for m in modes:
                t, wall, ncommits, nbytes = run(m, args, root)
                times[m].append(t)
                walls[m].append(wall)
                info[m] = (ncommits, nbytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.appends} appends of {args.body} B over {args.streams} streams, {args.per_commit} per commit, "
          f"best of {args.rounds}{', seal policy on' if args.seal else ''}")
    base = min(times["off"]) if "off" in times else None
    for m in modes:
        best = min(times[m])
        per_append = best / args.appends * 1e6
        extra = f"  (+{(best - base) / args.appends * 1e6:.2f} us/append, {100 * (best / base - 1):+.1f}%)" \
            if base is not None and m != "off" else ""
        ncommits, nbytes = info[m]
        logged = f"  logged {ncommits} commits, {nbytes / args.appends:.0f} B of keys+values per append" \
            if ncommits else ""
        print(f"  {m:8s} CPU {per_append:6.2f} us/append (median {statistics.median(times[m]) / args.appends * 1e6:.2f}),"
              f" wall {min(walls[m]) / args.appends * 1e6:.2f}{extra}{logged}")


if __name__ == "__main__":
    main()
