"""Object keys in the store (below the store URL's prefix).

    chunks/<uid[:2]>/<uid>/<chunk id, 16 digits>   one immutable sealed chunk
    streams/<h[:2]>/<h>.json                       a stream's descriptor, h = sha256(path)
    snapshots/<uid[:2]>/<uid>/<offset>.<nonce>     a published snapshot (extensions §2); the
                                                   nonce: a re-publish never overwrites a blob
    _ds3/owner.json                                who owns the store prefix: epoch and lease
                                                   (shared.ownership); written conditionally only
    _ds3/cluster.json                              the cluster description: which ingesters share
                                                   the store (shared.placement, shared.cluster);
                                                   written conditionally only (`ds3 cluster set`)
    _ds3/cluster-retired/<id>.json                 an ingester left out of the description: the
                                                   generation at which it held nothing any more
    _ds3/adoption.json                             the member that adopted the streams of the single
                                                   ingester that ran the prefix before its first
                                                   description (shared.adoption)

Streams are keyed by `uid` (random, 128 bits) rather than by path, so a path deleted and
created again never reaches old objects, and several ingesters can share one bucket. The
two-character prefixes spread keys over S3 partitions.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Final

# "_ds3/" holds the store's own bookkeeping, apart from the streams' objects.
OWNER_KEY: Final = "_ds3/owner.json"
CLUSTER_KEY: Final = "_ds3/cluster.json"
CLUSTER_RETIRED_PREFIX: Final = "_ds3/cluster-retired/"
ADOPTION_KEY: Final = "_ds3/adoption.json"


def chunk_prefix(uid: str) -> str:
    return f"chunks/{uid[:2]}/{uid}/"


def chunk_key(uid: str, chunk: int) -> str:
    return f"{chunk_prefix(uid)}{chunk:016d}"


def descriptor_key(path: str) -> str:
    h = hashlib.sha256(path.encode("utf-8")).hexdigest()
    return f"streams/{h[:2]}/{h}.json"


def snapshot_prefix(uid: str) -> str:
    return f"snapshots/{uid[:2]}/{uid}/"


def snapshot_key(uid: str, offset: str) -> str:
    return f"{snapshot_prefix(uid)}{offset}.{secrets.token_hex(4)}"
