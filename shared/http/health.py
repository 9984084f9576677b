"""/healthz (alive) and /readyz (can serve now, or why not), for both processes.

    /healthz   200 "ok" while the process runs its event loop (tests/procs.py and `ds3 dev`
               wait on it; load balancers restart on it)
    /readyz    200 {"status": "ready", "checks": {...}} or
               503 {"status": "not ready", "reasons": [...], "checks": {...}}
               (plus any fields the app describes itself with: the ingester's "cluster")

Each app registers named checks (async callables returning None when fine, else the
reason). A check's result is kept for CACHE_SECONDS and concurrent probes share one run,
so a busy prober does not turn into object store or ingester traffic; a check that takes
longer than CHECK_TIMEOUT counts as failed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final

import orjson
from aiohttp import web

from shared.errors import DS3Error
from shared.objectstore.base import ObjectStore

CACHE_SECONDS: Final = 2.0
CHECK_TIMEOUT: Final = 2.0
Check = Callable[[], Awaitable[str | None]]


class CachedCheck:
    def __init__(self, check: Check, cache_seconds: float, timeout: float) -> None:
        self.check = check
        self.cache_seconds = cache_seconds
        self.timeout = timeout
        self._result: tuple[float, str | None] | None = None
        self._running: asyncio.Future[str | None] | None = None

    async def __call__(self) -> str | None:
        now = time.monotonic()
        if self._result is not None and now - self._result[0] < self.cache_seconds:
            return self._result[1]
        if self._running is None:
            self._running = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._running)

    async def _run(self) -> str | None:
        try:
            async with asyncio.timeout(self.timeout):
                reason = await self.check()
        except TimeoutError:
            reason = f"no answer within {self.timeout:g} s"
        except Exception as e:  # a check that fails says why; it never fails the probe
            reason = _describe(e)
        self._result = (time.monotonic(), reason)
        self._running = None
        return reason


class Readiness:
    def __init__(self, cache_seconds: float = CACHE_SECONDS, timeout: float = CHECK_TIMEOUT) -> None:
        self.cache_seconds = cache_seconds
        self.timeout = timeout
        self.checks: dict[str, CachedCheck] = {}
        self.fields: dict[str, Callable[[], object]] = {}

    def describe(self, name: str, field: Callable[[], object]) -> None:
        """Add `name` to /readyz's body, its value `field()` (JSON-serialisable) at each probe."""
        self.fields[name] = field

    def add(self, name: str, check: Check, *, cached: bool = True) -> None:
        """`cached=False` for checks that only look at this process's memory."""
        self.checks[name] = CachedCheck(check, self.cache_seconds if cached else 0.0, self.timeout)

    async def evaluate(self) -> dict[str, str | None]:
        names = list(self.checks)
        results = await asyncio.gather(*(self.checks[n]() for n in names))
        return dict(zip(names, results, strict=True))


READINESS: Final = web.AppKey("ds3_readiness", Readiness)


def _describe(e: BaseException) -> str:
    text = e.message if isinstance(e, DS3Error) else str(e)
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__


def store_check(store: Callable[[], ObjectStore | None]) -> Check:
    """The object store answers a one-key listing (cheap on S3 and on a directory; unlike a
    HEAD of a missing key it also fails when the bucket is missing)."""

    async def check() -> str | None:
        objects = store()
        if objects is None:
            return "starting"
        try:
            async for _ in objects.list("streams/", limit=1):
                break
        except Exception as e:
            return f"{objects.url}: {_describe(e)}"
        return None

    return check


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n", headers={"Cache-Control": "no-store"})


async def readyz(request: web.Request) -> web.Response:
    readiness = request.app[READINESS]
    results = await readiness.evaluate()
    reasons = [f"{name}: {why}" for name, why in results.items() if why is not None]
    body = {
        "status": "not ready" if reasons else "ready",
        **({"reasons": reasons} if reasons else {}),
        "checks": {name: why or "ok" for name, why in results.items()},
        **{name: field() for name, field in readiness.fields.items()},
    }
    return web.Response(status=503 if reasons else 200, body=orjson.dumps(body), content_type="application/json",
                        headers={"Cache-Control": "no-store"})
