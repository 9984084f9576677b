"""Whether an ingester may start on a store prefix as it is configured: alone, or as a member.

Found by QA: an ingester started without --ingester-id on a cluster's prefix (the README's
single-ingester command beside the cluster's) owned every stream there: it created a stream the
cluster already had, its descriptor (one key per path, shared by the prefix) replaced the
member's, and readers served its bytes for that path; its DELETE removed the member's
descriptor. So a lone ingester refuses a prefix that holds a cluster description or any
member's namespace.

The other way round is how a single ingester grows into a cluster: its streams are in its WAL,
and its log at the prefix's root. Once a description names some members, that ingester is
started on its own data dir with the --ingester-id of one of them: its WAL, bound to the
prefix's root (ingester/wal_binding.py), may become that member's (its namespace empty: the
shipper checkpoints the WAL there first), and the sweep (ingester/moves.py) hands every stream
placed elsewhere to its owner. A member's namespace that already has a log is its own; the
root's log then stays as it was (a record of the lone ingester's history, not read again)."""

from __future__ import annotations

from typing import Final

from ingester.logstore import StartRefused
from shared import keys
from shared.adoption import read_adoption
from shared.errors import ObjectNotFound
from shared.objectstore import ObjectStore
from shared.objectstore.scoped import INGESTERS_PREFIX

MEMBER_ONLY: Final = (
    "not starting: the store prefix {store} is shared by a cluster of ingesters ({what}): an ingester "
    "without --ingester-id owns every stream of the prefix and would write over the members' streams. "
    "Start it with the --ingester-id (DS3_INGESTER_ID) of a member (`ds3 cluster show`), or use another --store prefix")


async def cluster_sign(objects: ObjectStore) -> str | None:
    """What says that the prefix of `objects` (its root) is a cluster's, or None."""
    try:
        await objects.head(keys.CLUSTER_KEY)
        return f"its {keys.CLUSTER_KEY} describes the members"
    except ObjectNotFound:
        pass
    async for info in objects.list(INGESTERS_PREFIX, limit=1):
        member = info.key.removeprefix(INGESTERS_PREFIX).split("/", 1)[0]
        return f"member {member!r} keeps its log under {INGESTERS_PREFIX}{member}/"
    return None


async def adopts(objects: ObjectStore, ingester_id: str) -> bool:
    """Whether member `ingester_id` adopts the streams of the single ingester that owned the
    prefix of `objects` before the cluster (shared/adoption.py)."""
    adoption = await read_adoption(objects)
    return adoption is not None and adoption.ingester == ingester_id


async def check_lone(objects: ObjectStore, store_url: str) -> None:
    """StartRefused if an ingester without --ingester-id may not own the prefix."""
    sign = await cluster_sign(objects)
    if sign is not None:
        raise StartRefused(MEMBER_ONLY.format(store=store_url, what=sign))
