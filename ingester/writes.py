"""What the writer's operations take and give (ingester/store.py runs them): requests, results,
the sealing policy, TTL renewals and what a commit changed. No lmdb, no aiohttp."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ingester.records import ChunkRef, StreamMeta
from ingester.remote_forks import PinnedSource
from shared.descriptor import Descriptor
from shared.errors import BadRequest
from shared.protocol import ProducerHeaders


class SubOffsetSealed(BadRequest):
    """The chunk a fork sub-offset points into was sealed between the service resolving it
    against the WAL and the writer applying it: resolve it again, with the chunk's index."""


@dataclass(frozen=True, slots=True)
class CreateRequest:
    path: str
    content_type: str | None  # None: the default, or the source's for a fork
    ttl: int | None = None
    expires_at: float | None = None
    expires_at_text: str | None = None
    closed: bool = False
    body: bytes = b""
    fork_from: str | None = None
    fork_offset: str | None = None
    fork_sub_offset: int | None = None
    # The sub-offset already resolved against a sealed chunk's index (see service.create):
    # the writer cannot read the object store, and sealed data never changes.
    fork_sub_position: int | None = None
    # A fork of a source on another ingester (ingester/forks_across.py): the new stream's uid
    # (its pin at the source's owner is named by it) and the source's pinned, sealed chain.
    uid: str | None = None
    remote_source: PinnedSource | None = None


@dataclass(frozen=True, slots=True)
class AppendRequest:
    path: str
    content_type: str | None
    body: bytes
    messages: list[bytes] | None  # JSON messages split on the loop, when the request is JSON
    close: bool = False
    stream_seq: str | None = None
    producer: ProducerHeaders | None = None


@dataclass(frozen=True, slots=True)
class StreamView:
    """What a write response reports about the stream after the write."""

    content_type: str
    tail_offset: str
    closed: bool


@dataclass(frozen=True, slots=True)
class CreateResult:
    created: bool
    stream: StreamView


@dataclass(frozen=True, slots=True)
class AppendResult:
    stream: StreamView
    duplicate: bool = False  # idempotent producer retry, or close of a closed stream
    producer_epoch: int | None = None
    producer_seq: int | None = None


def _view(meta: StreamMeta) -> StreamView:
    return StreamView(meta.content_type, meta.tail_offset, meta.closed)


@dataclass(frozen=True, slots=True)
class SealPolicy:
    """When open chunks roll. None: never (no object store; the WAL keeps everything)."""

    seal_bytes: int
    seal_age: float
    wal_max_bytes: int  # past this many bytes of unsealed records, appends get 503


class Touches(dict[str, float]):
    """TTL renewals by path: set on the event loop, forgotten by the writer thread. The lock
    makes "forget it unless renewed since" one step (a get, then a del, lost a renewal the
    loop made between them); reads on other threads only get()."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __setitem__(self, path: str, at: float) -> None:
        with self._lock:
            super().__setitem__(path, at)

    def forget(self, path: str, at: float) -> None:
        with self._lock:
            if self.get(path) == at:
                del self[path]


@dataclass(slots=True)
class Committed:
    """What one durable commit changed, for the event loop to act on."""

    changed: set[str] = field(default_factory=set)  # stream paths: wake their readers
    rolled: list[ChunkRef] = field(default_factory=list)  # chunks to upload
    removed: list[tuple[str, str]] = field(default_factory=list)  # (uid, path): delete objects
    # to publish: each path's descriptor as the commit left it (None: no stream), taken on the
    # writer thread (the metadata objects go on changing there)
    descriptors: dict[str, Descriptor | None] = field(default_factory=dict)
    # object keys this commit made unreachable (queued in `sys` as del:<key>): the reaper's
    released: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.changed or self.rolled or self.removed or self.descriptors or self.released)
