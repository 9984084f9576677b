"""The internal endpoints of moving streams between ingesters (ingester/moves.py).

    POST /_ds3/move-out   {"key", "generation", "to"}  the old owner freezes the key and answers
                          200 with its export (shared/moveformat.py), 204 when it holds nothing
    POST /_ds3/move-done  {"key", "generation", "to"}  the new owner holds it: drop the frozen copy
    POST /_ds3/move-in    {"key", "generation", "from", "from_url"}  the old owner's sweep: pull the
                          key now (from the previous owner, else from "from", at "from_url" when the
                          description does not know it); 204 once this ingester
                          holds it or nobody had it

Like every /_ds3/ endpoint they take the internal token when one is configured.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ingester.moves import Mover
from ingester.service import SERVICE
from shared import moveformat
from shared.errors import BadRequest, Conflict, Unavailable
from shared.placement import Ingester, PlacementError, validate_id, validate_url


async def _args(request: web.Request, *names: str) -> tuple[Mover, dict[str, Any]]:
    svc = request.app[SERVICE]
    if svc.moves is None:
        raise Unavailable("this ingester is not a cluster member (no --ingester-id): it moves no streams", 60)
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise BadRequest("move: the body must be JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("move: the body must be a JSON object")
    for name in names:
        if name not in body:
            raise BadRequest(f"move: {name} is required")
    if not isinstance(body["key"], str) or not body["key"]:
        raise BadRequest("move: key must be a non-empty string")
    if isinstance(body["generation"], bool) or not isinstance(body["generation"], int):
        raise BadRequest("move: generation must be an integer")
    return svc.moves, body


async def move_out(request: web.Request) -> web.Response:
    mover, body = await _args(request, "key", "generation", "to")
    data = await mover.export(body["key"], body["generation"], str(body["to"]))
    if data is None:
        return web.Response(status=204, headers={"Cache-Control": "no-store"})
    return web.Response(status=200, body=data, content_type=moveformat.CONTENT_TYPE,
                        headers={"Cache-Control": "no-store"})


async def move_done(request: web.Request) -> web.Response:
    mover, body = await _args(request, "key", "generation", "to")
    await mover.drop(body["key"], body["generation"])
    return web.Response(status=204)


async def move_in(request: web.Request) -> web.Response:
    mover, body = await _args(request, "key", "generation", "from")
    key, generation = body["key"], body["generation"]
    await mover.membership.watcher.refresh_if_older(generation)
    mover.membership.check_key(key)  # 421 unless this ingester owns it now
    cluster = mover.membership.cluster
    assert cluster is not None
    holder = cluster.get(str(body["from"])) or (cluster.previous.get(str(body["from"]))
                                                if cluster.previous is not None else None)
    if holder is None:
        # An ingester this description does not know (removed two changes ago, e.g. while it
        # was down): pull from where it says it is. Answering 204 after the usual pull only
        # made it drop streams nobody had taken (they answered 404; found by QA).
        try:
            holder = Ingester(validate_id(str(body["from"])), validate_url(str(body.get("from_url", ""))))
        except PlacementError as e:
            raise Conflict(f"move: ingester {str(body['from'])[:64]!r} is not in the cluster description and "
                           f"gave no usable from_url ({e}): cannot pull {key!r} from it") from None
    await mover.take_from(key, holder)
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/_ds3/move-out", move_out)
    app.router.add_post("/_ds3/move-done", move_done)
    app.router.add_post("/_ds3/move-in", move_in)
