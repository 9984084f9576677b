"""`df.write.format("ds3")`: append rows to a stream through the protocol, exactly once.

Each task appends its partition's rows in requests of about `batch_bytes` (1 MiB): a JSON
array of the rows' values for a JSON stream (one message per row), the rows' bytes back to back
for other streams (one append per request). Every request carries idempotent-producer headers:

    Producer-Id     <job id>/<partition id>   job id: producer_id option, else random per write
    Producer-Epoch  0
    Producer-Seq    0, 1, 2, ... per request of the task

A retried or speculative attempt of a task recomputes the same rows in the same order, so
its requests repeat the same (id, epoch, seq) with the same bodies, and the server answers
204 (duplicate, not appended) for every one an earlier attempt got in; concurrent attempts
interleave harmlessly. The epoch deliberately does NOT follow the attempt number: a new epoch
restarts the sequence and the server would append the retry's batches a second time.
The attempt number is reported in the task's commit message instead.
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
from shared import protocol as P


@dataclass
class AppendReport(WriterCommitMessage):
    partition: int
    attempt: int
    requests: int  # appended (200)
    duplicates: int  # already appended by an earlier attempt (204)
    rows: int


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
            if r.status != 200:
                raise HTTPError("HEAD", opts.url + opts.url_path, r.status, r.body)
            self.content_type = r.headers.get("content-type", P.DEFAULT_CONTENT_TYPE)
        finally:
            client.close()
        self.json = P.is_json(self.content_type)

    def _bodies(self, rows: Iterator[Row]) -> Iterator[tuple[bytes, int]]:
        """Request bodies of about batch_bytes, and how many rows each holds."""
        limit = self.opts.batch_bytes
        parts: list[bytes] = []
        size = 0
        for row in rows:
            raw = row[self.column]
            if raw is None:
                continue
            data = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
            if parts and size + len(data) + 1 > limit:
                yield self._body(parts), len(parts)
                parts, size = [], 0
            parts.append(data)
            size += len(data) + 1
        if parts:
            yield self._body(parts), len(parts)

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
            for seq, (body, n) in enumerate(self._bodies(iterator)):
                r = client.append(self.opts.url_path, body, self.content_type, (producer_id, 0, seq))
                if r.status == 200:
                    report.requests += 1
                elif r.status == 204:
                    report.duplicates += 1
                else:
                    raise HTTPError("POST", self.opts.url + self.opts.url_path, r.status, r.body)
                report.rows += n
        finally:
            client.close()
        return report

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every task's appends are already durable; nothing to do."""

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Appends cannot be taken back: a failed job leaves what its tasks appended (a
        re-run with the same producer_id option does not append those batches twice)."""
