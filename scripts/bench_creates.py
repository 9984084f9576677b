"""Stream creation through `ds3 dev`'s public port against the reference server (file-backed),
in the same run: what an application with a stream per conversation, user or job pays.

For each server, fresh, on 127.0.0.1: --clients concurrent clients (one aiohttp session, one
keep-alive connection each) create --streams text streams with PUT, then delete them. Reported:
creates/s and deletes/s, p50/p99 of each request (sent -> answered), and the server's CPU per
request (every process of its tree). A ds3 create is acknowledged once the stream's descriptor
is in the object store (readers find it from then on), a delete once the descriptor is gone.

    .venv/bin/python scripts/bench_creates.py                  # 32 clients x 3,000 streams
    .venv/bin/python scripts/bench_creates.py --streams 10000 --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from bench_run import Server, cannot_run, ds3_server, log, reference_server


async def _phase(base: str, method: str, paths: list[str], clients: int) -> dict[str, float]:
    latencies: list[float] = []
    todo = iter(paths)
    errors = 0
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal errors
            for path in todo:
                t = time.perf_counter()
                headers = {"Content-Type": "text/plain"} if method == "PUT" else {}
                async with session.request(method, base + path, headers=headers) as r:
                    await r.read()
                    if r.status not in (200, 201, 204):
                        errors += 1
                latencies.append(time.perf_counter() - t)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        seconds = time.perf_counter() - started
    latencies.sort()
    n = len(latencies)
    return {"requests": n, "per_s": n / seconds, "p50_ms": latencies[n // 2] * 1000,
            "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000, "errors": errors, "seconds": seconds}


def scenario(server: Server, streams: int, clients: int) -> dict[str, Any]:
    paths = [f"/v1/stream/bench-create-{i}" for i in range(streams)]
    out: dict[str, Any] = {}
    for method, name in (("PUT", "create"), ("DELETE", "delete")):
        cpu0 = server.cpu()
        r = asyncio.run(_phase(server.url, method, paths, clients))
        r["cpu_ms_per_request"] = (server.cpu() - cpu0) * 1000 / max(1, r["requests"])
        out[name] = r
        log(f"  {server.name} {name}: {r['per_s']:,.0f}/s, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
            f"{r['cpu_ms_per_request']:.2f} CPU-ms each, {r['errors']} errors")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=3000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--json", type=Path, help="write the results here")
    p = ap.parse_args(argv)
    if cannot_run("bench_creates", node_for="the reference server"):
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-creates-"))
    results: dict[str, Any] = {}
    try:
        for name, make in (("reference", lambda: reference_server(work, 3000)),
                           ("ds3", lambda: ds3_server(work, 3000, [], via="dev"))):
            server = make()
            log(f"bench_creates: starting {server.name}")
            server.start()
            try:
                results[name] = scenario(server, p.streams, p.clients)
            finally:
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=2))
    for what in ("create", "delete"):
        ours, ref = results["ds3"][what], results["reference"][what]
        log(f"{what}: ds3 {ours['per_s']:,.0f}/s (p99 {ours['p99_ms']:.1f} ms, {ours['cpu_ms_per_request']:.2f} "
            f"CPU-ms) vs reference {ref['per_s']:,.0f}/s (p99 {ref['p99_ms']:.1f} ms, "
            f"{ref['cpu_ms_per_request']:.2f} CPU-ms): {ours['per_s'] / ref['per_s']:.2f}x")
    if p.json:
        p.json.write_text(json.dumps(results, indent=2))
    errors = sum(results[s][w]["errors"] for s in results for w in ("create", "delete"))
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
