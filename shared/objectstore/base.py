"""The ObjectStore contract that both implementations (S3, local directory) honour.

Every implementation converts its own errors into the domain errors of shared.errors
(ObjectNotFound, PreconditionFailed, ObjectStoreUnavailable, ObjectStoreError), so callers
handle one set of exceptions whatever the store is.

ETags are opaque strings without quotes. S3's is its own (the MD5 hex of the content for a
single-part unencrypted put); the local store's is the MD5 hex of the content as well where
the file system keeps extended attributes (see shared.objectstore.local).

Keys are '/'-separated relative names ("chunks/ab/123/0000000000000003"). Both stores
validate them the same way (validate_key), so a key that works in `ds3 dev` also works on S3
and the other way round.
"""

from __future__ import annotations

import mmap
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Protocol, Self, runtime_checkable

# Prefix of the local store's temporary files; reserved so a key can never collide with one.
TEMP_PREFIX: Final = ".ds3tmp-"
DEFAULT_CHUNK_SIZE: Final = 256 * 1024
DEFAULT_LIST_PAGE_SIZE: Final = 1000  # S3's own maximum for ListObjectsV2 and DeleteObjects


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str  # opaque (see the stores); differs between versions with different content
    content_type: str | None = None  # None from list() (S3 listings do not carry it)
    last_modified: float | None = None  # Unix time, seconds


@dataclass(slots=True)
class StoreCounters:
    """Requests and bytes per store, for metrics. Directions are seen from this process:
    bytes_in were read from the store, bytes_out were written to it."""

    gets: int = 0
    puts: int = 0
    heads: int = 0
    lists: int = 0
    deletes: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class MappedRange:
    """A read-only memory map of part of a local object (LocalStore.map_range)."""

    def __init__(self, mapping: mmap.mmap | None, start: int, end: int) -> None:
        self._mapping = mapping
        self.view = memoryview(mapping)[start:end] if mapping is not None else memoryview(b"")

    def __len__(self) -> int:
        return len(self.view)

    def close(self) -> None:
        self.view.release()
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a write still holds a slice of it: the map goes with the last one
                pass
            self._mapping = None


@runtime_checkable
class ObjectStore(Protocol):
    url: str
    counters: StoreCounters

    async def put(
        self,
        key: str,
        data: bytes,
        *,
        content_type: str | None = None,
        if_absent: bool = False,
        if_match: str | None = None,
        durable: bool = True,
    ) -> str:
        """Write the whole object; returns its new ETag.

        durable=False (unconditional writes only): the object is whole and visible when put
        returns, but may not survive a crash of the machine until sync() of its key returns.
        For a caller whose own log can write it again after such a crash (the ingester's
        descriptor marks), so the wait for the disk is paid once per batch. A store whose
        writes are always durable (S3) ignores it.

        Conditional writes (compare-and-swap; of several concurrent writers with the same
        condition exactly one wins, the others get PreconditionFailed and change nothing):
        if_absent: create only, PreconditionFailed if the key exists (S3 If-None-Match: *).
        if_match: replace only the version whose ETag this is (from put, head, list or
        get_with_etag); PreconditionFailed if the object is missing or is another version
        (S3 If-Match). At most one of the two.

        Only conditional writes are ordered with each other: an unconditional put or a delete
        of a key racing a conditional write of it may be undone by it. Keys that are written
        conditionally (the ownership record) are only ever written conditionally.

        A conditional write whose answer was lost and that the client retried (botocore does)
        can report PreconditionFailed although it happened; a caller that must know reads the
        object back (shared.ownership does)."""

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of the object, clamped like a Python slice."""

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """The whole object and the ETag of that very version (one request): what a
        read-modify-write passes to put(if_match=...)."""

    def stream(
        self,
        key: str,
        start: int | None = None,
        end: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        """Like get() but yields pieces of at most chunk_size bytes as they arrive. Errors
        (ObjectNotFound included) surface on the first iteration."""

    async def map_range(self, key: str, start: int, end: int) -> MappedRange | None:
        """Bytes [start, end) as a read-only view of the store's own file, for stores that keep
        objects in local files (None for the others: S3). A reader sends the view without
        copying it through Python; the caller closes it. ObjectNotFound if the key is missing."""

    async def head(self, key: str) -> ObjectInfo: ...

    async def delete(self, key: str, *, durable: bool = True) -> None:
        """Idempotent: deleting a missing key is not an error. durable=False: gone when delete
        returns, gone for good once sync() of the key returns (as put's)."""

    async def sync(self, keys: Collection[str]) -> None:
        """Make the durable=False puts of `keys` durable (a key since overwritten or deleted:
        whatever it holds now). A no-op where every write is durable already."""

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with prefix; returns how many were deleted."""

    def list(
        self, prefix: str = "", start_after: str | None = None, limit: int | None = None
    ) -> AsyncIterator[ObjectInfo]:
        """Keys starting with prefix, sorted (by UTF-8 bytes, as S3 does), strictly after
        start_after, at most limit of them; pages are fetched as the caller iterates."""

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def validate_key(key: str) -> str:
    """Reject keys that could escape the local root or that S3 and a file system would treat
    differently (empty segments, '.', '..', absolute, backslashes, NUL, temp-file names)."""
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"invalid object key: {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith(TEMP_PREFIX):
            raise ValueError(f"invalid object key: {key!r}")
    return key


def validate_prefix(prefix: str) -> str:
    """A prefix may be empty or end in the middle of a name ("chunks/ab" matches
    "chunks/abc/..."), but must not be able to name anything validate_key rejects."""
    if prefix == "":
        return prefix
    if prefix.startswith("/") or "\\" in prefix or "\x00" in prefix:
        raise ValueError(f"invalid key prefix: {prefix!r}")
    parts = prefix.split("/")
    # The last part may be partial ("" after a trailing slash, or a name's beginning).
    for part in parts[:-1]:
        if part in ("", ".", ".."):
            raise ValueError(f"invalid key prefix: {prefix!r}")
    if parts[-1] == "..":
        raise ValueError(f"invalid key prefix: {prefix!r}")
    return prefix


def check_put_conditions(if_absent: bool, if_match: str | None) -> None:
    """put() takes at most one of its two conditions."""
    if if_absent and if_match is not None:
        raise ValueError("put: if_absent and if_match exclude each other")


def check_chunk_size(chunk_size: int) -> None:
    """stream() yields pieces of at least one byte."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive: {chunk_size}")


def check_range(start: int | None, end: int | None) -> tuple[int, int | None]:
    """Normalise a get()/stream() range: start defaults to 0; both must be >= 0, start <= end."""
    lo = 0 if start is None else start
    if lo < 0 or (end is not None and (end < 0 or end < lo)):
        raise ValueError(f"invalid byte range: start={start}, end={end}")
    return lo, end
