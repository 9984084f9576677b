"""Placement (issue 15): which ingester of a cluster owns a stream. Pure: no aiohttp, no I/O.

A *cluster description* names the ingesters that share one object store, each with a stable
id and the URL readers reach it at, and carries a generation number that grows with every
change (shared.cluster keeps it in the store and watches it):

    {"version": 1, "generation": 3,
     "ingesters": [{"id": "ing-a", "url": "http://10.0.0.1:4437"},
                   {"id": "ing-b", "url": "http://10.0.0.2:4437"}]}

**The rule: rendezvous hashing (highest random weight).** Every ingester scores every
*placement key* with

    score(id, key) = blake2b(key as UTF-8, key=id as UTF-8, digest_size=8) as a big-endian u64

and the key belongs to the ingester with the highest score (ties, which need a 64-bit
collision, go to the larger id). Why rendezvous:
- it needs nothing but the list of ids: no ring, no virtual nodes, no state to agree on, so
  every process that reads the same description computes the same owner;
- adding an ingester moves exactly the keys it now wins, about 1/N of them, and each of those
  moves *to* the new ingester (never between the others); removing one moves only its own keys,
  spread evenly over the rest (tests/test_placement.py measures both);
- ids, not URLs, are hashed: an ingester that changes machine (a new URL) keeps its streams.
blake2b is keyed with the id so a score is one hash of the key; Python's hash() would differ
between processes (PYTHONHASHSEED) and is never used.

**Placement keys.**
- A plain stream (`/v1/stream/{path}`): its path.
- A bucketed stream (`/v1/buckets/{bucket}/{stream}`, internal path `\\x00b/{bucket}/{stream}`)
  and the bucket itself (create, metadata, delete, listing): the bucket's key prefix
  `\\x00b/{bucket}/`. A bucket and all its streams live on one ingester, so what the bucket
  extension promises stays a single writer's transaction exactly as today: a stream create
  checks its bucket exists in the transaction that counts it, a bucket delete is refused (409)
  while the bucket holds a stream, and the listing is one range scan, sorted and paged, correct
  while streams come and go. The price: one bucket's appends scale with one ingester (about
  11,000 appends/s); a deployment spreads by having many buckets (a tenant each).
- A fork: its own path (or its own bucket), never its source's. Every later request for the
  fork (reads, appends, DELETE) carries only the fork's URL, so its owner must follow from the
  URL alone; placing it with its source would also pile whole fork trees onto one ingester.
  A fork whose source lives on another ingester is the cross-ingester case (issue 15, item 3).
Everything about a request's owner is therefore computable from its URL path.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from shared import buckets

FORMAT_VERSION: Final = 1
# A 421 Misdirected Request from an ingester names the stream's owner in these headers.
OWNER_HEADER: Final = "DS3-Owner"  # the owner's URL
OWNER_ID_HEADER: Final = "DS3-Owner-Id"
GENERATION_HEADER: Final = "DS3-Cluster-Generation"  # of the description the ingester judged by
MAX_ID_LENGTH: Final = 64  # blake2b keys are at most 64 bytes; ids are ASCII
MAX_INGESTERS: Final = 1024
_ID_RE: Final = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


class PlacementError(ValueError):
    """A cluster description is invalid; the message says what and where."""


@dataclass(frozen=True, slots=True)
class Ingester:
    id: str  # stable: what placement hashes (letters, digits, '.', '_', '-'; at most 64)
    url: str  # http(s)://host[:port], where readers reach it (no trailing slash)

    def describe(self) -> str:
        return f"{self.id} ({self.url})"


def validate_id(ingester_id: str) -> str:
    if not isinstance(ingester_id, str) or not _ID_RE.match(ingester_id):
        raise PlacementError(
            f"ingester id {str(ingester_id)[:80]!r} is invalid: 1 to {MAX_ID_LENGTH} letters, digits, '.', '_' "
            "or '-', starting with a letter or digit"
        )
    return ingester_id


def validate_url(url: str, ingester_id: str = "?") -> str:
    """An ingester's base URL, normalised (no trailing slash): http(s)://host[:port] only."""
    where = f"ingester {ingester_id}: url {str(url)[:200]!r}"
    if not isinstance(url, str) or not url:
        raise PlacementError(f"{where} is empty")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a bad port
    except ValueError as e:
        raise PlacementError(f"{where} is not a URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise PlacementError(f"{where} must start with http:// or https://")
    if not parts.hostname:
        raise PlacementError(f"{where} has no host")
    if parts.username is not None or parts.password is not None:
        raise PlacementError(f"{where} must not carry credentials")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in url or "#" in url:
        raise PlacementError(f"{where} must be a base URL: http(s)://host[:port], no path, query or fragment")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise PlacementError(f"{where} contains white space or control characters")
    if port == 0:
        raise PlacementError(f"{where} has port 0")
    return url.rstrip("/")


def placement_key(path: str) -> str:
    """The key a stream's internal path is placed by: the path itself for a plain stream (a
    fork included); the bucket's key prefix for a bucketed one (see the module's docstring)."""
    parts = buckets.split_internal(path)
    if parts is None:
        return path
    return buckets.bucket_key_prefix(parts[0])


def bucket_placement_key(bucket_id: str) -> str:
    """The key of a bucket (and so of every stream in it)."""
    return buckets.bucket_key_prefix(bucket_id)


def score(ingester_id: str, key: str) -> int:
    """The rendezvous weight of `key` on an ingester: a keyed blake2b-64 of the key."""
    h = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), key=ingester_id.encode("ascii"), digest_size=8)
    return int.from_bytes(h.digest(), "big")


@dataclass(frozen=True, slots=True)
class Cluster:
    """A validated cluster description. `ingesters` is sorted by id (the canonical order;
    placement does not depend on it)."""

    generation: int
    ingesters: tuple[Ingester, ...]
    _by_id: Mapping[str, Ingester] = field(init=False, repr=False, compare=False)
    # One blake2b state per ingester, keyed with its id: a score is a copy and one update.
    _hashers: list[tuple[Any, Ingester]] = field(init=False, repr=False, compare=False)
    # The description this one replaced (generation - 1, without a previous of its own): an
    # ingester that owns a stream now asks that description's owner for it (ingester/moves.py).
    previous: Cluster | None = None

    def __post_init__(self) -> None:
        if isinstance(self.generation, bool) or not isinstance(self.generation, int) or self.generation < 1:
            raise PlacementError(f"generation {self.generation!r} is invalid: an integer of at least 1")
        if not self.ingesters:
            raise PlacementError("the cluster has no ingesters: name at least one")
        if len(self.ingesters) > MAX_INGESTERS:
            raise PlacementError(f"the cluster names {len(self.ingesters)} ingesters; at most {MAX_INGESTERS}")
        ids: set[str] = set()
        urls: dict[str, str] = {}
        for ing in self.ingesters:
            validate_id(ing.id)
            if validate_url(ing.url, ing.id) != ing.url:
                raise PlacementError(f"ingester {ing.id}: url {ing.url!r} must not end with '/'")
            if ing.id in ids:
                raise PlacementError(f"ingester id {ing.id!r} appears more than once")
            ids.add(ing.id)
            if ing.url in urls:
                raise PlacementError(f"ingesters {urls[ing.url]!r} and {ing.id!r} have the same url {ing.url!r}")
            urls[ing.url] = ing.id
        prev = self.previous
        if prev is not None and (prev.generation != self.generation - 1 or prev.previous is not None):
            raise PlacementError(f"previous: generation {prev.generation} must be {self.generation - 1}, "
                                 "without a previous of its own")
        ordered = tuple(sorted(self.ingesters, key=lambda i: i.id))
        object.__setattr__(self, "ingesters", ordered)
        object.__setattr__(self, "_by_id", {i.id: i for i in ordered})
        object.__setattr__(self, "_hashers", [(hashlib.blake2b(key=i.id.encode("ascii"), digest_size=8), i)
                                              for i in ordered])

    @classmethod
    def of(cls, ingesters: Iterable[tuple[str, str]] | Mapping[str, str], generation: int = 1,
           previous: Cluster | None = None) -> Cluster:
        """From (id, url) pairs or {id: url}; URLs are normalised (a trailing slash dropped)."""
        pairs = list(ingesters.items()) if isinstance(ingesters, Mapping) else list(ingesters)
        return cls(generation, tuple(Ingester(validate_id(i), validate_url(u, i)) for i, u in pairs),
                   previous=previous)

    def alone(self) -> Cluster:
        """This description without its previous one (what a successor carries)."""
        return self if self.previous is None else Cluster(self.generation, self.ingesters)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(i.id for i in self.ingesters)

    def get(self, ingester_id: str) -> Ingester | None:
        return self._by_id.get(ingester_id)

    def owner_of_key(self, key: str) -> Ingester:
        """The ingester with the highest score for `key` (ties: the larger id)."""
        data = key.encode("utf-8", "surrogatepass")
        best: Ingester | None = None
        best_score = -1
        for hasher, ing in self._hashers:
            h = hasher.copy()
            h.update(data)
            s = int.from_bytes(h.digest(), "big")
            if s > best_score or (s == best_score and best is not None and ing.id > best.id):
                best, best_score = ing, s
        assert best is not None
        return best

    def owner(self, path: str) -> Ingester:
        """The ingester that owns the stream with this internal path (plain or bucketed)."""
        return self.owner_of_key(placement_key(path))

    def bucket_owner(self, bucket_id: str) -> Ingester:
        """The ingester that owns a bucket and every stream in it."""
        return self.owner_of_key(bucket_placement_key(bucket_id))

    def with_ingesters(self, ingesters: Iterable[tuple[str, str]] | Mapping[str, str]) -> Cluster:
        """The next description: these ingesters, generation + 1, carrying this one as its previous."""
        return Cluster.of(ingesters, self.generation + 1, previous=self.alone())

    # --- the stored form ------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"version": FORMAT_VERSION, "generation": self.generation,
                             "ingesters": [{"id": i.id, "url": i.url} for i in self.ingesters]}
        if self.previous is not None:
            d["previous"] = {"generation": self.previous.generation,
                             "ingesters": [{"id": i.id, "url": i.url} for i in self.previous.ingesters]}
        return d

    @classmethod
    def from_json(cls, d: Any) -> Cluster:
        """From the stored form; PlacementError says what is wrong."""
        if not isinstance(d, dict):
            raise PlacementError("a cluster description is a JSON object")
        version = d.get("version", FORMAT_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PlacementError(f"version {version!r} is invalid")
        if version > FORMAT_VERSION:
            raise PlacementError(f"format version {version} is newer than this server's {FORMAT_VERSION}")
        unknown = set(d) - {"version", "generation", "ingesters", "previous"}
        if unknown:
            raise PlacementError(f"unknown fields {sorted(unknown)}: expected version, generation, ingesters, "
                                 "previous")
        if "generation" not in d:
            raise PlacementError("generation is missing")
        previous = None
        if d.get("previous") is not None:
            p = d["previous"]
            if not isinstance(p, dict) or set(p) != {"generation", "ingesters"}:
                raise PlacementError("previous must be an object with exactly generation and ingesters")
            try:
                previous = cls.from_json({"generation": p["generation"], "ingesters": p["ingesters"]})
            except PlacementError as e:
                raise PlacementError(f"previous: {e}") from None
        return cls.of(cls._pairs(d.get("ingesters")), d["generation"], previous=previous)

    @staticmethod
    def _pairs(raw: Any) -> list[tuple[str, str]]:
        if not isinstance(raw, list):
            raise PlacementError("ingesters must be a list of {\"id\": ..., \"url\": ...}")
        pairs: list[tuple[str, str]] = []
        for n, item in enumerate(raw):
            if not isinstance(item, dict) or set(item) != {"id", "url"}:
                raise PlacementError(f"ingesters[{n}] must be an object with exactly id and url")
            if not isinstance(item["id"], str) or not isinstance(item["url"], str):
                raise PlacementError(f"ingesters[{n}]: id and url must be strings")
            pairs.append((item["id"], item["url"]))
        return pairs

    def encode(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2) + "\n").encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> Cluster:
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlacementError(f"not JSON: {e}") from None
        return cls.from_json(d)


def parse_ingester_spec(spec: str) -> tuple[str, str]:
    """`id=url` (the CLI's --ingester) into a validated pair."""
    ingester_id, eq, url = spec.partition("=")
    if not eq:
        raise PlacementError(f"--ingester {spec[:100]!r}: write it as id=url, e.g. ing-a=http://10.0.0.1:4437")
    return validate_id(ingester_id.strip()), validate_url(url.strip(), ingester_id.strip())
