"""`df.write.format("ds3")`: append rows to a stream through the protocol, exactly once.

Each task appends its partition's rows in requests of about `batch_bytes` (1 MiB): a JSON
array of the rows' values for a JSON stream (one message per row), the rows' bytes back to back
for other streams (one append per request). Every request carries idempotent-producer headers:

    Producer-Id     <job id>/<partition id>   job id: producer_id option, else random per write
    Producer-Epoch  0; the task's last request: an epoch that says how many rows the task
                    appended and their fingerprint (pipeline/producer.py)
    Producer-Seq    0, 1, 2, ... per request of the task

A retried or speculative attempt of a task recomputes the same rows in the same order, so
its requests repeat the same (id, epoch, seq) with the same bodies, and the server answers
204 (duplicate, not appended) for every one an earlier attempt got in; concurrent attempts
interleave harmlessly. The epoch does NOT follow the attempt number: a new epoch restarts the
sequence and the server would append the retry's batches a second time. The attempt number is
reported in the task's commit message instead. A task whose producer was completed before (a
re-run with the same producer_id) checks its rows against that completion and appends only the
rows after those, or fails when its rows are not the ones appended then.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from pyspark import TaskContext
from pyspark.sql import Row
from pyspark.sql.datasource import DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from pipeline.http import Client, HTTPError
from pipeline.options import OptionError, WriteOptions
from pipeline.producer import (
    Completed,
    Fingerprint,
    InProgress,
    InputChanged,
    ProducerRaced,
    completion_epoch,
    probe,
)
from shared import protocol as P


@dataclass
class AppendReport(WriterCommitMessage):
    partition: int
    attempt: int
    requests: int  # appended (200)
    duplicates: int  # already appended by an earlier attempt (204)
    rows: int  # rows sent
    skipped: int = 0  # rows an earlier attempt or run had appended completely (not sent again)


def _column(schema: StructType) -> str:
    fields = {f.name: f.dataType for f in schema.fields}
    if isinstance(fields.get("message"), BinaryType):
        return "message"
    if isinstance(fields.get("value"), StringType):
        return "value"
    raise OptionError("columns", f"the ds3 writer needs a binary 'message' or a string 'value' column; "
                                 f"got {', '.join(fields) or 'none'}")


class DS3Writer(DataSourceWriter):
    def __init__(self, opts: WriteOptions, schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise OptionError("mode", "ds3 streams are append-only: use mode('append')")
        self.opts = opts
        self.column = _column(schema)
        self.job_id = opts.producer_id or f"spark-{uuid.uuid4().hex}"
        client = Client(opts.url, opts.token)
        try:
            if opts.create:
                client.create(opts.url_path, opts.content_type or P.DEFAULT_CONTENT_TYPE)
            r = client.request("HEAD", opts.url_path)
            if r.status == 404:  # (a HEAD's 404 has no body to say why: found by QA)
                raise OptionError("stream", f"{opts.url + opts.url_path} does not exist: create it first, or write "
                                  "with the option create=true")
            if r.status != 200:
                raise HTTPError("HEAD", opts.url + opts.url_path, r.status, r.body)
            self.content_type = r.headers.get("content-type", P.DEFAULT_CONTENT_TYPE)
        finally:
            client.close()
        self.json = P.is_json(self.content_type)

    def _data(self, rows: Iterator[Row]) -> Iterator[bytes]:
        for row in rows:
            raw = row[self.column]
            if raw is not None:
                yield raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)

    def _bodies(self, rows: Iterator[bytes]) -> Iterator[tuple[bytes, int, bool]]:
        """Request bodies of about batch_bytes, how many rows each holds, and whether it is the
        last. A body is cut when the next row does not fit, so every body but the last
        depends only on the rows up to it (the same on a retry, or on a re-run whose input
        grew at the end)."""
        limit = self.opts.batch_bytes
        parts: list[bytes] = []
        size = 0
        for data in rows:
            if parts and size + len(data) + 1 > limit:
                yield self._body(parts), len(parts), False
                parts, size = [], 0
            parts.append(data)
            size += len(data) + 1
        if parts:
            yield self._body(parts), len(parts), True

    def _body(self, parts: list[bytes]) -> bytes:
        return b"[" + b",".join(parts) + b"]" if self.json else b"".join(parts)

    def write(self, iterator: Iterator[Row]) -> AppendReport:
        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx else 0
        attempt = ctx.attemptNumber() if ctx else 0
        producer_id = f"{self.job_id}/{partition}"
        client = Client(self.opts.url, self.opts.token)
        report = AppendReport(partition, attempt, 0, 0, 0)
        try:
            state = probe(client, self.opts.url_path, producer_id, self.content_type, self._body([b"0"]))
            fingerprint = Fingerprint()
            done = state if isinstance(state, Completed) else None
            rows = self._after_completed(self._data(iterator), fingerprint, done, producer_id)
            epoch, first_seq = (done.epoch, 1) if done else (0, 0)
            for seq, (body, n, last) in enumerate(self._bodies(rows), first_seq):
                if last and not (isinstance(state, InProgress) and seq < state.next_seq):
                    # (a producer an older ds3 writer left at epoch 0 already holds this one)
                    producer = (producer_id, completion_epoch(fingerprint.rows, fingerprint.value), 0)
                else:
                    producer = (producer_id, epoch, seq)
                r = client.append(self.opts.url_path, body, self.content_type, producer)
                if r.status == 200:
                    report.requests += 1
                elif r.status == 204:
                    report.duplicates += 1
                elif r.status == 403:
                    raise ProducerRaced(f"producer {producer_id!r}: another attempt of this task moved it to "
                                        f"epoch {r.headers.get(P.PRODUCER_EPOCH.lower())}; retry")
                else:
                    raise HTTPError("POST", self.opts.url + self.opts.url_path, r.status, r.body)
                report.rows += n
            report.skipped = done.rows if done else 0
        finally:
            client.close()
        return report

    def _after_completed(self, rows: Iterator[bytes], fingerprint: Fingerprint, done: Completed | None,
                         producer_id: str) -> Iterator[bytes]:
        """The rows to send: all of them, or, when an earlier run completed this producer,
        those after the rows it appended, once the first ones are checked to be those."""
        skip = done.rows if done else 0
        for data in rows:
            fingerprint.add(data)
            if fingerprint.rows < skip:
                continue
            if fingerprint.rows == skip and done is not None:
                if fingerprint.value != done.fingerprint:
                    raise self._changed(producer_id, skip, "its first rows differ")
                continue
            yield data
        if fingerprint.rows < skip:
            raise self._changed(producer_id, skip, f"this input has only {fingerprint.rows}")

    def _changed(self, producer_id: str, rows: int, how: str) -> InputChanged:
        return InputChanged(
            f"ds3 writer: producer {producer_id!r} appended {rows} rows of another input before ({how}): "
            f"a producer_id stands for one input, which may only grow at the end of its last partition. "
            f"Nothing of this partition was appended (other tasks of this job may have appended theirs: with the "
            f"same producer_id a re-run must partition its input as the run before did). Write with a new "
            f"producer_id (and only the rows not written yet, e.g. read from the previous run's end offset), or with "
            f"the input it had")

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every task's appends are already durable; nothing to do."""

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Appends cannot be taken back: a failed job leaves what its tasks appended (a
        re-run with the same producer_id option does not append those batches twice)."""
