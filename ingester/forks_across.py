"""Forks whose source lives on another ingester (issue 15 item 3): the HTTP side.

The fork's owner (B) calls the source's owner (A) (see remote_forks.py for the WAL side):

    POST /_ds3/fork-pin      {"fork": path, "fork_uid", "source": path, "offset", "sub_offset",
                              "content_type", "ttl", "expires_at", "expires_at_text"}
        200: remote_forks.PinnedSource (JSON); 4xx: the refusal a local fork would get
        (421 when A does not own the source: B's description is behind or ahead).
    POST /_ds3/fork-release  {"fork_uid", "source": path}
        204 (idempotent: an unknown pin is released already).

B first records the intent to release the pin (`rel:` in its WAL, with the time), then asks
for it, then creates the fork in a commit that drops the intent. Whatever fails in between (the
answer lost, B killed, the commit refused, the fork existing already), the queued release is
sent once INTENT_GRACE has passed (`Releaser`: a loop on a tick, woken by DELETEs), until A
acknowledges it, so a pin is never leaked. A fork removed for good queues its release at once
and its DELETE waits (briefly) for it, so a source deleted earlier is gone when the client
looks; A's release of a source that was itself a remote fork releases in turn, before
answering. Both calls carry the internal token when one is configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import orjson
from aiohttp import web

from ingester import remote_forks
from ingester.remote_forks import PinnedSource
from ingester.writes import CreateRequest, CreateResult, SubOffsetSealed
from shared.errors import (
    BadRequest,
    Conflict,
    DS3Error,
    Gone,
    NotFound,
    Retained,
    Unavailable,
)
from shared.http.auth import INTERNAL_HEADER
from shared.placement import Ingester, placement_key

if TYPE_CHECKING:
    from ingester.service import IngesterService

log = logging.getLogger("ds3.forks")
RELEASE_TICK: Final = 5.0
CALL_TIMEOUT: Final = aiohttp.ClientTimeout(total=15)


class CrossForks:
    """B's side: create forks of remote sources, release pins; A's side: pin and export."""

    def __init__(self, svc: IngesterService) -> None:
        self.svc = svc
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.created = 0  # forks of sources on other ingesters created here
        self.released = 0  # pins released at their source's owner

    def start(self) -> None:
        self._task = asyncio.create_task(self._release_loop(), name="ds3-fork-releases")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def is_remote(self, source_path: str) -> bool:
        m = self.svc.membership
        return m is not None and not m.owns(source_path) and m.cluster is not None

    def _headers(self) -> dict[str, str]:
        token = self.svc.config.auth.internal_token
        return {INTERNAL_HEADER: token} if token else {}

    def _http(self) -> aiohttp.ClientSession:
        assert self.svc.peers is not None  # (a cluster member has one)
        return self.svc.peers

    def _owner(self, source_path: str) -> Ingester:
        m = self.svc.membership
        assert m is not None
        return m.owner_of_key(placement_key(source_path))

    # --- B: the fork's owner ---------------------------------------------------------------

    async def create(self, req: CreateRequest) -> CreateResult:
        assert req.fork_from is not None
        fork_uid = secrets.token_hex(16)
        body = {
            "fork": req.path, "fork_uid": fork_uid, "source": req.fork_from, "offset": req.fork_offset,
            "sub_offset": req.fork_sub_offset, "content_type": req.content_type, "ttl": req.ttl,
            "expires_at": req.expires_at, "expires_at_text": req.expires_at_text,
        }
        store, source = self.svc.store, req.fork_from
        # The intent first: if anything fails from here on (the answer lost, this process
        # killed, the commit refused), the pin is released after INTENT_GRACE, never leaked.
        await self.svc._submit(lambda txn: remote_forks.queue_release(store, txn, fork_uid, source, time.time()))
        pinned = PinnedSource.decode(await self._call(req.fork_from, "/_ds3/fork-pin", body))
        result = await self.svc._submit(functools.partial(
            store.create, req=dataclasses.replace(req, uid=fork_uid, remote_source=pinned)))
        if not result.created:  # it existed already (an idempotent re-create): this pin is spare
            await self.svc._submit(lambda txn: remote_forks.queue_release(store, txn, fork_uid, source, None))
            self._wake.set()
            return result
        self.created += 1
        await self.svc.published(req.path)
        return result

    async def release_now(self, timeout: float = 5.0) -> None:
        """Send queued releases at once (what is not acknowledged in time stays queued)."""
        try:
            await asyncio.wait_for(self.release_pending(), timeout)
        except Exception:
            log.info("fork pins not released yet (queued)", exc_info=True)
            self._wake.set()

    async def _call(self, source_path: str, endpoint: str, body: dict[str, Any]) -> bytes:
        owner, members = self._owner(source_path), self.svc.members
        assert members is not None  # (a cluster member has them)
        http = self._http()
        url = members.url(owner.id, owner.url).rstrip("/") + endpoint

        async def send(at: str) -> tuple[int, bytes]:
            async with http.post(at.rstrip("/") + endpoint, data=orjson.dumps(body), timeout=CALL_TIMEOUT, headers={
                    **self._headers(), "Content-Type": "application/json"}) as resp:
                return resp.status, await resp.read()

        try:  # (at a standby of it, once it failed or did not answer for a second)
            status, raw = await members.call(owner.id, owner.url, send)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            if isinstance(e, aiohttp.ClientConnectionError | TimeoutError | OSError):
                members.failed(owner.id)
            raise Unavailable(f"the fork source's ingester ({url}) did not answer: {e or type(e).__name__}", 2) from e
        if status in (200, 204):
            return raw
        raise _refusal(status, raw)

    async def _release_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), RELEASE_TICK)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.release_pending()
            except Exception:
                log.warning("releasing fork pins failed; retrying in %.0f s", RELEASE_TICK, exc_info=True)

    async def release_pending(self) -> int:
        """Send every queued release; returns how many were acknowledged."""
        store = self.svc.store
        now = time.time()
        todo = await self.svc._submit(lambda txn: remote_forks.pending_releases(store, txn, now))
        done = 0
        for fork_uid, source in todo:
            try:
                await self._call(source, "/_ds3/fork-release", {"fork_uid": fork_uid, "source": source})
            except NotFound:
                pass  # the source's owner does not know the stream any more: nothing to release
            except DS3Error as e:
                log.info("fork pin %s on %s not released yet: %s", fork_uid, source, e.message)
                continue
            await self.svc._submit(lambda txn, u=fork_uid: remote_forks.released(store, txn, u))  # type: ignore[misc]
            done += 1
        self.released += done
        return done

    # --- A: the source's owner -------------------------------------------------------------

    async def pin(self, body: dict[str, Any]) -> PinnedSource:
        try:
            req = CreateRequest(
                path=str(body["fork"]), content_type=body.get("content_type"), ttl=body.get("ttl"),
                expires_at=body.get("expires_at"), expires_at_text=body.get("expires_at_text"),
                fork_from=str(body["source"]), fork_offset=body.get("offset"), fork_sub_offset=body.get("sub_offset"),
            )
            fork_uid = str(body["fork_uid"])
        except (KeyError, TypeError) as e:
            raise BadRequest(f"fork-pin: malformed request ({e})") from None
        svc, store = self.svc, self.svc.store
        for attempt in range(3):
            if req.fork_sub_offset and req.fork_offset is not None:
                assert req.fork_from is not None
                resolved = await svc._sealed_sub_offset(req.fork_from, req.fork_offset, req.fork_sub_offset)
                if resolved is not None:
                    req = dataclasses.replace(req, fork_sub_position=resolved)
            try:
                scratch = await svc._submit(lambda txn, r=req: remote_forks.pin(store, txn, r, fork_uid))  # type: ignore[misc]
                break
            except SubOffsetSealed:
                if attempt == 2:
                    raise
        assert req.fork_from is not None
        source_path = req.fork_from
        source_uid = await svc._submit(lambda txn: _uid(store, txn, source_path))
        return await svc._submit(lambda txn: remote_forks.export(store, txn, source_path, source_uid, scratch))

    async def release(self, body: dict[str, Any]) -> bool:
        try:
            fork_uid = str(body["fork_uid"])
        except (KeyError, TypeError) as e:
            raise BadRequest(f"fork-release: malformed request ({e})") from None
        store = self.svc.store
        done = bool(await self.svc._submit(lambda txn: remote_forks.release(store, txn, fork_uid)))
        if done:  # the source, removed now, may itself be a fork of another ingester's stream
            await self.release_pending()
        return done


def _uid(store: Any, txn: Any, path: str) -> str:
    meta = store._load(txn, path)
    if meta is None:
        raise NotFound("fork source stream not found")
    return str(meta.uid)


def _refusal(status: int, raw: bytes) -> DS3Error:
    """The source owner's refusal as the error a local fork would have raised."""
    text = raw.decode("utf-8", "replace").strip()
    if status == 410:
        try:
            d = orjson.loads(raw)
            return Retained(str(d["earliest_offset"]), str(d.get("error") or ""))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return Gone(text or "fork source stream was deleted")
    if status == 400:
        return BadRequest(text)
    if status == 404:
        return NotFound(text or "fork source stream not found")
    if status == 409:
        return Conflict(text)
    if status == 421:
        return Unavailable("the fork source's owner changed (cluster description): try again", 1)
    return Unavailable(f"the fork source's ingester answered {status}: {text[:200]}", 2)


# --- A's endpoints ---------------------------------------------------------------------------


def _service(request: web.Request) -> IngesterService:
    from ingester.service import SERVICE  # (service.py imports this module)

    return request.app[SERVICE]


async def _asked(request: web.Request) -> tuple[CrossForks, dict[str, Any]]:
    """The body of an internal fork call, checked: this ingester owns its source (421 if not)."""
    svc = _service(request)
    body = await _json(request)
    if svc.membership is not None:
        svc.membership.check(str(body.get("source", "")))
    if svc.cross_forks is None:
        raise Unavailable("this ingester is not part of a cluster", 5)
    return svc.cross_forks, body


async def fork_pin(request: web.Request) -> web.Response:
    cross, body = await _asked(request)
    pinned = await cross.pin(body)
    return web.Response(body=pinned.encode(), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def fork_release(request: web.Request) -> web.Response:
    cross, body = await _asked(request)
    await cross.release(body)
    return web.Response(status=204)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"{request.path}: the body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{request.path}: the body must be a JSON object")
    return body


def add_routes(app: web.Application) -> None:
    app.router.add_post("/_ds3/fork-pin", fork_pin)
    app.router.add_post("/_ds3/fork-release", fork_release)
