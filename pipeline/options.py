"""The `ds3` data source's options, parsed and checked once, with errors that name the option.

Spark hands options over as a case-insensitive map of strings (`self.options`); copying it
with dict() lower-cases the keys, so every option name here is lower case.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from pipeline.store import LocalSyncStore, S3SyncStore, StoreURLError, open_sync_store
from shared import buckets, offsets, protocol
from shared.errors import BadRequest

MiB: Final = 1024 * 1024
READ_OPTIONS: Final = frozenset({
    "store", "endpoint_url", "region", "access_key_id", "secret_access_key", "session_token",
    "stream", "bucket", "stream_id", "prefix", "start_offset", "end_offset", "start_offsets",
    "end_offsets", "include_tail", "url", "token", "partition_bytes", "max_chunks_per_trigger", "path",
})
WRITE_OPTIONS: Final = frozenset({
    "url", "token", "stream", "bucket", "stream_id", "content_type", "create", "batch_bytes", "producer_id",
    "path",
})


class OptionError(ValueError):
    """A bad `ds3` data source option; the message names it."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"ds3 data source option {name!r}: {problem}")
        self.option = name


def _known_options(options: Mapping[str, str], known: frozenset[str]) -> dict[str, str]:
    """The options by lower-case name; OptionError for the first (sorted) name not in `known`."""
    opts = {k.lower(): v for k, v in dict(options).items()}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise OptionError(unknown[0], f"unknown option (known: {', '.join(sorted(known))})")
    return opts


def _flag(opts: dict[str, str], name: str) -> bool:
    raw = opts.get(name, "false").strip().lower()
    if raw not in ("true", "false"):
        raise OptionError(name, f"must be true or false, not {raw!r}")
    return raw == "true"


def _positive(opts: dict[str, str], name: str, default: int | None) -> int | None:
    raw = opts.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit() or int(raw) < 1:
        raise OptionError(name, f"must be a positive integer, not {raw!r}")
    return int(raw)


def _offset(name: str, raw: str) -> offsets.Offset | None:
    """None for -1 (the start)."""
    if raw.strip() == offsets.START:
        return None
    try:
        return offsets.parse(raw.strip())
    except offsets.OffsetSyntaxError as e:
        raise OptionError(name, str(e)) from None


def _url(name: str, raw: str) -> str:
    if not raw.startswith(("http://", "https://")):
        raise OptionError(name, f"must be an http(s) base URL like http://host:4437, not {raw!r}")
    return raw.rstrip("/")


@dataclass(frozen=True, slots=True)
class Selection:
    """Which streams: named ones (internal paths), or every stream under an internal prefix."""

    paths: tuple[str, ...] | None
    path_prefix: str | None


def _selection(opts: dict[str, str]) -> Selection:
    stream, bucket, stream_id, prefix = (opts.get(k) for k in ("stream", "bucket", "stream_id", "prefix"))
    stream = stream if stream is not None else opts.get("path")  # .load(path) sets "path"
    try:
        if bucket is not None:
            buckets.validate_bucket_id(bucket)
            if stream is not None:
                raise OptionError("stream", "give either stream (a plain path) or bucket + stream_id")
            if stream_id is not None:
                if prefix is not None:
                    raise OptionError("prefix", "give either stream_id or prefix with bucket")
                buckets.validate_stream_id(bucket, stream_id)
                return Selection((buckets.internal_path(bucket, stream_id),), None)
            return Selection(None, buckets.bucket_key_prefix(bucket) + (prefix or ""))
    except BadRequest as e:
        raise OptionError("bucket" if "bucket" in str(e) else "stream_id", str(e)) from None
    if stream_id is not None:
        raise OptionError("stream_id", "needs the bucket option")
    if stream is not None:
        if prefix is not None:
            raise OptionError("prefix", "give either stream or prefix")
        try:
            protocol.validate_stream_path(stream.removeprefix(protocol.STREAM_PREFIX), 4096)
        except BadRequest as e:
            raise OptionError("stream", str(e)) from None
        return Selection((stream.removeprefix(protocol.STREAM_PREFIX),), None)
    if prefix is not None:
        return Selection(None, prefix)
    raise OptionError("stream", "name what to read: stream, bucket + stream_id, bucket, or prefix")


def _offset_map(opts: dict[str, str], name: str, selection: Selection) -> dict[str, offsets.Offset | None]:
    """{stream URL path: offset}, each key a stream the read selects, spelled as the rows'
    streams are (a key naming none was ignored: a typo read everything; found by QA)."""
    raw = opts.get(name)
    if raw is None:
        return {}
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if not isinstance(obj, dict) or not all(isinstance(v, str) for v in obj.values()):
        raise OptionError(name, 'must be a JSON object {"<stream URL path>": "<offset>", ...}')
    return {_selected_url_path(name, str(k), selection): _offset(name, v) for k, v in obj.items()}


def _selected_url_path(name: str, key: str, selection: Selection) -> str:
    try:
        path = buckets.path_of_stream_url(key, 4096, f"key {key!r}")
    except BadRequest as e:
        raise OptionError(name, str(e)) from None
    if (selection.paths is not None and path not in selection.paths) or (
            selection.path_prefix is not None and not path.startswith(selection.path_prefix)):
        raise OptionError(name, f"key {key!r} names no stream this read selects")
    return buckets.url_path(path)


@dataclass(frozen=True)
class ReadOptions:
    store: LocalSyncStore | S3SyncStore
    selection: Selection
    include_tail: bool
    url: str | None
    token: str | None  # bearer token for the reader / ingester (README "Deploying with auth")
    partition_bytes: int
    max_chunks_per_trigger: int | None
    # per stream (keyed by URL path, e.g. /v1/stream/a or /v1/buckets/b/s); a single named
    # stream's start_offset / end_offset land here too. None: from the start.
    start: dict[str, offsets.Offset | None] = field(default_factory=dict)
    end: dict[str, offsets.Offset | None] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        opts = _known_options(options, READ_OPTIONS)
        if "store" not in opts:
            raise OptionError("store", "required: s3://bucket/prefix or file:///path (as ds3 --store)")
        try:
            store = open_sync_store(
                opts["store"], endpoint_url=opts.get("endpoint_url"), region=opts.get("region"),
                access_key_id=opts.get("access_key_id"), secret_access_key=opts.get("secret_access_key"),
                session_token=opts.get("session_token"),
            )
        except StoreURLError as e:
            raise OptionError("store", str(e)) from None
        if isinstance(store, LocalSyncStore) and not store.root.is_dir():  # a typo would read "nothing"
            raise OptionError("store", f"{opts['store']}: no such directory")
        selection = _selection(opts)
        start = _offset_map(opts, "start_offsets", selection)
        end = _offset_map(opts, "end_offsets", selection)
        for single, many in (("start_offset", start), ("end_offset", end)):
            if single in opts:
                if selection.paths is None or len(selection.paths) != 1:
                    raise OptionError(single, f"needs one named stream; use {single}s for several")
                many[buckets.url_path(selection.paths[0])] = _offset(single, opts[single])
        include_tail = _flag(opts, "include_tail")
        url = _url("url", opts["url"]) if "url" in opts else None
        if include_tail and url is None:
            raise OptionError("url", "include_tail=true needs the url of a ds3 reader or ingester")
        return cls(
            store=store, selection=selection, include_tail=include_tail, url=url, token=opts.get("token"),
            # as Spark's file sources (spark.sql.files.maxPartitionBytes): each task costs a
            # Python hand-over on both sides, about 0.1 s of CPU, so tasks should be large
            partition_bytes=_positive(opts, "partition_bytes", 128 * MiB) or 128 * MiB,
            max_chunks_per_trigger=_positive(opts, "max_chunks_per_trigger", None),
            start=start, end=end,
        )


@dataclass(frozen=True)
class WriteOptions:
    url: str
    token: str | None
    path: str  # internal path
    content_type: str | None
    create: bool
    batch_bytes: int
    producer_id: str | None

    @property
    def url_path(self) -> str:
        return buckets.url_path(self.path)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        opts = _known_options(options, WRITE_OPTIONS)
        if "url" not in opts:
            raise OptionError("url", "required: the base URL of a ds3 reader or ingester")
        selection = _selection({k: v for k, v in opts.items() if k != "prefix"} | (
            {"prefix": opts["prefix"]} if "prefix" in opts else {}))
        if selection.paths is None:
            raise OptionError("stream", "the writer appends to one stream: stream, or bucket + stream_id")
        content_type = opts.get("content_type")
        if content_type is not None and not protocol.is_valid_content_type(content_type):
            raise OptionError("content_type", f"not a valid content type: {content_type!r}")
        create = _flag(opts, "create")
        producer_id = opts.get("producer_id")
        if producer_id is not None and not producer_id.strip():
            raise OptionError("producer_id", "must not be empty")
        return cls(
            url=_url("url", opts["url"]), token=opts.get("token"), path=selection.paths[0],
            content_type=content_type,
            create=create, batch_bytes=_positive(opts, "batch_bytes", MiB) or MiB,
            producer_id=producer_id,
        )
