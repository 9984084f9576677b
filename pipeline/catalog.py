"""What is sealed: streams, their descriptors, and the chunk objects that hold their history.

The driver plans reads with it, straight from the object store (never through the
ingester): a stream's descriptor names its uid (`chunks/<uid>/` holds its chunk objects) and,
for a fork, the source it inherits from. A `StreamPlan` is the stream's sealed history as an
ordered list of chunk references, position 0 first, with no gap:

- a fork's history below its fork position lives in its source's chunks (keyed by the
  source's uid, kept alive by the source's refcount), recursively; those references carry a
  `cap` (the fork position), past which the source's bytes are not the fork's;
- chunks are uploaded concurrently, so chunk c + 1 may be visible before chunk c: the plan
  stops at the first missing chunk (or position gap); everything after it is "not sealed yet".

Offsets are spelled as the server spells them (shared/offsets.py): the offset of position p
names the chunk holding byte p - 1, so a chunk's first message starts at an offset naming the
*previous* chunk of the plan (a source's chunk for a fork's first own chunk), and position 0
names the first chunk of the stream at the root of the fork chain.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pipeline.store import LocalSyncStore, S3SyncStore, SyncStore
from shared import buckets, chunks, keys, offsets
from shared.descriptor import Descriptor
from shared.errors import ObjectNotFound

HEADER_FETCH = 4096  # prelude + header JSON (about 250 bytes) in one small ranged GET
HEADER_CACHE_SIZE = 100_000  # chunk headers kept per process (about 400 bytes each)


class _Shared:
    """What every Catalog of this process shares: chunk headers already read, per store (a
    sealed chunk object never changes: its key holds the stream's uid, and a re-seal after a
    crash writes the same bytes), so a driver that plans the same streams again (each query,
    each streaming trigger) asks the store only for new chunks; and one pool of threads for
    the parallel reads (starting 16 threads per plan cost 60 ms)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.headers: OrderedDict[tuple[str, str], tuple[chunks.ChunkHeader, int]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        with self.lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(16, thread_name_prefix="ds3-catalog")
            return self._pool

    def get(self, key: tuple[str, str]) -> tuple[chunks.ChunkHeader, int] | None:
        with self.lock:
            hit = self.headers.get(key)
            if hit is not None:
                self.headers.move_to_end(key)
            return hit

    def put(self, key: tuple[str, str], found: tuple[chunks.ChunkHeader, int]) -> None:
        with self.lock:
            self.headers[key] = found
            while len(self.headers) > HEADER_CACHE_SIZE:
                self.headers.popitem(last=False)


_SHARED = _Shared()


def _store_identity(store: SyncStore) -> str | None:
    """What names a store's objects uniquely in this process, for the shared header cache; None
    for a store type it does not know (each Catalog then caches on its own)."""
    if isinstance(store, LocalSyncStore):
        return str(store.root.resolve())
    if isinstance(store, S3SyncStore):
        return f"{store._settings()[0] or ''} {store.bucket} {store.prefix}"
    return None


MAX_FORK_DEPTH = 64


class StreamNotFound(LookupError):
    """No descriptor for the stream in the store (never created there, or deleted)."""


class HistoryUnavailable(LookupError):
    """A fork's source history is gone (its source was replaced) and cannot be read."""


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk object's part of a stream's history: positions [start, end)."""

    uid: str  # the stream whose chunk it is (an ancestor's, for a fork's inherited history)
    chunk: int
    start: int
    end: int  # already capped at the fork position for inherited chunks
    prev_chunk: int  # the chunk id the offset of `start` names
    object_size: int
    sealed_at: float

    @property
    def key(self) -> str:
        return keys.chunk_key(self.uid, self.chunk)

    @property
    def start_offset(self) -> str:
        return offsets.encode(self.prev_chunk, self.start)

    @property
    def end_offset(self) -> str:
        return offsets.encode(self.chunk, self.end)


@dataclass(frozen=True, slots=True)
class StreamPlan:
    path: str  # internal path ("\x00b/<bucket>/<id>" for bucketed streams)
    uid: str
    content_type: str
    zero_chunk: int  # the chunk id that offset position 0 names
    chunks: tuple[ChunkRef, ...]  # sealed history, contiguous from position 0 (or `earliest`)
    earliest: int = 0  # the earliest retained position (a snapshot's; extensions §2)
    earliest_offset: str | None = None  # its spelling
    # A fork whose inherited history is not all sealed: (lo, hi, chunk) for each ancestor's
    # unsealed part past the sealed end, positions lo..hi, the chunk holding its bytes (its
    # last sealed chunk's successor: ids run on by one). A tail page spans such a part and the
    # fork's own bytes, and the server spells offsets there with the ancestor's chunk (found
    # by QA: spelled with the fork's, they were refused, 400).
    inherited_tail: tuple[tuple[int, int, int], ...] = ()

    @property
    def sealed_end(self) -> int:
        return self.chunks[-1].end if self.chunks else self.earliest

    @property
    def sealed_end_offset(self) -> str:
        if self.chunks:
            return self.chunks[-1].end_offset
        return self.earliest_offset or offsets.encode(self.zero_chunk, 0)

    @property
    def url_path(self) -> str:
        return buckets.url_path(self.path)

    def offset_of(self, position: int) -> str | None:
        """The server's spelling of a chunk-boundary position of the plan (None otherwise)."""
        if position == 0:
            return offsets.encode(self.zero_chunk, 0)
        for ref in self.chunks:
            if ref.end == position:
                return ref.end_offset
        return None


def display_name(path: str) -> tuple[str | None, str]:
    """(bucket id or None, stream name) of an internal path: what rows call a stream."""
    parts = buckets.split_internal(path)
    return (None, path) if parts is None else parts


class Catalog:
    """Descriptor and chunk-header reads against one store, with a cache of chunk headers
    (chunks are immutable): the process's shared one for the stores it knows, else its own.
    Thread-safe; one per driver-side reader."""

    def __init__(self, store: SyncStore) -> None:
        self.store = store
        self._headers: dict[str, tuple[chunks.ChunkHeader, int]] = {}
        self._lock = threading.Lock()
        self._store_id = _store_identity(store)

    def __getstate__(self) -> dict[str, Any]:
        # Spark pickles readers to ship them to executors: settings travel, the cache does not
        return {"store": self.store}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["store"])  # type: ignore[misc]

    # ------------------------------------------------------------ descriptors
    def descriptor(self, path: str) -> Descriptor | None:
        try:
            desc = Descriptor.decode(self.store.get(keys.descriptor_key(path)))
        except ObjectNotFound:
            return None
        return desc if desc.path == path else None  # a sha256 collision would be news

    def descriptors_under(self, path_prefix: str, deleted: bool = False) -> list[Descriptor]:
        """Live streams whose internal path starts with `path_prefix` (descriptors are keyed
        by a hash of the path, so this reads every descriptor in the store); `deleted`: the
        soft-deleted ones too."""
        listed = [o.key for o in self.store.list("streams/") if o.key.endswith(".json")]
        found = list(_SHARED.pool().map(self._descriptor_at, listed))
        out = [d for d in found
               if d is not None and d.path.startswith(path_prefix) and (deleted or not d.soft_deleted)]
        if not path_prefix.startswith(buckets.INTERNAL_PREFIX):  # plain prefixes never match buckets
            out = [d for d in out if buckets.split_internal(d.path) is None]
        return sorted(out, key=lambda d: d.path)

    def _descriptor_at(self, key: str) -> Descriptor | None:
        try:
            return Descriptor.decode(self.store.get(key))
        except (ObjectNotFound, ValueError, TypeError):
            return None  # deleted while listing, or not a descriptor

    # ------------------------------------------------------------ chunk headers
    def header(self, uid: str, chunk: int) -> tuple[chunks.ChunkHeader, int]:
        """(header, object size) of a chunk object; ObjectNotFound when it is not there."""
        key = keys.chunk_key(uid, chunk)
        shared = None if self._store_id is None else (self._store_id, key)
        if shared is not None:
            hit = _SHARED.get(shared)
        else:
            with self._lock:
                hit = self._headers.get(key)
        if hit is not None:
            return hit
        first = self.store.get(key, 0, HEADER_FETCH)
        prelude = chunks.parse_prelude(first)
        end = chunks.PRELUDE_SIZE + prelude.header_length
        if len(first) < end:
            first = self.store.get(key, 0, end)
        found = (chunks.ChunkHeader.from_json(first[chunks.PRELUDE_SIZE:end]), prelude.object_size)
        if shared is not None:
            _SHARED.put(shared, found)
        else:
            with self._lock:
                self._headers[key] = found
        return found

    def chunk_ids(self, uid: str, first: int) -> list[int]:
        """Listed chunk ids of `uid` from `first` on, while they run without a gap."""
        ids: list[int] = []
        start_after = keys.chunk_key(uid, first - 1) if first > 0 else None
        for o in self.store.list(keys.chunk_prefix(uid), start_after):
            name = o.key.rsplit("/", 1)[1]
            if not name.isdigit():
                continue
            c = int(name)
            if c != first + len(ids):
                break
            ids.append(c)
        return ids

    # ------------------------------------------------------------ plans
    def plan(self, desc: Descriptor, start: offsets.Offset | None = None) -> StreamPlan:
        """The stream's sealed history. `start`: the caller reads nothing before this offset
        (one the stream issued): the plan may then begin at the chunk holding it, so that only
        the chunks from there on are listed and have their headers read (a read of the last
        hour of a long history is a few requests, not one per chunk). The whole history
        whenever the offset is not known to be this stream's (a fork's, or no sealed chunk of
        this stream holds it)."""
        snapshot = getattr(desc, "snapshot_offset", None)  # retention (extensions §2)
        if (start is not None and start.position > 0 and desc.fork_source is None
                and (not snapshot or start.position > offsets.parse(snapshot).position)):
            later = self._plan_from(desc, start)
            if later is not None:
                return later
        if snapshot:
            earliest = offsets.parse(snapshot)
            if desc.fork_source is None or earliest.position >= desc.fork_position:
                return self._retained_plan(desc, earliest)
        plan = self._full_plan(desc)
        if snapshot:  # a fork whose snapshot lies in inherited history: those chunks stay
            plan = StreamPlan(plan.path, plan.uid, plan.content_type, plan.zero_chunk, plan.chunks,
                              offsets.parse(snapshot).position, snapshot)
        return plan

    def _plan_from(self, desc: Descriptor, start: offsets.Offset) -> StreamPlan | None:
        """The plan from `start` on (the same walk as from a snapshot's offset), or None when
        `start` is not known to be one of this stream's: no chunk from its chunk on holds it,
        and it is not where the stream's sealed history ends either."""
        later = self._retained_plan(desc, start)
        if later.chunks:
            return later
        found = self._maybe_header(desc.uid, start.chunk)  # nothing sealed after it yet?
        if found is not None and found[0].chunk == start.chunk and found[0].end == start.position:
            return later  # no chunk, its sealed end at `start`
        return None

    def _retained_plan(self, desc: Descriptor, earliest: offsets.Offset) -> StreamPlan:
        """A stream with a snapshot: chunks wholly before it may be deleted already, so the
        plan starts at the chunk holding the earliest retained position (offset c_p: byte p
        is in chunk c, or in c + 1 when c ends at p). Also a plan from a start offset (plan):
        `earliest` is then where the caller's read begins."""
        refs: list[ChunkRef] = []
        ids = self.chunk_ids(desc.uid, earliest.chunk) or self.chunk_ids(desc.uid, earliest.chunk + 1)
        position = earliest.position
        for c in ids:
            found = self._maybe_header(desc.uid, c)
            if found is None:
                break
            h, size = found
            if h.end <= earliest.position and not refs:
                continue
            contiguous = h.start == position if refs else h.start <= position < h.end
            if not contiguous:
                break
            prev = earliest.chunk if h.start == earliest.position else c - 1
            refs.append(ChunkRef(desc.uid, c, h.start, h.end, refs[-1].chunk if refs else prev, size,
                                 h.created_at))
            position = h.end
        zero = desc.first_chunk
        return StreamPlan(desc.path, desc.uid, desc.content_type, zero, tuple(refs), earliest.position,
                          str(earliest))

    def _full_plan(self, desc: Descriptor) -> StreamPlan:
        chain = [desc]
        while chain[-1].fork_source is not None:
            child = chain[-1]
            assert child.fork_source is not None
            if len(chain) > MAX_FORK_DEPTH:
                raise HistoryUnavailable(f"fork chain of {desc.path!r} is deeper than {MAX_FORK_DEPTH}")
            source = self.descriptor(child.fork_source)
            if source is None or source.uid != child.fork_source_uid:
                raise HistoryUnavailable(
                    f"stream {desc.path!r} forks {child.fork_source!r}, whose history is no longer in the store"
                )
            chain.append(source)
        root = chain[-1]
        refs: list[ChunkRef] = []
        position = 0
        # From the root down: each level contributes its own chunks from its own start up to
        # the fork position of the level below it (the smallest one, for nested forks).
        for i in range(len(chain) - 1, -1, -1):
            level = chain[i]
            cap = min((d.fork_position for d in chain[:i]), default=None)
            own_start = level.fork_position if level.fork_source is not None else 0
            if position != own_start or (cap is not None and cap <= own_start):
                continue
            position = self._level(level, cap, position, refs, root.first_chunk)
            if cap is not None and position < cap:
                break  # the inherited history is not all sealed yet: the plan ends here
        inherited: list[tuple[int, int, int]] = []
        for i in range(len(chain) - 1, 0, -1):  # the ancestors' unsealed parts, root first
            level = chain[i]
            cap = min(d.fork_position for d in chain[:i])
            lo = max(level.fork_position if level.fork_source is not None else 0, position)
            if lo < cap:
                mine = [r.chunk for r in refs if r.uid == level.uid]
                inherited.append((lo, cap, mine[-1] + 1 if mine else level.first_chunk))
        return StreamPlan(desc.path, desc.uid, desc.content_type, root.first_chunk, tuple(refs),
                          inherited_tail=tuple(inherited))

    def _level(self, level: Descriptor, cap: int | None, position: int, refs: list[ChunkRef],
               zero_chunk: int) -> int:
        ids = self.chunk_ids(level.uid, level.first_chunk)
        heads = list(_SHARED.pool().map(lambda c: self._maybe_header(level.uid, c), ids))
        for c, found in zip(ids, heads, strict=True):
            if found is None:
                break
            h, size = found
            if h.start != position or h.chunk != c:
                break
            end = h.end if cap is None else min(h.end, cap)
            prev = refs[-1].chunk if refs else zero_chunk
            refs.append(ChunkRef(level.uid, c, h.start, end, prev, size, h.created_at))
            position = end
            if cap is not None and position >= cap:
                break
        return position

    def _maybe_header(self, uid: str, chunk: int) -> tuple[chunks.ChunkHeader, int] | None:
        try:
            return self.header(uid, chunk)
        except ObjectNotFound:
            return None

    def plans(self, descs: Iterable[Descriptor],
              starts: Mapping[str, offsets.Offset | None] | None = None) -> list[StreamPlan]:
        """Plans of `descs`; `starts`: a start offset (see plan) by URL path."""
        return [self.plan(d, (starts or {}).get(buckets.url_path(d.path))) for d in descs]


def resolve(catalog: Catalog, paths: Sequence[str] | None, path_prefix: str | None) -> list[Descriptor]:
    """The descriptors of the named streams (StreamNotFound when one is missing or deleted),
    or of every live stream under the internal path prefix."""
    if paths is not None:
        out = []
        for p in paths:
            d = catalog.descriptor(p)
            if d is None or d.soft_deleted:
                bucket, name = display_name(p)
                where = f"bucket {bucket!r} stream {name!r}" if bucket else f"stream {name!r}"
                raise StreamNotFound(f"{where} not found in store {catalog.store.url}")
            out.append(d)
        return out
    assert path_prefix is not None
    return catalog.descriptors_under(path_prefix)


def check_bucket(catalog: Catalog, paths: Sequence[str] | None, path_prefix: str | None) -> None:
    """A read of a whole bucket that found no stream: StreamNotFound unless the store knows the
    bucket (some stream of it, deleted ones included). The store holds no record of a bucket
    itself, so a bucket that has no stream yet is refused too (a misspelt bucket read as empty:
    found by QA)."""
    parts = buckets.split_internal(path_prefix or "")
    if paths is not None or parts is None:
        return
    bucket = parts[0]
    if not catalog.descriptors_under(buckets.bucket_key_prefix(bucket), deleted=True):
        raise StreamNotFound(f"bucket {bucket!r} not found in store {catalog.store.url}: no stream of it is "
                             f"there (a bucket with no stream yet has nothing to read either)")
