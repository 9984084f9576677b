"""Routing (issue 15): every forwarded request goes to the ingester that owns its stream.

A reader holds the current cluster description (shared.cluster.ClusterWatcher over the store's
`_ds3/cluster.json`, or `--cluster FILE`) and computes a request's owner from its URL alone
(shared.placement: plain streams by their path, bucketed streams and bucket routes by their
bucket). With no description (none in the store and no file), every request goes to the one
`--ingester`, exactly as before clusters existed; a reader started without `--ingester` follows
the ingester that owns the store prefix, as the ownership record names it (shared/owner_watch.py: a
standby that took over is followed without a restart).

Per ingester URL the router keeps a `Link`: an IngesterClient (reader/proxy.py, sharing the
process's one aiohttp ClientSession) and an UpstreamPool (reader/upstream.py, the fast lane's raw
connections; None for an https:// ingester, whose requests then take aiohttp's path). Links are
made on first use and kept (a removed ingester's pool closes its idle connections by itself).
Single-flight keys and live channels are per stream, and a stream has one owner at a time, so
nothing is shared across ingesters by accident.

A 421 Misdirected Request means the ingester judged by another description than ours: the
router re-reads the description when the 421 names a newer generation
(ClusterWatcher.refresh_if_older) and retries once at the new owner. A 421 is a refusal before
anything was read or written, so retrying a POST is as safe as retrying a GET. When the owner
did not change (the ingester is the one behind), the client gets 503 + Retry-After: 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

import aiohttp
from multidict import CIMultiDict

from reader.proxy import DROP_RESPONSE, Headers, IngesterClient, Upstream
from reader.upstream import Answer, UpstreamPool
from shared.cluster import ClusterWatcher
from shared.errors import Unavailable
from shared.logs import request_id
from shared.owner_watch import MemberOwners, OwnerWatcher
from shared.ownership import FENCED_HEADER
from shared.placement import GENERATION_HEADER, OWNER_ID_HEADER, Cluster, bucket_placement_key, placement_key
from shared.tasks import spawn

log = logging.getLogger("ds3.reader.routing")

MISDIRECTED: Final = 421
_CACHE_MAX: Final = 65_536  # owners remembered per description
REREAD_EVERY: Final = 0.25  # seconds: description re-reads after an ingester did not answer, at most
STALL_SECONDS: Final = 1.0  # a request (long-polls aside) unanswered this long: is its ingester still the owner?
STALL_CHECK_EVERY: Final = 0.5


class Link:
    """One ingester as this reader reaches it."""

    __slots__ = ("client", "ingester_id", "pool", "url")

    def __init__(self, url: str, client: IngesterClient, pool: UpstreamPool | None) -> None:
        self.url = url
        self.client = client
        self.pool = pool
        self.ingester_id: str | None = None  # its id in the description, once one named it


class Router:
    def __init__(self, default_url: str | None, make_client: Callable[[str], IngesterClient],
                 make_pool: Callable[[str], UpstreamPool | None], watcher: ClusterWatcher | None = None,
                 internal_headers: dict[str, str] | None = None, owner: OwnerWatcher | None = None,
                 members: MemberOwners | None = None) -> None:
        # sent with every request (reader.proxy.IngesterClient.internal_headers)
        self.internal_headers = internal_headers or {}
        # the same as raw header lines, for requests on the pooled connections (fast lane, polls)
        self.internal_lines = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in self.internal_headers.items())
        self._make_client = make_client
        self._make_pool = make_pool
        self.watcher = watcher
        self.owner = owner  # the ownership record's advertised URL, when there is no description
        self.members = members  # in a cluster: a member's standby that took over (shared/owner_watch.py)
        self.links: dict[str, Link] = {}
        self.default = self.link(default_url) if default_url is not None else None
        self._cached_for: Cluster | None = None
        self._owners: dict[str, Link] = {}
        self.misdirected = 0  # 421s received from ingesters
        self.rerouted = 0  # requests retried at another owner after a 421
        self.collapsed = 0  # answers shared on a live channel (reader.fanout), besides the clients' own
        self._reread_at = 0.0
        self._rereads: set[asyncio.Task[bool]] = set()
        self.abandoned = 0  # requests failed at once because a standby took their ingester's place
        if owner is not None:
            owner.on_change = self._owner_moved
        if members is not None:
            members.on_change = self._member_moved
        self._stall_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Watch for stalled requests (see watch_stalls)."""
        if self._stall_task is None:
            self._stall_task = asyncio.create_task(self.watch_stalls(), name="ds3-reader-stalls")

    def link(self, url: str) -> Link:
        url = url.rstrip("/")
        found = self.links.get(url)
        if found is None:
            found = self.links[url] = Link(url, self._make_client(url), self._make_pool(url))
        return found

    @property
    def cluster(self) -> Cluster | None:
        return None if self.watcher is None else self.watcher.current

    @property
    def generation(self) -> int:
        c = self.cluster
        return 0 if c is None else c.generation

    # --- owners ---------------------------------------------------------------------------

    def for_key(self, key: str) -> Link:
        """The link to the owner of placement key `key`."""
        cluster = self.cluster
        if cluster is None:
            return self.single()
        if cluster is not self._cached_for or len(self._owners) >= _CACHE_MAX:
            self._cached_for, self._owners = cluster, {}
        found = self._owners.get(key)
        if found is None:
            owner = cluster.owner_of_key(key)
            found = self._owners[key] = self.link(owner.url)
            found.ingester_id = owner.id
        if self.members is not None and self.members.active and found.ingester_id is not None:
            return self.member_link(found.ingester_id, found.url)  # (only once a member failed)
        return found

    def member_link(self, ingester_id: str, described: str) -> Link:
        """The link to member `ingester_id`: where its ownership record says it runs, if a
        forward to `described` failed and a standby took it over there."""
        assert self.members is not None
        url = self.members.url(ingester_id, described)
        link = self.link(url)
        link.ingester_id = ingester_id
        return link

    def single(self) -> Link:
        """Without a description: the prefix's owner as the ownership record names it, else
        --ingester."""
        url = self.owner.url if self.owner is not None else None
        if url is not None:
            return self.link(url)
        if self.default is None:
            raise Unavailable(self.no_ingester_yet(), 2)
        return self.default

    def no_ingester_yet(self) -> str:
        """Why there is no ingester to forward to (no --ingester, and none found yet)."""
        if self.owner is not None:
            return ("no ingester owns the store prefix yet (no ownership record"
                    f"{': ' + self.owner.error if self.owner.error else ''}); start one, or give the reader --ingester")
        why = self.watcher.error if self.watcher is not None else None
        return f"no cluster description read yet: {why or 'starting'}"

    def failed(self, link: Link) -> None:
        """A forward to `link` found no ingester there: the owner may have moved (a takeover),
        or the description may have changed (a removed ingester that handed its streams over
        and was stopped before this reader's next --cluster-refresh): look again now, so the
        client's retry goes to the new owner (re-reads at most every 0.25 s)."""
        if self.owner is not None and self.cluster is None:
            self.owner.poke()
        if self.members is not None and link.ingester_id is not None and self.cluster is not None:
            self.members.failed(link.ingester_id)  # a member's standby may have taken over
        watcher = self.watcher
        if watcher is None or watcher.current is None or watcher.refreshing:
            return
        now = time.monotonic()
        if now - self._reread_at >= REREAD_EVERY:
            self._reread_at = now
            spawn(watcher.refresh(), self._rereads, "re-reading the cluster description", logger=log)

    # --- a frozen or cut-off owner, and its standby --------------------------------------------

    async def watch_stalls(self) -> None:
        """A frozen or cut-off ingester fails nothing: requests to it wait for read_timeout (a
        minute). So a request (long-polls aside; on the lane's pool or aiohttp's path) unanswered
        for STALL_SECONDS counts as a failed forward for looking up the owner: the ownership
        record is read again (a member's, in a cluster), and if a standby has taken over, what
        waits at the old URL is failed at once (_abandon) and the clients' retries go to the
        standby."""
        while True:
            await asyncio.sleep(STALL_CHECK_EVERY)
            for link in list(self.links.values()):
                waited = max(link.client.stalled_for(), link.pool.stalled_for() if link.pool is not None else 0.0)
                if waited > STALL_SECONDS:
                    self.failed(link)

    def _owner_moved(self) -> None:
        """The store prefix's ownership record names another URL (followed only without a
        description: in a cluster, members' records say where each runs)."""
        assert self.owner is not None
        if self.cluster is not None:
            return
        new = self.owner.url
        for link in list(self.links.values()):
            if link.url != new and link is not self.default:
                self._abandon(link, new)

    def _member_moved(self, ingester_id: str) -> None:
        """Member `ingester_id`'s record names another URL (its standby's, or its own again)."""
        cluster, members = self.cluster, self.members
        described = cluster.get(ingester_id) if cluster is not None else None
        if described is None or members is None:
            return
        now_at = members.url(ingester_id, described.url).rstrip("/")
        for link in list(self.links.values()):
            if link.ingester_id == ingester_id and link.url != now_at:
                self._abandon(link, now_at)

    def _abandon(self, link: Link, new: str | None) -> None:
        """The ingester at `link` lost its place to `new`: it acknowledges nothing more (it is
        fenced, frozen or gone), so requests waiting there answer 503 now, not after a minute."""
        error = Unavailable(f"the ingester at {link.url} was replaced by the one at {new or '?'} (a standby took "
                            "over); retry", 1)
        n = link.client.abandon(error) + (link.pool.abandon(error) if link.pool is not None else 0)
        if n:
            self.abandoned += n
            log.warning("%d requests waiting at %s answered 503: a standby at %s took its place", n, link.url, new)

    def for_path(self, path: str) -> Link:
        """The owner of the stream with internal path `path` (plain or bucketed)."""
        return self.for_key(placement_key(path))

    def for_bucket(self, bucket_id: str) -> Link:
        return self.for_key(bucket_placement_key(bucket_id))

    def all_links(self) -> list[Link]:
        """Every ingester of the description (or the one --ingester), in id order."""
        cluster = self.cluster
        if cluster is None:
            try:
                return [self.single()]
            except Unavailable:
                return []
        out = []
        for ing in cluster.ingesters:
            if self.members is not None:
                out.append(self.member_link(ing.id, ing.url))
                continue
            link = self.link(ing.url)
            link.ingester_id = ing.id
            out.append(link)
        return out

    async def after_misdirected(self, key: str, was: Link, generation: str | None,
                                owner_id: str | None = None) -> Link | None:
        """After a 421 from `was` for placement key `key` (whose DS3-Cluster-Generation was
        `generation`, and DS3-Owner-Id `owner_id`): the new owner to retry at once, or None (no
        description to re-read, or the owner did not change). Raises Unavailable when the 421
        names as the owner the very member the description says answers at `was`: the ingester
        there is another one (URLs swapped or mistyped in `ds3 cluster set`)."""
        self.misdirected += 1
        if self.watcher is None:
            return None
        # the member said to be at `was` is not there: maybe URLs changed since our last read
        wrong_member = owner_id is not None and owner_id == was.ingester_id
        try:
            gen = int(generation) if generation is not None else self.generation + 1
        except ValueError:
            gen = self.generation + 1
        if wrong_member:
            await self.watcher.refresh()
        else:
            await self.watcher.refresh_if_older(gen)
        try:
            now = self.for_key(key)
        except Unavailable:
            return None
        if now is was:
            if wrong_member:
                raise Unavailable(
                    f"the cluster description names ingester {owner_id} at {was.url}, but the ingester answering "
                    f"there is another member (it says ingester {owner_id} owns this stream): the description's "
                    "URLs are wrong; check them with `ds3 cluster show`", 5)
            return None
        self.rerouted += 1
        return now

    def still_misdirected(self, was: Link) -> Unavailable:
        return Unavailable(f"the ingester at {was.url} does not own this stream under its cluster description "
                           f"and this reader's (generation {self.generation}) names it: the description is "
                           "changing; retry", 1)

    # --- requests with one retry after a 421 -----------------------------------------------

    async def call(self, key: str, method: str, path_qs: str, headers: Headers, body: bytes | None) -> Upstream:
        link = self.for_key(key)
        try:
            up = await link.client.call(method, path_qs, headers, body)
        except Unavailable:
            self.failed(link)
            raise
        if up.status == MISDIRECTED:
            return await self._again(key, link, up, lambda c: c.call(method, path_qs, headers, body))
        self._if_fenced(link, up)
        return up

    async def poll(self, key: str, path_qs: str) -> Upstream:
        """A live channel's upstream long-poll (reader/fanout.py) on the owner's pooled
        connections, when it has them: a channel renews its poll after every answer, so with
        many streams live these polls are most of what a reader sends, and aiohttp's client
        round cost several times the pool's. Else (https://), as call()."""
        link = self.for_key(key)
        pool = link.pool
        if pool is None:
            return await self.call(key, "GET", path_qs, {}, None)
        link.client.requests += 1
        lines = [b"GET ", path_qs.encode("ascii"), b" HTTP/1.1\r\nHost: ", pool.netloc, b"\r\n", self.internal_lines]
        rid = request_id()
        if rid is not None:
            lines += (b"X-Request-Id: ", rid.encode("ascii"), b"\r\n")
        lines.append(b"\r\n")
        answered: asyncio.Future[Answer | Unavailable] = asyncio.get_running_loop().create_future()

        def deliver(answer: Answer | Unavailable) -> None:
            if not answered.done():  # (the channel may have been cancelled meanwhile)
                answered.set_result(answer)

        pool.request(b"".join(lines), False, deliver, patient=True)
        answer = await answered
        if isinstance(answer, Unavailable):
            self.failed(link)
            raise answer
        headers: CIMultiDict[str] = CIMultiDict()
        for line in answer.header_lines():
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() not in DROP_RESPONSE:
                headers.add(name, value.strip())
        up = Upstream(answer.status, headers, answer.body)
        if up.status == MISDIRECTED:
            return await self._again(key, link, up, lambda c: c.call("GET", path_qs, {}, None))
        self._if_fenced(link, up)
        return up

    async def get_collapsed(self, key: str, path_qs: str, headers: Headers) -> Upstream:
        link = self.for_key(key)
        try:
            up = await link.client.get_collapsed(path_qs, headers)
        except Unavailable:
            self.failed(link)
            raise
        if up.status == MISDIRECTED:
            return await self._again(key, link, up, lambda c: c.get_collapsed(path_qs, headers))
        self._if_fenced(link, up)
        return up

    async def collapsed_call(self, key: str, method: str, path_qs: str, headers: Headers, *, flight: str) -> Upstream:
        link = self.for_key(key)
        try:
            up = await link.client.collapsed_call(method, path_qs, headers, key=flight)
        except Unavailable:
            self.failed(link)
            raise
        if up.status == MISDIRECTED:
            return await self._again(key, link, up, lambda c: c.collapsed_call(method, path_qs, headers, key=flight))
        self._if_fenced(link, up)
        return up

    def _if_fenced(self, link: Link, up: Upstream) -> None:
        """An ingester's 503 saying it does not own its store prefix (DS3-Fenced): it is alive,
        so no forward failed, yet the owner is elsewhere (a standby took over while it was
        frozen or cut off): look it up as after a failed forward."""
        if up.status == 503 and FENCED_HEADER in up.headers:
            self.failed(link)

    async def _again(self, key: str, link: Link, up: Upstream,
                     send: Callable[[IngesterClient], Any]) -> Upstream:
        if self.watcher is None:
            return up  # one ingester and no description: its answer as it is (as before routing)
        again = await self.after_misdirected(key, link, up.headers.get(GENERATION_HEADER),
                                             up.headers.get(OWNER_ID_HEADER))
        if again is None:
            raise self.still_misdirected(link)
        retried: Upstream = await send(again.client)
        if retried.status == MISDIRECTED:
            self.misdirected += 1
            raise self.still_misdirected(again)
        return retried

    @contextlib.asynccontextmanager
    async def open(self, key: str, method: str, path_qs: str, headers: Headers) -> AsyncIterator[aiohttp.ClientResponse]:
        """A request whose body the caller streams, at the owner (retried once after a 421)."""
        link = self.for_key(key)
        async with link.client.open(method, path_qs, headers) as up:
            if up.status != MISDIRECTED or self.watcher is None:
                yield up
                return
            generation, owner_id = up.headers.get(GENERATION_HEADER), up.headers.get(OWNER_ID_HEADER)
        again = await self.after_misdirected(key, link, generation, owner_id)
        if again is None:
            raise self.still_misdirected(link)
        async with again.client.open(method, path_qs, headers) as up:
            if up.status == MISDIRECTED:
                self.misdirected += 1
                raise self.still_misdirected(again)
            yield up

    # --- totals for metrics ------------------------------------------------------------------

    @property
    def requests(self) -> int:
        return sum(link.client.requests for link in self.links.values())

    @property
    def collapsed_total(self) -> int:
        return self.collapsed + sum(link.client.collapsed for link in self.links.values())

    async def close(self) -> None:
        if self._stall_task is not None:
            self._stall_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stall_task
        if self.watcher is not None:
            await self.watcher.stop()
        if self.owner is not None:
            await self.owner.stop()
        if self.members is not None:
            await self.members.stop()
        for link in self.links.values():
            if link.pool is not None:
                await link.pool.close()
