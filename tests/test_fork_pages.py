"""A page does not end where a fork's own data begins (unless it is full).

A client reading a fork from -1 with one GET gets the inherited part and the fork's own, as
the conformance suite's fork cases read ("Fork - Recursive should read correctly across three
levels": one GET on the third level expects every level's bytes). Before, when the source's
data was sealed (seal-age 0.5 s in the suite's topologies, so on a loaded machine), the page
ended at the fork point, both at the ingester (a sealed piece was a page of its own) and at the
reader (a sealed piece is capped at the fork position).

Three levels (root <- f1 <- f2), each level's own data sealed or still in the WAL, in every
combination, for byte and JSON streams, read with one GET at -1 from the
ingester and through the reader (local-directory store and moto S3). A fully sealed chain is
served by the reader without the ingester (but for its one question about the tail).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import aiohttp

from tests.cluster import TIMEOUT, Cluster, StoreView, create, get_page, reader_metrics, sealed_end, wait_for

SEAL_BYTES = 1024
OCTET = "application/octet-stream"
JSON = "application/json"
UPSTREAM = "ds3_reader_ingester_requests_total"
TAIL_CHECKS = "ds3_reader_tail_checks_total"



def body_of(level: int, sealed: bool, json_mode: bool) -> bytes:
    """One append for a level: at least SEAL_BYTES when that level's chunk is to be sealed."""
    fill = (b"%d" % level) * (SEAL_BYTES + 16 if sealed else 40)
    if json_mode:
        return json.dumps([{"level": level, "fill": fill.decode()}]).encode()
    return b"<%d>" % level + fill


async def build_chain(s: aiohttp.ClientSession, c: Cluster, store: StoreView, name: str, sealed: tuple[bool, ...],
                      content_type: str) -> list[bytes]:
    """root <- f1 <- f2, level i's one append sealed when sealed[i]; returns their bodies."""
    ing = f"{c.ingester.url}/v1/stream/"
    bodies = []
    paths = [f"{name}-root", f"{name}-f1", f"{name}-f2"]
    for level, path in enumerate(paths):
        extra = {} if level == 0 else {"Stream-Forked-From": f"/v1/stream/{paths[level - 1]}"}
        await create(s, ing + path, content_type, **extra)
        body = body_of(level, sealed[level], content_type == JSON)
        async with s.post(ing + path, data=body, headers={"Content-Type": content_type}) as r:
            assert r.status in (200, 204), await r.text()
            end = int(r.headers["Stream-Next-Offset"].split("_")[1])
        bodies.append(body)
        if sealed[level]:
            uid = wait_for(lambda p=path: (store.descriptor(p) or {}).get("uid"), 10, f"{path} descriptor")
            wait_for(lambda u=uid, e=end: sealed_end(store, u) == e, 15, f"{path}'s chunk sealed")
    for path in paths:  # (the reader learns a stream from its descriptor)
        wait_for(lambda p=path: store.descriptor(p), 10, f"{path} descriptor")
    return bodies


def expected(bodies: list[bytes], content_type: str) -> list[object] | bytes:
    if content_type == JSON:
        return [m for b in bodies for m in json.loads(b)]
    return b"".join(bodies)


def answered(body: bytes, content_type: str) -> list[object] | bytes:
    return json.loads(body) if content_type == JSON else body


# Each level seals on its own (by size or age), so any combination may be what a reader meets.
CHAINS = list(itertools.product([False, True], repeat=3))


async def test_one_get_reads_a_fork_chain_across_sealed_and_unsealed_levels(tmp_path: Path, store: StoreView) -> None:
    with Cluster(tmp_path, store, seal_bytes=SEAL_BYTES) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            failures = []
            for content_type, sealed in itertools.product([OCTET, JSON], CHAINS):
                name = f"{'j' if content_type == JSON else 'b'}{''.join('s' if x else 'w' for x in sealed)}"
                bodies = await build_chain(s, c, store, name, sealed, content_type)
                for level in (1, 2):
                    want = expected(bodies[: level + 1], content_type)
                    for where, base in (("ingester", c.ingester.url), ("reader", c.reader.url)):
                        before = reader_metrics(c.reader.url)
                        p = await get_page(s, f"{base}/v1/stream/{name}-f{level}", "-1")
                        after = reader_metrics(c.reader.url)
                        got = answered(p.body, content_type) if p.status == 200 else p.body
                        if p.status != 200 or got != want or not p.up_to_date:
                            failures.append(f"{name} f{level} via {where}: HTTP {p.status}, "
                                            f"up-to-date {p.up_to_date}, body {p.body[:80]!r}...")
                        if where == "reader" and all(sealed[: level + 1]):
                            asked = after[UPSTREAM] - before[UPSTREAM]
                            checks = after[TAIL_CHECKS] - before[TAIL_CHECKS]
                            if asked != checks or checks > 1:
                                failures.append(f"{name} f{level}: a sealed chain asked the ingester "
                                                f"{asked} times ({checks} tail checks)")
            assert not failures, "\n".join(failures)


async def test_a_page_from_inside_inherited_data_goes_on_into_the_forks(tmp_path: Path, store: StoreView) -> None:
    """Not only the start URL: an offset inside the root's sealed data reads on through both
    forks' data, and a page goes on past a fork point only as far as the read size allows."""
    with Cluster(tmp_path, store, seal_bytes=SEAL_BYTES, ingester_args=["--max-read-bytes", "1500"],
                 reader_args=["--max-read-bytes", "1500"]) as c:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            bodies = await build_chain(s, c, store, "in", (True, True, False), OCTET)
            whole = b"".join(bodies)
            for base in (c.ingester.url, c.reader.url):
                url = f"{base}/v1/stream/in-f2"
                first = await get_page(s, url, "-1")
                assert first.status == 200 and whole.startswith(first.body), (base, first.status)
                assert len(bodies[0]) < len(first.body) <= 1500 + len(bodies[1]), (base, len(first.body))
                assert not first.up_to_date
                # (the rest: from inside root's data, on into f1's and f2's)
                rest = await get_page(s, url, first.next_offset)
                got = first.body + rest.body
                while not rest.up_to_date:
                    assert rest.status == 200 and rest.body, (base, rest.status)
                    rest = await get_page(s, url, rest.next_offset)
                    got += rest.body
                assert got == whole, base
