"""What the server knows of one writer task's idempotent producer, and the mark a task leaves
when it has appended all of its rows (pipeline/writer.py).

The server keeps, per producer id, only an epoch and the last sequence number: a request it
answers 204 for (a duplicate) may hold other rows than the one it took, and nothing in the
answer says so. A job re-run with the same producer_id over an input that grew (the last input
partition has more rows now) sent its first request, now bigger, under the same (id, 0, 0):
204, and the new rows were never appended.

So a task's *last* request goes out under a new epoch that describes the whole partition:

    epoch = 1 + rows * 2^22 + fingerprint (22 bits of a BLAKE2b of the rows, in order)

(rows < 2^30, so the epoch stays below 2^53 as the protocol requires). Every other request is
(epoch 0, seq 0, 1, ...), cut by size, so it depends only on the rows before it. Before
appending, a task asks which state its producer is in (`probe`: a request with a sequence
number far ahead, which the server refuses without appending anything, saying either the seq it
expects next or, with 403, the epoch it is at):

- nothing, or epoch 0: no attempt finished; the requests an earlier attempt got in come back
  204 (same rows, same cuts) and the rest are appended;
- a completed epoch: an earlier attempt or run appended `rows` rows with that fingerprint.
  The task checks that its first `rows` rows have it (else the input changed: it fails, naming
  the cause) and appends only the rows after them (under that epoch, seq 1, 2, ...), then marks
  the partition complete again with the new count. A re-run over the same input appends
  nothing; over an input that grew at the end, exactly the new rows.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from pipeline.http import Client, HTTPError
from shared import protocol as P

ROW_BITS = 30
FINGERPRINT_BITS = 22
PROBE_SEQ = P.MAX_SAFE_INTEGER  # never the next seq of a real producer: always refused


class InputChanged(RuntimeError):
    """The rows of a partition are not the ones an earlier run of this producer appended."""


class ProducerRaced(RuntimeError):
    """Another attempt of the task moved the producer on meanwhile (Spark retries the task,
    whose probe then sees what that attempt did)."""


@dataclass
class Fingerprint:
    """A running fingerprint of rows in order."""

    rows: int = 0
    _hash: hashlib.blake2b = field(default_factory=lambda: hashlib.blake2b(digest_size=8))

    def add(self, data: bytes) -> None:
        self._hash.update(struct.pack(">Q", len(data)))  # length-prefixed: no two row lists collide
        self._hash.update(data)
        self.rows += 1

    @property
    def value(self) -> int:
        return int.from_bytes(self._hash.digest(), "big") & ((1 << FINGERPRINT_BITS) - 1)


def completion_epoch(rows: int, fingerprint: int) -> int:
    if rows >= 1 << ROW_BITS:
        raise ValueError(f"a ds3 writer task takes at most 2^{ROW_BITS} rows: repartition the input")
    return 1 + (rows << FINGERPRINT_BITS) + fingerprint


@dataclass(frozen=True)
class Completed:
    """An earlier attempt or run appended `rows` rows with `fingerprint`, at `epoch`."""

    epoch: int

    @property
    def rows(self) -> int:
        return (self.epoch - 1) >> FINGERPRINT_BITS

    @property
    def fingerprint(self) -> int:
        return (self.epoch - 1) & ((1 << FINGERPRINT_BITS) - 1)


@dataclass(frozen=True)
class InProgress:
    """No attempt completed: the server expects `next_seq` next at epoch 0."""

    next_seq: int


def probe(client: Client, url_path: str, producer_id: str, content_type: str, body: bytes) -> Completed | InProgress:
    """The producer's state, from a request the server refuses without appending (`body`: a
    valid one-message body for the stream, never appended)."""
    r = client.append(url_path, body, content_type, (producer_id, 0, PROBE_SEQ))
    expected = r.headers.get(P.PRODUCER_EXPECTED_SEQ.lower())
    if r.status == 409 and expected is not None:
        return InProgress(int(expected))
    epoch = r.headers.get(P.PRODUCER_EPOCH.lower())
    if r.status == 403 and epoch is not None and int(epoch) > 0:
        return Completed(int(epoch))
    raise HTTPError("POST", client.base + url_path, r.status, r.body)
