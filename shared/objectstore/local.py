"""ObjectStore on a local directory (`file:///abs/path`): what `ds3 dev` and tests use.

Each key is one plain file under the root holding exactly the object's bytes, so the tree can
be inspected (or read by the pipeline) directly. Durability mirrors what S3 promises:
a write goes to a temporary file in the same directory, is fsynced, then renamed (or hard
linked, for if_absent) into place and the directory is fsynced. A crash leaves either the
old object or the new one, plus at worst a stray temp file that list/get never show.

ETags are, as on S3, the MD5 hex of the content: computed by put() and kept in an extended
attribute of the file (atomic with the data, like the content type), so head() and list() read
it without reading the object. Where the file system has no extended attributes (or for a file
written by an older version) the ETag is made of inode, mtime and size instead; objects are
never modified in place, so it changes whenever the content can have.

Conditional writes are atomic across threads and processes on this machine:
- if_absent hard-links the finished temp file to the key: link() fails if the name exists, so
  of concurrent creators exactly one wins, and the object is complete before anyone sees it.
  On Linux the temp file is an unnamed one (O_TMPFILE, linked through /proc/self/fd): no name
  to make up, no unlink afterwards, and nothing left behind by a crash; where the file system
  or /proc does not allow it, a named temp file as for the other writes.
- if_match holds an exclusive lock on the store's lock file (flock on `<root>/.ds3tmp-lock`,
  plus a lock of this process for file systems where flock is per process) while it compares
  the current ETag with the expected one and renames the new version into place. The data is
  written and fsynced before the lock is taken, and the directory after it is released, so it
  is held for a stat and a rename only: a process frozen (SIGSTOP) while holding it blocks
  every other writer's if_match (a standby's takeover of the ownership record among them)
  until it runs again, and the shorter the hold, the rarer that is. (The directory's fsync
  outside it is still before the put returns: a writer that acts on a version not yet durable
  acts through a put of its own, whose directory fsync makes both durable.) A writer waits at
  most LOCK_WAIT for the lock, then fails as the store being unavailable (it retries), rather
  than hanging a worker thread for as long as the holder stays frozen.

Blocking file I/O runs in worker threads (asyncio.to_thread) so the event loop never waits
on the disk. The content type is kept in an extended attribute of the file, which makes it
atomic with the data; where xattrs are unsupported head() reports None.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Final, Self, TypeVar

from shared.errors import ObjectNotFound, ObjectStoreError, ObjectStoreUnavailable, PreconditionFailed
from shared.localfile import fsync_dir

from .base import (
    DEFAULT_CHUNK_SIZE,
    TEMP_PREFIX,
    MappedRange,
    ObjectInfo,
    StoreCounters,
    check_chunk_size,
    check_put_conditions,
    check_range,
    validate_key,
    validate_prefix,
)

log = logging.getLogger(__name__)
_R = TypeVar("_R")

XATTR_CONTENT_TYPE: Final = "user.ds3.content_type"
XATTR_MD5: Final = "user.ds3.md5"  # the ETag: MD5 hex of the content, set before the rename
LOCK_NAME: Final = TEMP_PREFIX + "lock"  # in the root; never a key (validate_key refuses the prefix)
# flock excludes open file descriptions, but on some file systems (NFS) it degrades to a
# per-process lock: threads of one process also take this one.
_PROCESS_LOCK: Final = threading.Lock()
LOCK_WAIT: Final = 5.0  # seconds a conditional write waits for the write lock (held for a rename)
# Errors that a later retry may fix (full disk, I/O trouble); anything else is a bug or config.
_TRANSIENT_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EMFILE})
# A key whose path runs into a file or a directory names no object (as on S3).
_MISSING: Final = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
_PUT_ATTEMPTS: Final = 5


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    is_dir: bool
    size: int
    mtime_ns: int
    etag: str


def _stat_etag(st: os.stat_result) -> str:
    # Without the MD5 attribute. Objects are replaced by rename, never modified in place, so
    # inode + mtime + size changes whenever the content can have changed.
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _etag(target: int | str | Path, st: os.stat_result, xattrs: bool) -> str:
    """The ETag of the file `target` (a path or an open descriptor) whose stat is `st`."""
    if xattrs:
        try:
            return os.getxattr(target, XATTR_MD5).decode()
        except OSError:
            pass  # ENODATA: written without one; ENOTSUP: no xattrs on this file system
    return _stat_etag(st)


def _in_directory(key: str, parent: Path, create: Callable[[], _R]) -> _R:
    """create() a file in `parent`, making the directory first if it is missing (again if a
    concurrent delete prunes it, now empty, in between). Other OSErrors are the caller's."""
    for _ in range(_PUT_ATTEMPTS):
        try:
            return create()
        except FileNotFoundError:
            pass
        except NotADirectoryError as exc:
            raise ObjectStoreError(f"local object store: {key}: a parent is an object, not a directory") from exc
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise ObjectStoreError(f"local object store: {key}: a parent is an object, not a directory") from exc
    raise ObjectStoreUnavailable(f"local object store: {key}: its directory keeps disappearing")


def _converted(key: str, exc: OSError) -> Exception:
    if isinstance(exc, _MISSING):
        return ObjectNotFound(key)
    if exc.errno in _TRANSIENT_ERRNOS:
        return ObjectStoreUnavailable(f"local object store: {key}: {exc.strerror}")
    return ObjectStoreError(f"local object store: {key}: {exc.strerror or exc}")


def _scan(directory: Path, xattrs: bool) -> list[_Entry]:
    out: list[_Entry] = []
    with os.scandir(directory) as it:
        for d in it:
            if d.name.startswith(TEMP_PREFIX):
                continue  # an unfinished (or crashed) write, or the lock file: never an object
            try:
                st = d.stat()
                is_dir = d.is_dir()
                etag = "" if is_dir else _etag(d.path, st, xattrs)
            except FileNotFoundError:
                continue  # deleted while we looked
            out.append(_Entry(d.name, is_dir, st.st_size, st.st_mtime_ns, etag))
    # Sort as the keys sort: a directory's keys all start with "name/", so it sorts as
    # that string ("a.b" < "a/..." < "a0"), which is S3's UTF-8 byte order (code point
    # order equals UTF-8 byte order).
    out.sort(key=lambda e: e.name + "/" if e.is_dir else e.name)
    return out


class LocalStore:
    """Objects as files under `root`. Any number of instances and processes may share a
    root: every write is an atomic rename or link, and conditional replacements (if_match)
    take the root's lock file."""

    def __init__(self, root: Path, *, url: str | None = None) -> None:
        if not root.is_absolute():
            raise ValueError(f"local store root must be absolute: {root}")
        self.root = root
        self.url = url or root.as_uri()
        self.counters = StoreCounters()
        self._xattrs = hasattr(os, "setxattr")
        self._unnamed = hasattr(os, "O_TMPFILE")  # if_absent writes through an unnamed file
        self._closed = False
        root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True

    def _path(self, key: str) -> Path:
        if self._closed:
            raise RuntimeError("object store is closed")
        return self.root / validate_key(key)

    # ------------------------------------------------------------ writes
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
        check_put_conditions(if_absent, if_match)
        path = self._path(key)
        # durable=False (unconditional writes only): the same temp file and rename, without the
        # file's and the directory's fsyncs; sync() makes them. Two fsyncs per object cost more
        # than the rest of a small write (a create's descriptor).
        durable = durable or if_absent or if_match is not None
        try:
            etag = await asyncio.to_thread(self._put_sync, key, path, data, content_type, if_absent, if_match,
                                           durable)
        except PreconditionFailed:
            raise  # a lost race is an answer, not an error
        except ObjectStoreError:
            self.counters.errors += 1
            raise
        finally:
            self.counters.puts += 1
        self.counters.bytes_out += len(data)
        return etag

    def _put_sync(self, key: str, path: Path, data: bytes, content_type: str | None, if_absent: bool,
                  if_match: str | None, durable: bool = True) -> str:
        if if_absent and self._unnamed:
            etag = self._create_unnamed(key, path, data, content_type)
            if etag is not None:
                return etag
        fd, tmp = self._create_temp(key, path.parent)
        published = False
        try:
            try:
                etag, tagged = self._write_and_sync(fd, data, content_type, durable)
            finally:
                os.close(fd)
            if if_absent:
                # link() fails with EEXIST if the name exists: of concurrent creators exactly
                # one wins, and the winner's file is complete before anyone can see it.
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise PreconditionFailed(key) from None
                fsync_dir(path.parent)
            elif if_match is not None:
                with self._locked():
                    etag = self._replace_if_match(key, tmp, path, if_match, etag, tagged)
                    published = True
                fsync_dir(path.parent)  # (after the lock: see the module docstring)
            else:
                os.replace(tmp, path)
                published = True
                if durable:
                    fsync_dir(path.parent)
            return etag
        except OSError as exc:
            raise _converted(key, exc) from exc
        finally:
            if not published:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def _replace_if_match(self, key: str, tmp: str, path: Path, expected: str, etag: str, tagged: bool) -> str:
        """Under the lock: rename tmp over path if path is the version `expected`."""
        expected = expected.strip('"')
        try:
            current = path.stat()
            if not path.is_file():
                raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        except _MISSING:
            raise PreconditionFailed(key, f"no object (expected version {expected})") from None
        if _etag(path, current, self._xattrs) != expected:
            raise PreconditionFailed(key, f"object is not version {expected}")
        if not tagged:
            # Inode-mtime-size ETags: make the mtime strictly increase from version to version
            # so that an old ETag can never match again (an inode number is reused, and a
            # coarse clock can stamp two versions of one size alike).
            st = os.stat(tmp)
            mtime = max(st.st_mtime_ns, current.st_mtime_ns + 1000)
            os.utime(tmp, ns=(st.st_atime_ns, mtime))
            etag = _stat_etag(os.stat(tmp))
        os.replace(tmp, path)
        return etag

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's write lock, across threads and processes (see the module docstring).
        A process that dies holding it releases it: the kernel drops the flock."""
        deadline = time.monotonic() + LOCK_WAIT
        if not _PROCESS_LOCK.acquire(timeout=LOCK_WAIT):
            raise OSError(errno.EAGAIN, f"the store's write lock is held by another thread of this process for "
                          f"over {LOCK_WAIT:g} s")
        try:
            fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                pause = 0.001
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise OSError(errno.EAGAIN, f"{self.root / LOCK_NAME} is held by another process for over "
                                          f"{LOCK_WAIT:g} s (a stopped one?)") from None
                        time.sleep(pause)
                        pause = min(pause * 2, 0.05)
                yield
            finally:
                os.close(fd)  # releases the flock
        finally:
            _PROCESS_LOCK.release()

    def _write_and_sync(self, fd: int, data: bytes, content_type: str | None, durable: bool = True) -> tuple[str, bool]:
        """Into the new file `fd`: the data, the content type and MD5 attributes, fsync; the
        ETag, and whether it is the MD5 attribute's (else inode-mtime-size)."""
        os.fchmod(fd, 0o644)  # mkstemp makes 0600, O_TMPFILE the umask's; objects are not secrets
        with memoryview(data) as view:
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        if content_type is not None:
            self._set_xattr(fd, XATTR_CONTENT_TYPE, content_type)
        md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
        tagged = self._set_xattr(fd, XATTR_MD5, md5)
        if durable:
            os.fsync(fd)
        return (md5, True) if tagged else (_stat_etag(os.fstat(fd)), False)

    def _create_unnamed(self, key: str, path: Path, data: bytes, content_type: str | None) -> str | None:
        """An if_absent write through an unnamed file (O_TMPFILE) linked to the key once it is
        complete and durable; None where this system cannot (then never tried again)."""
        parent = path.parent
        try:
            fd = _in_directory(key, parent, lambda: os.open(parent, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o644))
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                self._unnamed = False  # (an old kernel or a file system without it)
                return None
            raise _converted(key, exc) from exc
        try:
            etag, _ = self._write_and_sync(fd, data, content_type)
            dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names the unnamed file; it fails if
                # the key exists, so of concurrent creators exactly one wins.
                os.link(f"/proc/self/fd/{fd}", path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                        follow_symlinks=True)
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            return etag
        except FileExistsError:
            raise PreconditionFailed(key) from None
        except OSError as exc:
            if exc.errno == errno.ENOENT and not os.path.isdir("/proc/self/fd"):
                self._unnamed = False  # no /proc here: named temp files from now on
                return None
            raise _converted(key, exc) from exc
        finally:
            os.close(fd)

    def _create_temp(self, key: str, parent: Path) -> tuple[int, str]:
        try:
            return _in_directory(key, parent, lambda: tempfile.mkstemp(prefix=TEMP_PREFIX, dir=parent))
        except OSError as exc:
            raise _converted(key, exc) from exc

    def _set_xattr(self, fd: int, name: str, value: str) -> bool:
        """Whether the attribute was set (False: the file system keeps none)."""
        if not self._xattrs:
            return False
        try:
            os.setxattr(fd, name, value.encode())
            return True
        except OSError as exc:
            if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                raise
            self._xattrs = False
            log.warning("local object store %s: no extended attributes (%s); content types are not "
                        "kept and ETags are inode-mtime-size", self.root, exc.strerror)
            return False

    async def sync(self, keys: Collection[str]) -> None:
        paths = [self._path(key) for key in keys]
        if paths:
            await asyncio.to_thread(self._sync_paths, paths)

    def _sync_paths(self, paths: list[Path]) -> None:
        """fsync each file that exists, then each directory that holds one (once): after a
        crash, the names and the bytes under them are there. The first fsync commits the
        file system's journal for all of them, so the rest are mostly cheap."""
        parents: dict[Path, None] = {}  # ordered set
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except _MISSING:
                parents[path.parent] = None  # deleted since: its directory's entry is what counts
                continue
            except OSError as exc:
                raise _converted(str(path), exc) from exc
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            parents[path.parent] = None
        for parent in parents:
            try:
                fsync_dir(parent)
            except _MISSING:
                pass  # pruned (its objects deleted): nothing left to make durable there
            except OSError as exc:
                raise _converted(str(parent), exc) from exc

    async def delete(self, key: str, *, durable: bool = True) -> None:
        path = self._path(key)
        self.counters.deletes += 1
        await asyncio.to_thread(self._delete_sync, key, [path], durable)

    async def delete_prefix(self, prefix: str) -> int:
        keys = [info.key async for info in self.list(prefix)]
        paths = [self._path(k) for k in keys]
        self.counters.deletes += len(paths)
        return await asyncio.to_thread(self._delete_sync, prefix, paths)

    def _delete_sync(self, what: str, paths: list[Path], durable: bool = True) -> int:
        deleted = 0
        parents: dict[Path, None] = {}  # ordered set
        for path in paths:
            try:
                os.unlink(path)
                deleted += 1
                parents[path.parent] = None
            except _MISSING:
                pass  # idempotent: already gone (or never an object)
            except OSError as exc:
                self.counters.errors += 1
                raise _converted(what, exc) from exc
        for parent in parents:
            self._prune(parent, durable)
        return deleted

    def _prune(self, directory: Path, durable: bool = True) -> None:
        """Make the unlinks durable (unless sync() is to), then remove directories left empty
        (up to the root) so deleted streams leave no litter. A put racing with this retries
        its mkdir."""
        try:
            if durable:
                fsync_dir(directory)
        except FileNotFoundError:
            return
        while directory != self.root and self.root in directory.parents:
            try:
                directory.rmdir()
            except OSError:
                return  # not empty (or already gone): stop climbing
            directory = directory.parent

    # ------------------------------------------------------------ reads
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        data = await self._read(key, start, end, self._read_sync)
        self.counters.bytes_in += len(data)
        return data

    async def _read(self, key: str, start: int | None, end: int | None,
                    read: Callable[[Path, int, int | None], _R]) -> _R:
        """`read(path, lo, hi)` on a thread, counted, with the store's errors."""
        path = self._path(key)
        lo, hi = check_range(start, end)
        self.counters.gets += 1
        try:
            return await asyncio.to_thread(read, path, lo, hi)
        except OSError as exc:
            if not isinstance(exc, _MISSING):
                self.counters.errors += 1
            raise _converted(key, exc) from exc

    @staticmethod
    def _read_sync(path: Path, lo: int, hi: int | None) -> bytes:
        with open(path, "rb") as f:
            f.seek(lo)
            return f.read(-1 if hi is None else hi - lo)

    async def get_with_etag(self, key: str) -> tuple[bytes, str]:
        data, etag = await self._read(key, None, None, self._read_with_etag)
        self.counters.bytes_in += len(data)
        return data, etag

    def _read_with_etag(self, path: Path, lo: int, hi: int | None) -> tuple[bytes, str]:
        with open(path, "rb") as f:  # one file, so the ETag is that of the bytes read
            return f.read(), _etag(f.fileno(), os.fstat(f.fileno()), self._xattrs)

    async def stream(
        self,
        key: str,
        start: int | None = None,
        end: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        path = self._path(key)
        lo, hi = check_range(start, end)
        check_chunk_size(chunk_size)
        self.counters.gets += 1
        try:
            f = await asyncio.to_thread(self._open_at, path, lo)
        except OSError as exc:
            if not isinstance(exc, _MISSING):
                self.counters.errors += 1
            raise _converted(key, exc) from exc
        try:
            remaining = None if hi is None else hi - lo
            while remaining is None or remaining > 0:
                want = chunk_size if remaining is None else min(chunk_size, remaining)
                try:
                    piece = await asyncio.to_thread(f.read, want)
                except OSError as exc:
                    self.counters.errors += 1
                    raise _converted(key, exc) from exc
                if not piece:
                    break
                if remaining is not None:
                    remaining -= len(piece)
                self.counters.bytes_in += len(piece)
                yield piece
        finally:
            # Closing a regular file does not block; doing it inline also works when the
            # generator is finalised without an event loop turn (never awaited to the end).
            f.close()

    async def map_range(self, key: str, start: int, end: int) -> MappedRange:
        mapped = await self._read(key, start, end, self._map)
        self.counters.bytes_in += len(mapped)
        return mapped

    @staticmethod
    def _map(path: Path, lo: int, hi: int | None) -> MappedRange:
        with open(path, "rb") as f:  # the map keeps its own reference to the file
            size = os.fstat(f.fileno()).st_size
            hi = size if hi is None else min(hi, size)
            if hi <= lo:
                return MappedRange(None, 0, 0)
            return MappedRange(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), lo, hi)

    @staticmethod
    def _open_at(path: Path, lo: int) -> BinaryIO:
        f = open(path, "rb")  # noqa: SIM115 - closed by stream()'s finally
        try:
            f.seek(lo)
        except BaseException:
            f.close()
            raise
        return f

    async def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        self.counters.heads += 1
        try:
            return await asyncio.to_thread(self._head_sync, key, path)
        except OSError as exc:
            if not isinstance(exc, _MISSING):
                self.counters.errors += 1
            raise _converted(key, exc) from exc

    def _head_sync(self, key: str, path: Path) -> ObjectInfo:
        st = path.stat()
        if not path.is_file():
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        content_type = None
        if self._xattrs:
            try:
                content_type = os.getxattr(path, XATTR_CONTENT_TYPE).decode()
            except OSError:
                pass  # ENODATA: written without a content type; ENOTSUP: no xattrs here
        etag = _etag(path, st, self._xattrs)
        return ObjectInfo(key, st.st_size, etag, content_type, st.st_mtime_ns / 1e9)

    # ------------------------------------------------------------ listing
    async def list(
        self, prefix: str = "", start_after: str | None = None, limit: int | None = None
    ) -> AsyncIterator[ObjectInfo]:
        validate_prefix(prefix)
        if self._closed:
            raise RuntimeError("object store is closed")
        if limit is not None and limit <= 0:
            return
        self.counters.lists += 1
        # Start at the deepest directory that holds every match ("chunks/ab" -> "chunks/").
        base = prefix.rpartition("/")[0]
        left = limit
        async for info in self._walk(base + "/" if base else "", prefix, start_after):
            yield info
            if left is not None:
                left -= 1
                if left == 0:
                    return

    async def _walk(self, dir_key: str, prefix: str, start_after: str | None) -> AsyncIterator[ObjectInfo]:
        try:
            entries = await asyncio.to_thread(_scan, self.root / dir_key if dir_key else self.root, self._xattrs)
        except OSError as exc:
            if isinstance(exc, _MISSING):
                return  # nothing under this prefix
            self.counters.errors += 1
            raise _converted(dir_key or "/", exc) from exc
        for e in entries:
            key = dir_key + e.name
            if e.is_dir:
                sub = key + "/"
                # Skip subtrees that cannot hold a match, or whose keys all sort <= start_after.
                if not (sub.startswith(prefix) or prefix.startswith(sub)):
                    continue
                if start_after is not None and sub < start_after and not start_after.startswith(sub):
                    continue
                async for info in self._walk(sub, prefix, start_after):
                    yield info
            elif key.startswith(prefix) and (start_after is None or key > start_after):
                yield ObjectInfo(key, e.size, e.etag, None, e.mtime_ns / 1e9)
