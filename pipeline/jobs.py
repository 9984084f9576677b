"""The `ds3 pipeline` jobs, as functions of a SparkSession (pipeline/cli.py wraps them).

export   streams -> Parquet partitioned by stream and date (the day their chunk was sealed),
         incrementally: a state file remembers each stream's exported offset, and a run reads
         only the sealed chunks after it. The run first records what it is about to write
         ("pending"), has Spark write it into a staging directory of its own, records it as
         staged, moves the files into the output and commits the state; a run that finds a
         pending record finishes the move (staged) or drops the staging (not staged), so a
         crash anywhere neither loses nor duplicates a message.

compact  a JSON stream of state-change events (the Durable Streams state protocol, as in
         @durable-streams/state: {"type", "key", "value", "headers": {"operation"}}) folded
         up to an offset into its materialized state, published as a snapshot
         (PUT {url}/v1/stream/{path}/snapshot/{offset}, extensions §2). The snapshot is a JSON
         array of `insert` events, one per live (type, key), so a client that applies it and
         then the updates after the offset (what /bootstrap returns) ends in the same state
         as a full replay. A stream that has a snapshot already is read from it (the history
         before it is gone), so the fold starts from that snapshot's entries. A message that is
         not a state-protocol message (pipeline/statefold.py) makes compact refuse to publish.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pipeline import jvm
from pipeline.catalog import Catalog, check_bucket, display_name, resolve
from pipeline.http import Client, HTTPError
from pipeline.options import OptionError, ReadOptions
from pipeline.statefold import fold
from pipeline.store import check_store
from shared import offsets
from shared import protocol as P
from shared.buckets import url_path

STATE_FILE = "_ds3_export_state.json"
STAGING_DIR = "_ds3_export_staging"  # a run's files before they move into the output (`_`: not data)


# ---------------------------------------------------------------- export
@dataclass(frozen=True)
class ExportResult:
    streams: dict[str, str]  # stream URL path -> the offset exported up to (this run's new ones)
    state_path: Path


def _position(offset: str | None) -> int:
    return 0 if not offset or offset == offsets.START else offsets.parse(offset).position


def _load_state(path: Path) -> dict[str, Any]:
    """offsets: URL path -> exported up to; uids: URL path -> the uid of the stream those
    offsets belong to (a state file from before uids were kept has none: taken as the same
    incarnation); pending: what a run was writing (see export)."""
    if not path.exists():
        return {"offsets": {}, "uids": {}, "pending": None}
    state = json.loads(path.read_text())
    return {"offsets": dict(state.get("offsets", {})), "uids": dict(state.get("uids", {})),
            "pending": state.get("pending")}


def _save_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _has_data(output: Path) -> bool:
    """Whether `output` holds a file Spark would read as data (not `_`- or `.`-named, nor in
    such a directory: the state file, `_SUCCESS`, `_temporary/`, the staging directory)."""
    for _dirpath, dirs, files in os.walk(output):
        dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
        if any(not f.startswith(("_", ".")) for f in files):
            return True
    return False


def _pending_written(spark: SparkSession, output: Path, pending: dict[str, Any]) -> bool:
    """Whether the run that recorded `pending` got its rows into the output: a record of an
    earlier version, which wrote into the output directly (Spark committing a file write as a
    whole, one stream's first new row told)."""
    if not pending.get("first") or not _has_data(output):  # (a first run that died before its write)
        return False
    stream, position, *since = pending["first"]
    found = spark.read.parquet(str(output)).where((F.col("stream") == stream) & (F.col("position") >= position))
    if since:  # rows of an earlier incarnation of the stream (deleted, created again) do not count
        found = found.where(F.col("sealed_at") >= F.timestamp_seconds(F.lit(since[0] - 0.001)))
    return bool(found.limit(1).count())


def _publish(staged: Path, output: Path) -> None:
    """Move the files Spark committed under `staged` to the same place under `output`, each
    with one rename (their names are unique to the run). Again after a crash: what is still
    there moves, what moved already is not there any more."""
    for dirpath, dirs, files in os.walk(staged):
        dirs[:] = [d for d in dirs if d != "_temporary"]
        rel = Path(dirpath).relative_to(staged)
        for f in sorted(files):
            if rel == Path() and f.startswith("_"):  # _SUCCESS
                continue
            (output / rel).mkdir(parents=True, exist_ok=True)
            os.replace(Path(dirpath) / f, output / rel / f)


def _recover(spark: SparkSession, output: Path, state_path: Path, state: dict[str, Any]) -> None:
    """Finish or undo what a run that died left (a pending record; its staging directory)."""
    pending = state["pending"]
    if pending:
        if "run" in pending:  # staged: its files all reach the output; else none of them does
            written = bool(pending.get("staged"))
            if written:
                _publish(output / STAGING_DIR / pending["run"], output)
        else:
            written = _pending_written(spark, output, pending)
            shutil.rmtree(output / "_temporary", ignore_errors=True)  # its uncommitted tasks
        if written:
            state["offsets"].update(pending["ends"])
            state["uids"].update(pending.get("uids", {}))
        state["pending"] = None
        _save_state(state_path, state)
    shutil.rmtree(output / STAGING_DIR, ignore_errors=True)  # runs that died before their commit


def export(spark: SparkSession, read_options: dict[str, str], output: Path,
           state_path: Path | None = None) -> ExportResult:
    """Append every sealed message after the saved offsets to Parquet under `output`,
    partitioned by `stream` and `date`; save the new offsets."""
    opts = ReadOptions.parse(read_options)  # before anything is created: a bad option leaves nothing behind
    check_store(opts.store)  # a wrong endpoint, bucket or credentials: an error in seconds
    catalog = Catalog(opts.store)
    descs = resolve(catalog, opts.selection.paths, opts.selection.path_prefix)
    if not descs:
        check_bucket(catalog, opts.selection.paths, opts.selection.path_prefix)
    output = output.resolve()
    state_path = state_path or output / STATE_FILE
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state = _load_state(state_path)
    _recover(spark, output, state_path, state)
    # A stream deleted and created again at the same path is another stream (another uid): the
    # offsets saved for the old one say nothing about it, and it is exported from its start.
    saved_uids: dict[str, str] = state["uids"]
    renewed = {url_path(d.path) for d in descs if saved_uids.get(url_path(d.path), d.uid) != d.uid}
    done: dict[str, str] = {k: v for k, v in state["offsets"].items() if k not in renewed}
    # planned from where the last run stopped: a periodic export reads only the new chunks' headers
    plans = catalog.plans(descs, {k: offsets.parse(v) for k, v in done.items() if v != offsets.START})
    # Streams with sealed messages to read: past the exported offset and past the earliest
    # retained one (a stream whose snapshot is at its sealed end has none).
    ends = {p.url_path: p.sealed_end_offset for p in plans
            if p.sealed_end > max(_position(done.get(p.url_path)), p.earliest)}
    if not ends:
        return ExportResult({}, state_path)
    # The read uses the user's selection (a prefix or a bucket), so every stream it finds needs
    # bounds: one missing from start_offsets/end_offsets would be read from its start to its
    # sealed end (an unchanged stream exported again in full). Unchanged streams get the empty
    # range [done, done); a stream created after this planning is filtered out by name (the
    # next run exports it).
    starts = {p.url_path: done[p.url_path] for p in plans if p.url_path in done}
    stops = {p.url_path: ends.get(p.url_path) or done.get(p.url_path) or p.sealed_end_offset for p in plans}
    names = sorted({display_name(p.path)[1] for p in plans if p.url_path in ends})
    uids = {p.url_path: p.uid for p in plans if p.url_path in ends}
    # Exactly once: Spark writes the run's files into a staging directory of their own (a
    # crash there leaves nothing in the output); the state then records them as staged, they
    # move into the output one rename each, and the offsets are committed. A run that finds
    # the record staged moves what is left and commits; not staged, it drops the staging.
    run = uuid.uuid4().hex
    staged = output / STAGING_DIR / run
    state["pending"] = {"ends": ends, "uids": uids, "run": run}
    _save_state(state_path, state)
    df = (jvm.load(spark, {**read_options, "start_offsets": json.dumps(starts), "end_offsets": json.dumps(stops)})
          .where(F.col("stream").isin(names))
          .withColumn("date", F.to_date("sealed_at")))
    df.write.mode("append").partitionBy("stream", "date").parquet(str(staged))
    state["pending"]["staged"] = True
    _save_state(state_path, state)
    _publish(staged, output)
    state["offsets"].update(ends)
    state["uids"].update(uids)
    state["pending"] = None
    _save_state(state_path, state)
    shutil.rmtree(output / STAGING_DIR, ignore_errors=True)
    return ExportResult(ends, state_path)


# ---------------------------------------------------------------- compact
class CompactRefused(RuntimeError):
    """compact will not publish: the stream is not (only) state-protocol messages, or its
    snapshot changed while the fold ran."""


@dataclass(frozen=True)
class CompactResult:
    offset: str  # the snapshot's offset: it covers [-1, offset)
    entities: int
    events: int  # change messages folded (the previous snapshot's entries included)
    snapshot: bytes
    controls: int = 0
    invalid: int = 0  # messages that are not state-protocol messages (only a dry run gets here with some)
    first_invalid: str | None = None
    base: str | None = None  # the previous snapshot the fold started from


def _snapshot_rows(spark: SparkSession, client: Client, url_path: str, offset: str) -> DataFrame:
    """The previous snapshot's entries as rows before the stream's first retained message
    (negative positions, in their order): the history they stand for is gone (retention), so
    the new snapshot is the old one plus what came after it."""
    body = client.snapshot(url_path, offset)
    try:
        entries = json.loads(body)
    except ValueError:
        entries = None
    if not isinstance(entries, list):
        raise CompactRefused(f"the stream's snapshot at {offset} is not a JSON array of state-protocol "
                             f"messages, so compact cannot extend it")
    n = len(entries)
    data = [(i - n, f"entry {i} of the snapshot at {offset}", json.dumps(e, ensure_ascii=False))
            for i, e in enumerate(entries)]
    return spark.createDataFrame(data, "position long, where string, value string")


def compact(spark: SparkSession, read_options: dict[str, str], url: str, offset: str | None = None,
            publish: bool = True) -> CompactResult:
    """Fold the stream up to `offset` (default: its tail now), starting from its current
    snapshot if it has one, and publish the result as the new snapshot. Refuses (nothing
    published) when a message is not a state-protocol message (pipeline/statefold.py)."""
    opts = ReadOptions.parse({**read_options, "url": url})
    if opts.selection.paths is None or len(opts.selection.paths) != 1:
        raise OptionError("stream", "compact works on one stream: stream (--stream), or bucket + stream_id "
                          "(--bucket and --stream-id)")
    check_store(opts.store)
    catalog = Catalog(opts.store)
    plan = catalog.plan(resolve(catalog, opts.selection.paths, None)[0])
    if not P.is_json(plan.content_type):
        raise OptionError("stream", f"compact needs a JSON stream of state events, not {plan.content_type}")
    client = Client(url, opts.token)
    try:
        upto = offset or client.tail_offset(plan.url_path)
        try:
            stop = offsets.parse(upto)  # a concrete offset: the snapshot is named by it
        except offsets.OffsetSyntaxError as e:
            raise OptionError("offset", str(e)) from None
        base = client.snapshot_offset(plan.url_path)
        if base is not None and stop.position < offsets.parse(base).position:
            raise OptionError("offset", f"{upto} is before the stream's snapshot at {base}: the history "
                                        f"before that is gone")
        read = {**read_options, "include_tail": "true", "url": url, "end_offsets": json.dumps({plan.url_path: upto})}
        if base is not None:
            read["start_offsets"] = json.dumps({plan.url_path: base})
        rows = spark.read.format("ds3").options(**read).load().select(
            "position", F.concat(F.lit("offset "), "offset").alias("where"), "value")
        if base is not None:
            rows = _snapshot_rows(spark, client, plan.url_path, base).unionByName(rows)
        folded = fold(rows, stop_at_invalid=publish)
        if folded.invalid and publish:
            raise CompactRefused(
                f"{plan.url_path} holds {folded.invalid} message(s) that are not state-protocol change or "
                f"control messages (first: {folded.first_invalid}); nothing published (a snapshot would "
                f"make the history before it unreadable). --dry-run counts them")
        body = ("[" + ",".join(folded.entities) + "]").encode()
        if publish:
            if client.snapshot_offset(plan.url_path) != base:  # another compact published meanwhile
                raise CompactRefused(f"{plan.url_path}: a snapshot was published while this one was folded "
                                     f"(it started from {base or 'the stream start'}); run compact again")
            target = f"{plan.url_path}/snapshot/{quote(upto, safe='')}"
            r = client.request("PUT", target, body=body, headers={"Content-Type": "application/json"})
            if r.status not in (200, 201, 204):
                raise HTTPError("PUT", url + target, r.status, r.body)
    finally:
        client.close()
    return CompactResult(upto, len(folded.entities), folded.events, body, folded.controls, folded.invalid,
                         folded.first_invalid, base)
