"""ds3's own listings (/ds3/streams, /ds3/buckets) never name what the caller may not see,
not even in `next_cursor` when a page ends after passing over MAX_SKIPPED hidden entries.

The WAL is filled in-process (10,000 creates over HTTP would take most of a minute), then a
real ingester with auth on serves it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from ingester.listing import MAX_SKIPPED
from ingester.writes import CreateRequest
from tests.procs import Proc, ingester
from tests.wal_harness import Clock, Harness

HIDDEN = MAX_SKIPPED + 50
ADMIN = "listing-admin-token-0123456789"
PUBLIC_STREAMS = ["a-public", "secret-but-not-really", "zz-public"]  # around the private ones


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    data = tmp_path_factory.mktemp("listing") / "data"
    h = Harness(data / "wal", Clock())
    try:
        names = PUBLIC_STREAMS + [f"secret/user-{i:05d}-ssn" for i in range(HIDDEN)]
        h.run(lambda txn: [h.store.create(txn, CreateRequest(path=n, content_type="text/plain")) for n in names])
        h.run(lambda txn: [h.store.buckets.create(txn, f"b{i:05d}", h.clock()) for i in range(HIDDEN)])
    finally:
        h.close()
    p = ingester(data, "--private", "stream:secret/", "--private", "bucket:*", "--write-rate", "0")
    p.env["DS3_TOKENS"] = json.dumps([{"token": ADMIN, "sub": "admin", "read": ["*"], "write": ["*"]}])
    p.start()
    yield p
    p.stop()


async def _pages(url: str, headers: dict[str, str] | None = None, **params: str) -> list[dict[str, Any]]:
    """Every page of a listing, following next_cursor."""
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


async def test_an_anonymous_listing_never_names_a_private_stream(server: Proc) -> None:
    """Before: the page that passed over 10,000 private streams ended with next_cursor
    'secret/user-09999-ssn', to a caller without a token."""
    pages = await _pages(server.url + "/ds3/streams")
    shown = [s["path"] for page in pages for s in page["streams"]]
    assert shown == PUBLIC_STREAMS  # every public one, across the hidden stretch
    cursors = [page["next_cursor"] for page in pages if page["next_cursor"] is not None]
    assert len(cursors) >= 1
    leaked = [c for c in cursors if "secret/" in c or "user-" in c]
    assert not leaked, leaked
    # the body of each page, not just its cursor
    assert not any("user-" in json.dumps(page) for page in pages)


async def test_an_anonymous_bucket_listing_never_names_a_private_bucket(server: Proc) -> None:
    pages = await _pages(server.url + "/ds3/buckets")
    assert [b for page in pages for b in page["buckets"]] == []
    assert len(pages) >= 2, "the hidden stretch is longer than one page's budget"
    text = json.dumps(pages)
    assert "b0" not in text.replace('"buckets": []', ""), text[:500]


async def test_a_caller_who_may_read_them_pages_by_name_as_documented(server: Proc) -> None:
    """The documented cursor: the last name shown, usable as `after` (README)."""
    pages = await _pages(server.url + "/ds3/streams", {"Authorization": f"Bearer {ADMIN}"})
    shown = [s["path"] for page in pages for s in page["streams"]]
    assert len(shown) == len(PUBLIC_STREAMS) + HIDDEN and shown == sorted(shown)
    for page in pages[:-1]:
        assert page["next_cursor"] == page["streams"][-1]["path"]
    # a name as `after` (not a cursor the server made) still works, for anyone
    after = await _pages(server.url + "/ds3/streams", after="secret/user-09999-ssn")
    assert [s["path"] for page in after for s in page["streams"]] == ["zz-public"]


async def test_a_made_up_sealed_cursor_is_a_name(server: Proc) -> None:
    """`after` that looks sealed but does not open is taken as a name ('~' sorts after
    letters: nothing follows it)."""
    for bogus in ("~", "~AAAA", "~" + "A" * 80, "~not base64!"):
        pages = await _pages(server.url + "/ds3/streams", after=bogus)
        assert [s["path"] for page in pages for s in page["streams"]] == []
