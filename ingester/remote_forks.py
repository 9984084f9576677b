"""Forks whose source lives on another ingester (issue 15 item 3): the WAL side.

A fork reads positions below its fork position from its source. When both live on one
ingester, that is a walk of the source's records and chunk manifest (chain.py). Across
ingesters the fork's owner (B) holds neither, so a fork is created in three steps:

1. B asks the source's owner (A) to *pin* the source for the fork (`pin`): A validates the
   fork exactly as for a local fork (offset, sub-offset, boundary, content type, retention)
   and counts the fork in the source's refcount (so a DELETE of the source soft-deletes it,
   410, and retention keeps its chunks, as for a local fork) under a pin named by the fork's
   uid (idempotent: a retried pin counts once).
2. A *exports* the chain below the fork position (`export`): per level (the source, its
   source...) its uid, first chunk, fork position, the manifest entries of its sealed chunks
   and its unsealed records (those never change either: sealing only moves them to the store).
3. B *installs* it (`install`): one read-only shadow stream per level, keyed `\\x00f/<uid>`
   (never a client path: plain paths never start with a control character and buckets use
   `\\x00b/`), holding the manifest entries and the records, and creates the fork on top of
   it, its `fork_source` the real source path (descriptors, HEADs and idempotent re-creates
   see that) and `fork_source_key` the shadow. chain.py then reads the fork exactly like a
   local one: one response runs from inherited records into the fork's own, and sealed
   inherited positions come out as `Sealed` markers naming the source's chunk objects.
   A shadow never takes appends and its open chunk starts at its tail, so nothing of it is
   ever rolled or uploaded (its records are named by the source's chunk ids: uploading them
   would collide with the source's own objects).

A shadow's refcount counts the local forks and shadows above it; at zero it is dropped (its
manifest only: the objects belong to the source's owner, nothing is garbage-collected). A
fork removed for good queues a *release* of its pin (`sys` key `rel:<fork uid>`), sent to the
source's owner until it is acknowledged (forks_across.py); the owner then uncounts the fork
and removes a soft-deleted source whose last reader it was.

Writer-thread functions over a Store; no I/O beyond the transaction.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import lmdb
import orjson

from ingester.chain import chunk_at, stream_records
from ingester.records import SEALED, SID, ChunkInfo, Record, StreamMeta, chunk_key, encode_record, record_key
from shared.errors import Conflict, NotFound

if TYPE_CHECKING:
    from ingester.store import Store
    from ingester.writes import CreateRequest

SHADOW_PREFIX: Final = "\x00f/"
_PIN: Final = b"pin:"  # pin:<fork uid> -> {"source": path, "uid": source uid} (on the source's owner)
_REL: Final = b"rel:"  # rel:<fork uid> -> {"source": path, "at": time | None} (on the fork's owner)
# A pin asked for but not (yet) used by a fork is released once it is this old: the fork's
# creation failed somewhere between asking and committing (or the fork existed already).
INTENT_GRACE: Final = 60.0


def shadow_key(uid: str) -> str:
    return SHADOW_PREFIX + uid


def is_shadow(path: str) -> bool:
    return path.startswith(SHADOW_PREFIX)


@dataclass(frozen=True, slots=True)
class Level:
    """One stream of the source's chain, as far as the fork inherits it."""

    uid: str
    content_type: str
    first_chunk: int
    cap: int  # positions at and past this are not inherited from this level
    cap_chunk: int  # the chunk id naming `cap`
    fork_position: int  # its own source's share ends here (when `has_source`)
    has_source: bool
    chunks: list[tuple[int, ChunkInfo]]  # sealed chunks starting below cap
    records: list[Record] = field(default_factory=list)  # unsealed records below cap, cut at cap


@dataclass(frozen=True, slots=True)
class PinnedSource:
    """What the source's owner answers a pin with: the fork's fields and the chain."""

    source_path: str
    source_uid: str
    position: int
    tail_chunk: int
    content_type: str
    ttl: int | None
    expires_at: float | None
    expires_at_text: str | None
    snapshot_offset: str | None
    snapshot_type: str
    snapshot_size: int
    snapshot_key: str | None
    levels: list[Level] = field(default_factory=list)

    def encode(self) -> bytes:
        d: dict[str, Any] = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "levels"}
        d["levels"] = levels_to_json(self.levels)
        return orjson.dumps(d)

    @staticmethod
    def decode(raw: bytes) -> PinnedSource:
        d = orjson.loads(raw)
        levels = levels_from_json(d.pop("levels"))
        return PinnedSource(**d, levels=levels)


def levels_to_json(levels: list[Level]) -> list[dict[str, Any]]:
    """Levels as JSON values (records' bytes in base64); also carried by a move (moveformat)."""
    return [
        {**{k: getattr(lv, k) for k in lv.__dataclass_fields__ if k not in ("chunks", "records")},
         "chunks": [[cid, orjson.loads(info.encode())] for cid, info in lv.chunks],
         "records": [[r.end, r.chunk, r.flags, base64.b64encode(r.data).decode()] for r in lv.records]}
        for lv in levels
    ]


def levels_from_json(raw: list[dict[str, Any]]) -> list[Level]:
    return [
        Level(**{**lv, "chunks": [(int(cid), ChunkInfo(**info)) for cid, info in lv["chunks"]],
                 "records": [Record(int(e), int(c), int(f), base64.b64decode(b)) for e, c, f, b in lv["records"]]})
        for lv in raw
    ]


# --- on the source's owner -----------------------------------------------------------------


def pin(store: Store, txn: lmdb.Transaction, req: CreateRequest, fork_uid: str) -> StreamMeta:
    """Validate a fork of `req.fork_from` as a local fork would be, count it as a reader of the
    source (once per fork uid) and roll what is unsealed below the fork position. Returns the
    would-be fork's metadata (its fork fields, inherited snapshot and expiry filled in)."""
    assert req.fork_from is not None
    now = store.clock()
    scratch = StreamMeta(path=req.path, sid=0, content_type=req.content_type or "", created_at=now,
                         last_access=now, ttl=req.ttl, expires_at=req.expires_at,
                         expires_at_text=req.expires_at_text)
    source = store._fork_source(txn, req, scratch, now)
    if store.guard is not None:  # still ours, on the writer: a move may have taken it since the check
        store.guard(source.path, source)
    key = _PIN + fork_uid.encode()
    if txn.get(key, db=store.wal.sys) is None:
        txn.put(key, orjson.dumps({"source": source.path, "uid": source.uid}), db=store.wal.sys)
        source.refcount += 1
        store._save(source)
    return scratch


def export(store: Store, txn: lmdb.Transaction, source_path: str, source_uid: str, scratch: StreamMeta) -> PinnedSource:
    """The chain below the fork position: sealed chunks by their manifest entries, the rest as
    records (a chunk being uploaded still has its records in the WAL: they are exported)."""
    meta = store._load(txn, source_path)
    if meta is None or meta.uid != source_uid:
        raise NotFound("fork source stream not found (deleted while the fork was being created)")
    return PinnedSource(
        source_path=source_path, source_uid=source_uid, position=scratch.fork_position,
        tail_chunk=scratch.tail_chunk, content_type=scratch.content_type, ttl=scratch.ttl,
        expires_at=scratch.expires_at, expires_at_text=scratch.expires_at_text,
        snapshot_offset=scratch.snapshot_offset, snapshot_type=scratch.snapshot_type,
        snapshot_size=scratch.snapshot_size, snapshot_key=scratch.snapshot_key,
        levels=export_levels(store, txn, meta, scratch.fork_position, scratch.tail_chunk),
    )


def export_levels(store: Store, txn: lmdb.Transaction, meta: StreamMeta, cap: int, cap_chunk: int) -> list[Level]:
    """`meta`'s chain below `cap` (a stream or a shadow), level by level from `meta` down."""
    lookup = store._lookup(txn)
    levels: list[Level] = []
    for _ in range(64):
        chunks = _manifest(txn, store, meta.sid, cap)
        records = _records(txn, store, meta, cap)
        key = meta.source_key
        source = lookup(key) if key is not None else None
        has_source = source is not None and source.sid == meta.fork_source_sid
        levels.append(Level(meta.uid, meta.content_type, meta.first_chunk, cap, cap_chunk, meta.fork_position,
                            has_source, chunks, records))
        if source is None or not has_source:
            return levels
        if cap > meta.fork_position:
            cap = meta.fork_position
            cap_chunk = chunk_at(txn, store.wal, source, lookup, cap)
        meta = source
    raise Conflict("fork chain too deep")


def chunk_naming(store: Store, txn: lmdb.Transaction, meta: StreamMeta, position: int) -> int:
    """The chunk id naming `position` in `meta`'s stream (its chain included)."""
    return chunk_at(txn, store.wal, meta, store._lookup(txn), position)


def _records(txn: lmdb.Transaction, store: Store, meta: StreamMeta, cap: int) -> list[Record]:
    """`meta`'s own records (WAL and journal) below `cap`, the last one cut at `cap`."""
    out: list[Record] = []
    for rec in stream_records(txn, store.wal, meta.sid, 0):
        if rec.start >= cap:
            break
        if rec.end > cap:
            rec = Record(cap, rec.chunk, rec.flags, rec.data[: len(rec.data) - (rec.end - cap)])
        out.append(rec)
    return out


def _manifest(txn: lmdb.Transaction, store: Store, sid: int, cap: int) -> list[tuple[int, ChunkInfo]]:
    """The sealed manifest entries of `sid` starting below `cap`."""
    out: list[tuple[int, ChunkInfo]] = []
    prefix = SID.pack(sid)
    cur = txn.cursor(store.wal.chunks)
    if cur.set_range(prefix):
        for key, raw in cur:
            if bytes(key[:8]) != prefix:
                break
            info = ChunkInfo.decode(raw)
            if info.start >= cap:
                break
            if info.state == SEALED:
                out.append((SID.unpack(key[8:16])[0], info))
    return out


def add_pin(store: Store, txn: lmdb.Transaction, fork_uid: str, source: StreamMeta) -> bool:
    """Record that fork `fork_uid` reads `source` (counted in its refcount by the caller, or
    already). False: it was recorded already."""
    key = _PIN + fork_uid.encode()
    if txn.get(key, db=store.wal.sys) is not None:
        return False
    txn.put(key, orjson.dumps({"source": source.path, "uid": source.uid}), db=store.wal.sys)
    return True


def pins_of(store: Store, txn: lmdb.Transaction, source_uid: str) -> list[str]:
    """The fork uids pinning the stream `source_uid` here (a scan: moves only)."""
    out = []
    cur = txn.cursor(store.wal.sys)
    if cur.set_range(_PIN):
        for key, raw in cur:
            if not bytes(key).startswith(_PIN):
                break
            if orjson.loads(raw)["uid"] == source_uid:
                out.append(bytes(key[len(_PIN):]).decode())
    return out


def drop_pins(store: Store, txn: lmdb.Transaction, fork_uids: list[str]) -> None:
    for uid in fork_uids:
        txn.delete(_PIN + uid.encode(), db=store.wal.sys)


def release(store: Store, txn: lmdb.Transaction, fork_uid: str) -> bool:
    """Uncount fork `fork_uid` as a reader of its source (idempotent); remove a soft-deleted
    source nothing reads any more. False: there was no such pin."""
    key = _PIN + fork_uid.encode()
    raw = txn.get(key, db=store.wal.sys)
    if raw is None:
        return False
    pinned = orjson.loads(raw)
    txn.delete(key, db=store.wal.sys)
    meta = store._load(txn, pinned["source"])
    if meta is not None and meta.uid == pinned["uid"]:
        meta.refcount = max(0, meta.refcount - 1)
        store._save(meta)
        if meta.refcount == 0 and meta.soft_deleted:
            store._remove(txn, meta)
        elif meta.refcount == 0:
            store.release_retained(txn, meta)  # history a snapshot gave up while forks read it
    return True


# --- on the fork's owner -------------------------------------------------------------------


def install(store: Store, txn: lmdb.Transaction, meta: StreamMeta, pinned: PinnedSource) -> None:
    """Shadows for the pinned chain (new or grown), and `meta`'s fork fields on top of them;
    the pin is in use from now on (its queued release is dropped)."""
    assert meta.uid
    released(store, txn, meta.uid)
    below = install_shadows(store, txn, pinned.levels)
    meta.content_type = pinned.content_type
    meta.fork_source, meta.fork_source_key = pinned.source_path, below.path
    meta.fork_source_sid, meta.fork_source_uid = below.sid, pinned.source_uid
    meta.fork_position = pinned.position
    meta.snapshot_offset, meta.snapshot_type = pinned.snapshot_offset, pinned.snapshot_type
    meta.snapshot_size, meta.snapshot_key = pinned.snapshot_size, pinned.snapshot_key
    if meta.ttl is None and meta.expires_at is None:
        meta.ttl, meta.expires_at, meta.expires_at_text = pinned.ttl, pinned.expires_at, pinned.expires_at_text
    meta.tail = meta.chunk_start = pinned.position
    meta.tail_chunk = pinned.tail_chunk


def install_shadows(store: Store, txn: lmdb.Transaction, levels: list[Level]) -> StreamMeta:
    """Shadows for a chain (new or grown), the top one counted once more as read; returns it."""
    below: StreamMeta | None = None
    for level in reversed(levels):  # the root first: each shadow names the one below
        below = _shadow(store, txn, level, below)
    assert below is not None
    below.refcount += 1
    store._save(below)
    return below


def _shadow(store: Store, txn: lmdb.Transaction, level: Level, below: StreamMeta | None) -> StreamMeta:
    key = shadow_key(level.uid)
    shadow = store._load(txn, key)
    if shadow is None:
        now = store.clock()
        shadow = StreamMeta(path=key, sid=store._next_sid(txn), content_type=level.content_type,
                            created_at=now, last_access=now, uid=level.uid, first_chunk=level.first_chunk)
        if below is not None:
            below.refcount += 1
            store._save(below)
            shadow.fork_source = shadow.fork_source_key = below.path
            shadow.fork_source_sid, shadow.fork_source_uid = below.sid, below.uid
            shadow.fork_position = level.fork_position
    elif level.cap <= shadow.tail:
        return shadow  # it holds all this fork inherits already (chunks and records never change)
    # New, or grown: this export covers everything below its cap, so it replaces what was held
    # (a record cut at the old cap would otherwise overlap its whole self).
    store._drop_prefix(txn, store.wal.records, SID.pack(shadow.sid))
    store._drop_prefix(txn, store.wal.chunks, SID.pack(shadow.sid))
    # The shadow never takes appends: its "open chunk" starts at its tail, so nothing ever
    # rolls or seals it (its records are the source's, named by the source's chunk ids).
    shadow.tail, shadow.tail_chunk = level.cap, level.cap_chunk
    shadow.chunk, shadow.chunk_start = level.cap_chunk + 1, level.cap
    for cid, info in level.chunks:
        txn.put(chunk_key(shadow.sid, cid), info.encode(), db=store.wal.chunks)
    for rec in level.records:
        txn.put(record_key(shadow.sid, rec.end), encode_record(rec.chunk, rec.flags, rec.data), db=store.wal.records)
    store._save(shadow)
    return shadow


def forget(store: Store, txn: lmdb.Transaction, meta: StreamMeta) -> None:
    """`meta` (a fork of a source elsewhere, or a shadow) is gone: unref the shadow it reads,
    dropping shadows nothing reads any more, and queue the release of a fork's pin."""
    if not is_shadow(meta.path) and meta.fork_source is not None:
        queue_release(store, txn, meta.uid, meta.fork_source, None)
        store.releases_queued = True
    unref_shadows(store, txn, meta.fork_source_key)


def unref_shadows(store: Store, txn: lmdb.Transaction, key: str | None) -> None:
    """One reader of shadow `key` fewer; drop shadows nothing reads any more, down the chain."""
    for _ in range(64):
        if key is None:
            return
        shadow = store._load(txn, key)
        if shadow is None:
            return
        shadow.refcount = max(0, shadow.refcount - 1)
        if shadow.refcount > 0:
            store._save(shadow)
            return
        store._drop_prefix(txn, store.wal.chunks, SID.pack(shadow.sid))
        store._drop_prefix(txn, store.wal.records, SID.pack(shadow.sid))
        txn.delete(shadow.path.encode(), db=store.wal.streams)
        store._metas[shadow.path] = None
        store._dirty.pop(shadow.path, None)
        key = shadow.fork_source_key


def queue_release(store: Store, txn: lmdb.Transaction, fork_uid: str, source_path: str, intent_at: float | None) -> None:
    """Release fork `fork_uid`'s pin of `source_path`: now (a removed fork), or, for a pin
    about to be asked for (`intent_at`), unless a fork uses it (install drops the entry)."""
    txn.put(_REL + fork_uid.encode(), orjson.dumps({"source": source_path, "at": intent_at}), db=store.wal.sys)


def pending_releases(store: Store, txn: lmdb.Transaction, now: float) -> list[tuple[str, str]]:
    """(fork uid, source path) of every pin to release now."""
    out = []
    cur = txn.cursor(store.wal.sys)
    if cur.set_range(_REL):
        for key, raw in cur:
            if not bytes(key).startswith(_REL):
                break
            d = orjson.loads(raw)
            if d["at"] is None or d["at"] + INTENT_GRACE <= now:
                out.append((bytes(key[len(_REL):]).decode(), d["source"]))
    return out


def released(store: Store, txn: lmdb.Transaction, fork_uid: str) -> None:
    txn.delete(_REL + fork_uid.encode(), db=store.wal.sys)
