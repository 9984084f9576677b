"""Live followers behind infra/nginx.conf: how many long-polls reach the reader per message, and
how long a message takes to reach every follower.

    .venv/bin/python scripts/bench_cdn.py                          # 500 followers, 20 messages
    .venv/bin/python scripts/bench_cdn.py --followers 1000 --messages 50 --rate 5

Starts a `ds3 ingester` (local store), a `ds3 reader` (one worker) and nginx with infra/nginx.conf
(needs the nginx binary: apt-get install nginx), then N long-poll clients (aiohttp, each echoing
the cursor it is given) follow one stream through nginx while a writer appends M messages at
--rate per second. Reports the reader's long-poll requests per message (the collapsing: the
target is at most 3) and delivery latency p50/p99 (append acknowledged -> message received).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import procs  # noqa: E402
from tests.test_nginx import Nginx, nginx_binary  # noqa: E402

ROUTE = 'ds3_http_requests_total{route="stream_long_poll",status="%s"}'


async def reader_long_polls(session: aiohttp.ClientSession, base: str) -> int:
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    total = 0
    for status in ("200", "204"):
        m = re.search(rf"^{re.escape(ROUTE % status)} ([0-9.e+]+)$", text, flags=re.M)
        total += int(float(m.group(1))) if m else 0
    return total


async def follow(session: aiohttp.ClientSession, url: str, offset: str, want: int,
                 received: list[tuple[int, float]]) -> None:
    cursor: str | None = None
    got = 0
    while got < want:
        params = {"live": "long-poll", "offset": offset, **({"cursor": cursor} if cursor else {})}
        async with session.get(url, params=params) as r:
            body = await r.read()
            now = time.monotonic()
            if r.status == 200:
                for m in body.split(b"|"):
                    if m:
                        received.append((int(m), now))
                        got += 1
            offset = r.headers["Stream-Next-Offset"]
            cursor = r.headers.get("Stream-Cursor", cursor)


async def run(edge: str, origin: str, followers: int, messages: int, rate: float) -> dict[str, float]:
    url = edge + "/v1/stream/cdn-bench"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        async with s.put(url, headers={"Content-Type": "text/plain"}) as r:
            start = r.headers["Stream-Next-Offset"]
        before = await reader_long_polls(s, origin)
        received: list[tuple[int, float]] = []
        tasks = [asyncio.create_task(follow(s, url, start, messages, received)) for _ in range(followers)]
        await asyncio.sleep(1.0)
        sent: dict[int, float] = {}
        for i in range(messages):
            async with s.post(url, data=f"{i}|".encode(), headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 204
                sent[i] = time.monotonic()
            await asyncio.sleep(1 / rate)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        polls = await reader_long_polls(s, origin) - before
    lat = sorted((t - sent[i]) * 1000 for i, t in received)
    return {"followers": followers, "messages": messages, "reader_long_polls": polls,
            "per_message": polls / messages, "deliveries": len(lat),
            "p50_ms": statistics.median(lat), "p99_ms": lat[int(len(lat) * 0.99) - 1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--followers", type=int, default=500)
    ap.add_argument("--messages", type=int, default=20)
    ap.add_argument("--rate", type=float, default=4.0, help="messages per second")
    args = ap.parse_args()
    binary = nginx_binary()
    if binary is None:
        sys.exit("bench_cdn: nginx not found (apt-get install nginx)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "objects").mkdir()
        store = (work / "objects").as_uri()
        ing = procs.ingester(work / "wal", "--store", store, "--long-poll-timeout", "20", "--log-level", "warning")
        rd = procs.reader(work / "reader", ing.url, store, "--long-poll-timeout", "20", "--log-level", "warning")
        ngx = Nginx(binary, work / "nginx", procs.free_port(), [rd.port])
        try:
            ing.start()
            rd.start()
            ngx.start()
            r = asyncio.run(run(ngx.url, rd.url, args.followers, args.messages, args.rate))
        finally:
            ngx.stop()
            rd.stop()
            ing.stop()
    print(f"{r['followers']} long-poll followers through nginx, {r['messages']} messages: "
          f"{r['reader_long_polls']} reader long-polls ({r['per_message']:.2f} per message, target <= 3); "
          f"{r['deliveries']} deliveries, p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms")
    sys.exit(0 if r["per_message"] <= 3 and r["deliveries"] == r["followers"] * r["messages"] else 1)


if __name__ == "__main__":
    main()
