"""The log segment object: group commits of the ingester's WAL, in commit order (issue 14).

Every group commit's effect on the LMDB write-ahead log (ingester/wal.py) is a list of
writes (ingester/logged_txn.py records them as LMDB applies them); a segment holds the
write-sets of consecutive commits, so that replaying segments in order over a checkpoint
rebuilds the WAL exactly (ingester/replay.py).

    offset 0                                                                        48
    +----------+-------------+-------------+-------------+----------+-------+-------+
    | magic    | version     | commits     | length      | epoch    | first | last  |  prelude
    | DS3WLOG1 | u32 BE (=2) | u32 BE  (N) | u64 BE  (L) | u64 BE   | u64   | u64   |  48 bytes
    +----------+-------------+-------------+-------------+----------+-------+-------+
    | commit 1 .. N, in commit order:                                              |
    |   +---------+-------------+                                                  |
    |   | seq u64 | writes u32  |  then W writes:                                  |
    |   +---------+-------------+                                                  |
    |     +------+------+--------------+----------------+-------+---------+        |
    |     | db u8| op u8| key len u32  | value len u32  | key   | value   |        |
    |     +------+------+--------------+----------------+-------+---------+        |
    +------------------------------------------------------------------------------+
    | crc32 u32 BE of bytes [0, L - 4)                                             |  trailer
    +------------------------------------------------------------------------------+

    length: L, the whole segment in bytes, trailer included (a cut segment says so)
    epoch:  the writer's ownership epoch (fencing: a later step fills it in; 0 until then)
    first, last: seq of the first and last commit; seqs rise strictly (gaps are allowed
            here: whoever replays checks continuity across segments)
    db:     which named database (DB_IDS below: the ids are part of the format)
    op:     PUT (key := value), DELETE (key; value empty), CLEAR (every key of the
            database; key and value empty), FOLD (db: the journal; key and value empty:
            every journal record moved into `records`, and `journal` and `jtail` emptied,
            as ingester/journal.py's fold_all does; replay runs the same fold)
    version: 2 (1: no FOLD; a fold was logged as a PUT of every moved record and two
            CLEARs, the messages' bytes a second time. Both versions decode.)

Both lengths come before the bytes so each write's header is one struct. All integers are
big-endian. The checksum is zlib's CRC-32 (no CRC32C implementation ships with the server;
shared/chunks.py carries none): it catches a torn or cut upload and any 1-bit error.

Pure module: no aiohttp, lmdb or aiobotocore. Deterministic: the same commits and epoch
encode to the same bytes, so uploading a segment again after a crash writes an identical
object. Object keys (`segment_key`) sort in commit order:
`<prefix>log/<first seq, 20 digits>-<last seq, 20 digits>.seg`.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

MAGIC: Final = b"DS3WLOG1"
VERSION: Final = 2
VERSIONS: Final = (1, 2)  # what decode reads
_PRELUDE: Final = struct.Struct(">8sIIQQQQ")
_COMMIT: Final = struct.Struct(">QI")
_WRITE: Final = struct.Struct(">BBII")
_CRC: Final = struct.Struct(">I")
PRELUDE_SIZE: Final = _PRELUDE.size  # 48
COMMIT_HEADER_SIZE: Final = _COMMIT.size  # 12
WRITE_HEADER_SIZE: Final = _WRITE.size  # 10
TRAILER_SIZE: Final = _CRC.size  # 4
MAX_SEQ: Final = 2**64 - 1

assert PRELUDE_SIZE == 48 and COMMIT_HEADER_SIZE == 12 and WRITE_HEADER_SIZE == 10

# The WAL's named databases (ingester/records.py, journal.py), by id. Never renumber: segments
# already in the store name databases by these ids.
DB_IDS: Final[dict[str, int]] = {
    "streams": 1, "records": 2, "journal": 3, "jtail": 4,
    "producers": 5, "chunks": 6, "sys": 7, "buckets": 8,
}
DB_NAMES: Final[dict[int, str]] = {v: k for k, v in DB_IDS.items()}

PUT: Final = 1
DELETE: Final = 2
CLEAR: Final = 3
FOLD: Final = 4  # version 2 on
OP_NAMES: Final[dict[int, str]] = {PUT: "put", DELETE: "delete", CLEAR: "clear", FOLD: "fold"}

# (db id, op, key, value): one write, as LMDB applied it. A plain tuple: the recorder makes
# one per LMDB write on the hot path.
Write = tuple[int, int, bytes, bytes]


class Commit(NamedTuple):
    seq: int  # the commit's sequence number (rises by one per logged commit)
    writes: Sequence[Write]  # in the order LMDB applied them


class LogSegmentError(ValueError):
    """The bytes are not a valid log segment (or the commits given to encode cannot be one)."""


@dataclass(frozen=True, slots=True)
class Segment:
    epoch: int
    commits: list[Commit]

    @property
    def first_seq(self) -> int:
        return self.commits[0].seq

    @property
    def last_seq(self) -> int:
        return self.commits[-1].seq


def _check_write(seq: int, i: int, write: Write) -> None:
    if len(write) != 4:
        raise LogSegmentError(f"commit {seq}, write {i}: not a (db, op, key, value) tuple")
    db, op, key, value = write
    if db not in DB_NAMES:
        raise LogSegmentError(f"commit {seq}, write {i}: unknown database id {db!r}")
    if op not in OP_NAMES:
        raise LogSegmentError(f"commit {seq}, write {i}: unknown op {op!r}")
    if not isinstance(key, bytes) or not isinstance(value, bytes):
        raise LogSegmentError(f"commit {seq}, write {i}: key and value must be bytes")
    if op != PUT and value:
        raise LogSegmentError(f"commit {seq}, write {i}: a {OP_NAMES[op]} carries no value")
    if op in (CLEAR, FOLD) and key:
        raise LogSegmentError(f"commit {seq}, write {i}: a {OP_NAMES[op]} carries no key")
    if op == FOLD and db != DB_IDS["journal"]:
        raise LogSegmentError(f"commit {seq}, write {i}: a fold is of the journal, not of {DB_NAMES[db]}")
    if len(key) > 0xFFFFFFFF or len(value) > 0xFFFFFFFF:
        raise LogSegmentError(f"commit {seq}, write {i}: key or value longer than 4 GiB")


def encode(commits: Sequence[Commit], epoch: int = 0) -> bytes:
    """The segment holding `commits` (at least one, seqs strictly rising), written by a log
    owner at `epoch`."""
    if not commits:
        raise LogSegmentError("a segment holds at least one commit")
    if not 0 <= epoch <= MAX_SEQ:
        raise LogSegmentError(f"epoch {epoch} does not fit a u64")
    if len(commits) > 0xFFFFFFFF:
        raise LogSegmentError("too many commits for one segment")
    parts: list[bytes] = [b""]  # the prelude, once the length is known
    prev = 0
    pack_write = _WRITE.pack
    for seq, writes in commits:
        if not 0 < seq <= MAX_SEQ:
            raise LogSegmentError(f"commit seq {seq} is not a positive u64")
        if seq <= prev:
            raise LogSegmentError(f"commit seq {seq} does not follow {prev}")
        if len(writes) > 0xFFFFFFFF:
            raise LogSegmentError(f"commit {seq}: too many writes")
        prev = seq
        parts.append(_COMMIT.pack(seq, len(writes)))
        for i, write in enumerate(writes):
            _check_write(seq, i, write)
            db, op, key, value = write
            parts.append(pack_write(db, op, len(key), len(value)))
            parts.append(key)
            if value:
                parts.append(value)
    length = PRELUDE_SIZE + sum(len(p) for p in parts) + TRAILER_SIZE
    parts[0] = _PRELUDE.pack(MAGIC, VERSION, len(commits), length, epoch, commits[0].seq, commits[-1].seq)
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def parse_prelude(b: bytes | memoryview) -> tuple[int, int, int, int, int]:
    """(commits, length, epoch, first seq, last seq) from a segment's first PRELUDE_SIZE bytes
    (more are ignored): enough to list a segment without reading it all."""
    if len(b) < PRELUDE_SIZE:
        raise LogSegmentError(f"truncated prelude: {len(b)} of {PRELUDE_SIZE} bytes")
    magic, version, count, length, epoch, first, last = _PRELUDE.unpack_from(b)
    if magic != MAGIC:
        raise LogSegmentError(f"not a ds3 log segment (magic {bytes(magic)!r})")
    if version not in VERSIONS:
        raise LogSegmentError(f"unsupported log segment version {version}")
    if count == 0:
        raise LogSegmentError("segment claims no commits")
    if length < PRELUDE_SIZE + count * COMMIT_HEADER_SIZE + TRAILER_SIZE:
        raise LogSegmentError(f"implausible segment length {length} for {count} commits")
    if not 0 < first <= last:
        raise LogSegmentError(f"implausible commit seqs {first}..{last}")
    return count, length, epoch, first, last


def decode(data: bytes | memoryview) -> Segment:
    """A whole segment: its epoch and commits. Raises LogSegmentError on anything but an
    intact segment (truncated, extended, bad magic or version, checksum mismatch)."""
    view = memoryview(data).cast("B")
    count, length, epoch, first, last = parse_prelude(view)
    version = _PRELUDE.unpack_from(view)[1]
    if len(view) < length:
        raise LogSegmentError(f"truncated segment: {len(view)} of {length} bytes")
    if len(view) > length:
        raise LogSegmentError(f"{len(view) - length} bytes after the segment's end")
    end = length - TRAILER_SIZE
    (stored,) = _CRC.unpack_from(view, end)
    if zlib.crc32(view[:end]) != stored:
        raise LogSegmentError("segment checksum mismatch (torn or corrupted)")
    # The checksum matched: the checks below guard against a buggy writer, not the network.
    commits: list[Commit] = []
    at = PRELUDE_SIZE
    prev = 0
    unpack_write = _WRITE.unpack_from
    for n in range(count):
        if at + COMMIT_HEADER_SIZE > end:
            raise LogSegmentError(f"commit {n}: header runs past the segment's end")
        seq, nwrites = _COMMIT.unpack_from(view, at)
        at += COMMIT_HEADER_SIZE
        if seq <= prev:
            raise LogSegmentError(f"commit seq {seq} does not follow {prev}")
        prev = seq
        writes: list[Write] = []
        for i in range(nwrites):
            if at + WRITE_HEADER_SIZE > end:
                raise LogSegmentError(f"commit {seq}, write {i}: header runs past the segment's end")
            db, op, klen, vlen = unpack_write(view, at)
            at += WRITE_HEADER_SIZE
            if at + klen + vlen > end:
                raise LogSegmentError(f"commit {seq}, write {i}: bytes run past the segment's end")
            write = (db, op, bytes(view[at : at + klen]), bytes(view[at + klen : at + klen + vlen]))
            at += klen + vlen
            _check_write(seq, i, write)
            if op == FOLD and version < 2:
                raise LogSegmentError(f"commit {seq}, write {i}: a fold in a version {version} segment")
            writes.append(write)
        commits.append(Commit(seq, writes))
    if at != end:
        raise LogSegmentError(f"{end - at} unparsed bytes after the last commit")
    if commits[0].seq != first or commits[-1].seq != last:
        raise LogSegmentError(f"prelude says commits {first}..{last}, "
                              f"body holds {commits[0].seq}..{commits[-1].seq}")
    return Segment(epoch, commits)


# --- object keys ---------------------------------------------------------------------------

LOG_DIR: Final = "log/"
_KEY_RE: Final = re.compile(r"(\d{20})-(\d{20})\.seg")


def segment_key(first_seq: int, last_seq: int, prefix: str = "") -> str:
    """The object key of the segment holding commits first_seq..last_seq; keys sort in
    commit order (fixed-width numbers)."""
    if not 0 < first_seq <= last_seq <= MAX_SEQ:
        raise ValueError(f"invalid commit range {first_seq}..{last_seq}")
    return f"{prefix}{LOG_DIR}{first_seq:020d}-{last_seq:020d}.seg"


def parse_segment_key(key: str, prefix: str = "") -> tuple[int, int] | None:
    """(first seq, last seq) of a segment key under `prefix`; None for any other key."""
    head = prefix + LOG_DIR
    if not key.startswith(head):
        return None
    m = _KEY_RE.fullmatch(key, len(head))
    if m is None:
        return None
    first, last = int(m.group(1)), int(m.group(2))
    if not 0 < first <= last <= MAX_SEQ:
        return None
    return first, last
