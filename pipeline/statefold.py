"""Folding Durable Streams state-protocol messages into the state they describe (for
`ds3 pipeline compact`), on Spark.

Which messages count (@durable-streams/state, STATE-PROTOCOL.md §4-5; `upsert` is accepted
as well, as ds3 always has):

- a change message is a JSON object whose `type` and `key` are non-empty strings, whose
  `headers.operation` is insert, update, upsert or delete, and which has a `value` (any JSON,
  null included) unless it is a delete;
- a control message is a JSON object whose `headers.control` is snapshot-start, snapshot-end
  or reset: `reset` clears the state before it, the other two only mark boundaries;
- anything else is not a state-protocol message. The fold counts them and names the first;
  compact refuses to publish then, because publishing a snapshot makes the history before it
  unreadable (retention), and a snapshot that silently left messages out would lose them.

The fold keeps, per (type, key), the last change message by position; a delete drops the
entity. Rows carry a `where` column that names them in an error ("offset ..." for stream
messages, the entry of the previous snapshot for those).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

OPERATIONS = ("insert", "update", "upsert", "delete")
CONTROLS = ("snapshot-start", "snapshot-end", "reset")


@dataclass(frozen=True)
class Folded:
    entities: list[str]  # one `insert` event per live (type, key), in that order (JSON text)
    events: int  # change messages folded (those after the last reset)
    controls: int  # control messages (reset, snapshot-start, snapshot-end)
    invalid: int  # messages that are not state-protocol messages
    first_invalid: str | None  # the first of them: "<where>: <what is wrong>"


def _problem(value: Column) -> Column:
    """Null for a state-protocol message, else what is wrong with it. Variant functions tell
    a JSON string from a number (get_json_object and from_json spell both as text)."""
    v = F.try_parse_json(value)

    def kind(path: str) -> Column:
        return F.schema_of_variant(F.try_variant_get(v, path, "variant"))

    def text(path: str) -> Column:
        return F.try_variant_get(v, path, "string")

    def nonempty_string(path: str) -> Column:
        return F.coalesce((kind(path) == "STRING") & (text(path) != ""), F.lit(False))

    has_control = kind("$.headers.control").isNotNull()
    return (
        F.when(v.isNull(), "not valid JSON (or an object with a duplicate key)")
        .when(~value.rlike(r"^\s*\{"), "not a JSON object")
        .when(has_control & F.coalesce(text("$.headers.control").isin(*CONTROLS), F.lit(False)), F.lit(None))
        .when(has_control, "headers.control is not one of " + ", ".join(CONTROLS))
        .when(~F.coalesce(text("$.headers.operation").isin(*OPERATIONS), F.lit(False)),
              "neither headers.operation (" + ", ".join(OPERATIONS) + ") nor headers.control")
        .when(~nonempty_string("$.type"), "type is not a non-empty string")
        .when(~nonempty_string("$.key"), "key is not a non-empty string")
        .when((text("$.headers.operation") != "delete") & kind("$.value").isNull(), "a change without a value")
    )


def fold(rows: DataFrame, stop_at_invalid: bool = False) -> Folded:
    """Fold `rows` (columns position, where, value). With `stop_at_invalid`, a fold that
    finds a message that is not a state-protocol message stops there (no entities)."""
    v = F.try_parse_json("value")
    parsed = rows.select(
        "position", "where", "value", _problem(F.col("value")).alias("problem"),
        F.try_variant_get(v, "$.type", "string").alias("type"),
        F.try_variant_get(v, "$.key", "string").alias("key"),
        F.try_variant_get(v, "$.headers.operation", "string").alias("op"),
        F.try_variant_get(v, "$.headers.control", "string").alias("control"),
    ).cache()
    try:
        valid, problem = F.col("problem").isNull(), F.col("problem").isNotNull()
        control = valid & F.col("control").isNotNull()
        stats = parsed.agg(
            F.max(F.when(control & (F.col("control") == "reset"), F.col("position"))).alias("reset"),
            F.count(F.when(problem, 1)).alias("invalid"),
            F.count(F.when(control, 1)).alias("controls"),
        ).first()
        assert stats is not None
        invalid, controls = int(stats["invalid"]), int(stats["controls"])
        first_invalid = None
        if invalid:
            first = parsed.where(problem).orderBy("position").select("where", "problem").first()
            assert first is not None
            first_invalid = f"{first['where']}: {first['problem']}"
            if stop_at_invalid:
                return Folded([], 0, controls, invalid, first_invalid)
        after = stats["reset"] if stats["reset"] is not None else -(1 << 62)
        changes = parsed.where(valid & F.col("control").isNull() & (F.col("position") > after))
        latest = changes.groupBy("type", "key").agg(
            F.max_by("value", "position").alias("value"), F.max_by("op", "position").alias("op"))
        live = latest.where(F.col("op") != "delete").orderBy("type", "key").collect()
        count = changes.count()
    finally:
        parsed.unpersist()
    out = []
    for row in live:
        event = json.loads(row["value"])
        snapshot_event = {"type": event["type"], "key": event["key"], "value": event.get("value"),
                          "headers": {"operation": "insert"}}
        out.append(json.dumps(snapshot_event, ensure_ascii=False, separators=(",", ":")))
    return Folded(out, count, controls, invalid, first_invalid)
