"""A single ingester's prefix becoming a cluster's: which member adopts its streams.

A prefix run by one ingester (no --ingester-id) keeps that ingester's log at its root and its
streams in that ingester's WAL. The first cluster description written there (`ds3 cluster set`)
gives them to the first member listed: it is written as generation 2 whose previous
description (generation 1) is that member alone, so every other member asked about a stream
placed on it pulls it from the adopter first (ingester/moves.py), as after any change of the
description, and `_ds3/adoption.json` names the adopter:

    {"ingester": "<member id>", "owner_id": "<the single ingester's owner id>", "epoch": <its epoch>}

The adopter is the single ingester itself, restarted on its data dir with that --ingester-id
(its WAL joins the member's namespace: ingester/wal_binding.py), or, its disk lost, a member
started on an empty data dir, which restores the single ingester's WAL from the root's log.
Written while the single ingester runs, the description would leave it serving streams the
members own: refused until it has stopped (its lease released or lapsed)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

import orjson

from shared import keys
from shared.errors import Conflict, ObjectNotFound, ObjectStoreError
from shared.objectstore.base import ObjectStore
from shared.ownership import DEFAULT_MAX_SKEW, read_owner
from shared.placement import Cluster

ADOPTION_KEY: Final = keys.ADOPTION_KEY


@dataclass(frozen=True)
class Adoption:
    ingester: str  # the member that holds the single ingester's streams
    owner_id: str  # the single ingester's owner id (its ownership record at the root)
    epoch: int

    def encode(self) -> bytes:
        return orjson.dumps({"ingester": self.ingester, "owner_id": self.owner_id, "epoch": self.epoch})

    @classmethod
    def decode(cls, data: bytes) -> Adoption:
        try:
            doc = orjson.loads(data)
            return cls(str(doc["ingester"]), str(doc["owner_id"]), int(doc["epoch"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ObjectStoreError(f"{ADOPTION_KEY} is not an adoption record") from None


class SingleOwnerRunning(Conflict):
    """`ds3 cluster set` on a prefix a single ingester still owns."""


async def read_adoption(store: ObjectStore) -> Adoption | None:
    try:
        return Adoption.decode(await store.get(ADOPTION_KEY))
    except ObjectNotFound:
        return None


async def first_description(store: ObjectStore, wanted: Cluster, adopter_id: str,
                            now: float | None = None) -> Cluster:
    """The first description of the prefix of `store` (its root): `wanted`, or, where a single
    ingester owned the prefix, `wanted` at generation 2 after `adopter_id` alone (the member
    listed first), with the adoption recorded (before the description: a member that reads the
    description finds it)."""
    lone = await read_owner(store, keys.OWNER_KEY)
    if lone is None:
        return wanted
    if not lone.lapsed(time.time() if now is None else now, DEFAULT_MAX_SKEW):
        raise SingleOwnerRunning(
            f"a single ingester owns this store prefix now ({lone.owner_id} at {lone.advertise_url or '?'}, "
            f"epoch {lone.epoch}): stop it first, then write the description, then start it on its data dir "
            f"with --ingester-id {adopter_id} (the first ingester listed adopts its streams)")
    adopter = wanted.get(adopter_id)
    assert adopter is not None
    await store.put(ADOPTION_KEY, Adoption(adopter.id, lone.owner_id, lone.epoch).encode(),
                    content_type="application/json")
    return Cluster(2, wanted.ingesters, previous=Cluster.of([(adopter.id, adopter.url)], 1))
