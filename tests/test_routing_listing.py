"""Listings through a reader in front of two ingesters (issue 15): /ds3/streams merges both
ingesters' pages in name order, and never names what the caller may not see, not even when an
ingester's page ends after passing over MAX_SKIPPED private streams (its cursor is sealed: the
reader's cursor is then a merged one, `~~...`, holding each ingester's own)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from ingester.listing import MAX_SKIPPED
from ingester.writes import CreateRequest
from shared.placement import Cluster
from tests import procs
from tests.wal_harness import Clock, Harness

HIDDEN = MAX_SKIPPED + 50
ADMIN = "routing-listing-admin-0123456789"
INTERNAL = "routing-listing-internal-0123456789"
# public names on both ingesters, around a's 10,050 private ones ("secret/..."). Each WAL holds
# only names placed on it (an ingester hands a stream it holds but does not own to its owner,
# ingester/moves.py): the ids are chosen so that the cluster places these names so.
NAMES = ["a-public", "b-public", "m-public", "s-public", "secret0-b", "zz-a", "zz-b"]
# Which public names each ingester holds: spread over both, or all but one on the ingester
# that also holds the private ones (the other's only name sorts after them all).
LAYOUTS = {
    "spread": (["a-public", "m-public", "zz-a"], ["b-public", "s-public", "secret0-b", "zz-b"]),
    "one-on-b": ([n for n in NAMES if n != "secret0-b"], ["secret0-b"]),
}


def _ids(on_a: list[str], on_b: list[str]) -> tuple[str, str]:
    for n in range(100_000):
        ids = (f"a{n}", f"b{n}")
        c = Cluster.of({ids[0]: "http://127.0.0.1:1", ids[1]: "http://127.0.0.1:2"})
        if all(c.owner(p).id == ids[0] for p in on_a) and all(c.owner(p).id == ids[1] for p in on_b):
            return ids
    raise AssertionError("no ids place the names as wanted")


@dataclass
class Front:
    reader: procs.Proc
    secrets: list[str]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    on_a, on_b = LAYOUTS[request.param]
    ids = _ids(on_a, on_b)
    placed = Cluster.of({ids[0]: "http://127.0.0.1:1", ids[1]: "http://127.0.0.1:2"})
    # each WAL holds only names placed on it (an ingester hands a stream it holds but does not
    # own to its owner: ingester/moves.py)
    secrets = [p for p in (f"secret/user-{i:05d}" for i in range(4 * HIDDEN)) if placed.owner(p).id == ids[0]][:HIDDEN]
    root = tmp_path_factory.mktemp("routing-listing")
    fills = {ids[0]: on_a + secrets, ids[1]: on_b}
    for name, paths in fills.items():
        h = Harness(root / name / "wal", Clock())
        try:
            h.run(lambda txn, paths=paths, h=h: [h.store.create(txn, CreateRequest(path=p, content_type="text/plain"))
                                            for p in paths])
        finally:
            h.close()
    ports = {i: procs.free_port() for i in ids}
    cluster_file = root / "cluster.json"
    cluster_file.write_bytes(Cluster.of({i: f"http://127.0.0.1:{p}" for i, p in ports.items()}).encode())
    (root / "objects").mkdir()
    store = (root / "objects").as_uri()
    env = {"DS3_TOKENS": json.dumps([{"token": ADMIN, "sub": "admin", "read": ["*"], "write": ["*"]}]),
           "DS3_INTERNAL_TOKEN": INTERNAL}
    access = ["--private", "stream:secret/", "--write-rate", "0"]
    started: list[procs.Proc] = []
    ings = [procs.ingester(root / i, *access, "--store", store, "--ingester-id", i, "--cluster", str(cluster_file),
                           port=ports[i]) for i in ids]
    rdr = procs.reader(root / "reader", ings[0].url, store, *access, "--cluster", str(cluster_file))
    try:
        for p in (*ings, rdr):
            p.env.update(env)
            p.start()
            started.append(p)
        yield Front(rdr, secrets)
    finally:
        for p in reversed(started):
            p.stop()


async def _pages(url: str, headers: dict[str, str] | None = None, **params: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), headers=headers) as s:
        while True:
            async with s.get(url, params=params) as r:
                assert r.status == 200, await r.text()
                page = await r.json()
            out.append(page)
            if not page["has_more"]:
                return out
            assert len(out) < 100
            params["after"] = page["next_cursor"]


async def test_an_anonymous_merged_listing_shows_every_public_stream_and_names_no_private_one(front: Front) -> None:
    pages = await _pages(front.reader.url + "/ds3/streams")
    shown = [s["path"] for page in pages for s in page["streams"]]
    assert shown == NAMES
    assert any(page["next_cursor"] and page["next_cursor"].startswith("~~") for page in pages)  # merged cursors
    assert not any("user-" in json.dumps(page) for page in pages)
    # small pages: the same names, in order
    small = await _pages(front.reader.url + "/ds3/streams", limit="2")
    assert [s["path"] for page in small for s in page["streams"]] == NAMES


async def test_a_caller_who_may_read_them_pages_by_name(front: Front) -> None:
    pages = await _pages(front.reader.url + "/ds3/streams", {"Authorization": f"Bearer {ADMIN}"})
    shown = [s["path"] for page in pages for s in page["streams"]]
    assert len(shown) == HIDDEN + len(NAMES) and shown == sorted(shown, key=lambda n: n.encode())
    for page in pages[:-1]:
        assert page["next_cursor"] == page["streams"][-1]["path"]  # the documented cursor: the last name shown
    after = await _pages(front.reader.url + "/ds3/streams", after=front.secrets[-51])
    assert [s["path"] for page in after for s in page["streams"]] == ["secret0-b", "zz-a", "zz-b"]
