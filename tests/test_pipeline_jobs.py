"""`ds3 pipeline export` and `ds3 pipeline compact` (issue 5), run through the CLI on the
shared SparkSession (a job reuses an active session and leaves it running).

- export writes Parquet partitioned by stream and date that reads back as the data source's
  rows; a second run appends only what was sealed since; a run that finds a crashed run's
  pending record (rows written, offsets not saved) neither loses nor duplicates a message.
- compact folds a stream of state-protocol events into a snapshot and publishes it; bootstrap
  (snapshot + the updates after it) then equals a full replay, and the data source starts at
  the snapshot (the earliest retained offset).
"""

from __future__ import annotations

import email
import json
import re
import socket
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ds3.cli import main
from shared import offsets
from tests.pipeline_fixtures import PipelineEnv
from tests.test_pipeline_read import JSON, OCTET, TEXT, byte_bodies, json_bodies, write_closed

COLUMNS = ["stream", "offset", "next_offset", "message", "value", "position", "chunk"]


def run_cli(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output.strip().splitlines()[-1]))


def export_cli(env: PipelineEnv, out: Path, prefix: str = "exp/") -> dict[str, Any]:
    return run_cli("pipeline", "export", "--store", env.store.url, "--s3-endpoint", env.s3_endpoint,
                   "--prefix", prefix, "--output", str(out))


def exported(spark: Any, out: Path) -> list[tuple[Any, ...]]:
    df = spark.read.parquet(str(out))
    assert {"stream", "date"} <= set(df.columns)
    return sorted(tuple(r) for r in df.select(*COLUMNS).collect())


def from_source(env: PipelineEnv, spark: Any) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in env.read(spark, prefix="exp/").select(*COLUMNS).collect())


def test_export_round_trips_and_runs_incrementally(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, aws_env: None
) -> None:
    env, out = pipeline_env, tmp_path / "parquet"
    env.create("/v1/stream/exp/events", JSON)
    env.create("/v1/stream/exp/blobs", OCTET)
    env.append_all("/v1/stream/exp/events", json_bodies(60, 31), JSON)
    env.append_all("/v1/stream/exp/blobs", byte_bodies(30, 32, False), OCTET)
    env.wait_sealed("exp/events", 4096)
    first = export_cli(env, out)
    assert set(first["exported_up_to"]) == {"/v1/stream/exp/events", "/v1/stream/exp/blobs"}
    assert exported(spark, out) == from_source(env, spark)
    dirs = {p.name for p in out.iterdir() if p.is_dir()}
    assert dirs == {"stream=exp%2Fevents", "stream=exp%2Fblobs"}
    assert all(d.name.startswith("date=") for d in (out / "stream=exp%2Fevents").iterdir())

    # more sealed data: the second run appends only that
    env.append_all("/v1/stream/exp/events", json_bodies(60, 33), JSON)
    env.close("/v1/stream/exp/events")
    env.close("/v1/stream/exp/blobs")
    env.wait_sealed("exp/events", offsets.parse(env.pages("/v1/stream/exp/events")[-1].next_offset).position)
    env.wait_sealed("exp/blobs", offsets.parse(env.pages("/v1/stream/exp/blobs")[-1].next_offset).position)
    state_path = out / "_ds3_export_state.json"
    before = json.loads(state_path.read_text())
    second = export_cli(env, out)
    assert second["exported_up_to"]
    rows = exported(spark, out)
    assert rows == from_source(env, spark)
    assert len({r[1] for r in rows}) == len(rows)  # no offset twice
    assert export_cli(env, out)["exported_up_to"] == {}  # nothing new

    # a crash after the second run wrote its rows but before it saved its offsets
    after = json.loads(state_path.read_text())
    events_start = before["offsets"]["/v1/stream/exp/events"]
    state_path.write_text(json.dumps({"offsets": before["offsets"], "pending": {
        "ends": after["offsets"], "first": ["exp/events", offsets.parse(events_start).position]}}))
    assert export_cli(env, out)["exported_up_to"] == {}
    assert exported(spark, out) == rows
    assert json.loads(state_path.read_text())["offsets"] == after["offsets"]


def test_an_incremental_export_writes_only_what_is_new(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, aws_env: None
) -> None:
    """Three streams stay as they were and one grows: the second run writes the grown
    stream's new rows and nothing of the others (they were written again in full before)."""
    env, out = pipeline_env, tmp_path / "parquet"
    for name, ct, bodies in (("inc/a", JSON, json_bodies(30, 51)), ("inc/b", OCTET, byte_bodies(20, 52, False)),
                             ("inc/c", TEXT, byte_bodies(20, 53, True))):
        write_closed(env, f"/v1/stream/{name}", name, ct, bodies)
    grows = "/v1/stream/inc/grows"
    env.create(grows, JSON)
    env.append_all(grows, json_bodies(40, 54), JSON)
    env.wait_sealed("inc/grows", 4096)
    first = export_cli(env, out, "inc/")
    assert len(first["exported_up_to"]) == 4
    before = exported(spark, out)
    done = offsets.parse(first["exported_up_to"][grows]).position

    env.append_all(grows, json_bodies(40, 55), JSON)
    env.wait_sealed("inc/grows", done + 4096)
    second = export_cli(env, out, "inc/")
    assert list(second["exported_up_to"]) == [grows]
    rows = exported(spark, out)
    assert len({(r[0], r[1]) for r in rows}) == len(rows), "no message exported twice"
    new = sorted(set(rows) - set(before))
    assert len(rows) == len(before) + len(new) and {r[0] for r in new} == {"inc/grows"}
    state = json.loads((out / "_ds3_export_state.json").read_text())["offsets"]
    expected = env.read(spark, prefix="inc/", end_offsets=json.dumps(state)).select(*COLUMNS).collect()
    assert rows == sorted(tuple(r) for r in expected)


def test_a_stream_created_again_is_exported_from_its_start(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, aws_env: None
) -> None:
    """Deleted and created again at the same path, a stream is another stream (another uid):
    the offsets saved for the old one do not apply, whether the new one is longer or shorter."""
    env, out = pipeline_env, tmp_path / "parquet"
    for name, seed in (("again/longer", 61), ("again/shorter", 62)):
        write_closed(env, f"/v1/stream/{name}", name, JSON, json_bodies(12, seed))
    assert len(export_cli(env, out, "again/")["exported_up_to"]) == 2
    before = exported(spark, out)

    env.recreate("again/longer", JSON, json_bodies(30, 63))
    env.recreate("again/shorter", JSON, json_bodies(3, 64))
    second = export_cli(env, out, "again/")
    assert set(second["exported_up_to"]) == {"/v1/stream/again/longer", "/v1/stream/again/shorter"}
    new = Counter(exported(spark, out)) - Counter(before)
    assert new == Counter(tuple(r) for r in env.read(spark, prefix="again/").select(*COLUMNS).collect())
    assert export_cli(env, out, "again/")["exported_up_to"] == {}


def replay(events: list[dict[str, Any]], state: dict[tuple[str, str], Any] | None = None) -> dict[tuple[str, str], Any]:
    """The state protocol's materialization (as @durable-streams/state's MaterializedState,
    plus `reset` clearing the state)."""
    state = {} if state is None else state
    for e in events:
        headers = e.get("headers", {})
        if headers.get("control") == "reset":
            state.clear()
        elif headers.get("operation") in ("insert", "update", "upsert"):
            state[(e["type"], e["key"])] = e["value"]
        elif headers.get("operation") == "delete":
            state.pop((e["type"], e["key"]), None)
    return state


def state_events(n: int, seed: int) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        key = f"k{rng.randint(0, 40)}"
        op = rng.choice(["insert", "update", "update", "delete"])
        event: dict[str, Any] = {"type": rng.choice(["user", "cart"]), "key": key, "headers": {"operation": op}}
        if op != "delete":
            event["value"] = {"n": i, "tags": ["a,b", "]"], "name": f"é{i}"}
        out.append(event)
        if i == n // 3:
            out.append({"headers": {"control": "reset"}})
    return out


def compact_cli(env: PipelineEnv, stream: str, *extra: str) -> dict[str, Any]:
    return run_cli("pipeline", "compact", "--store", env.store.url, "--s3-endpoint", env.s3_endpoint,
                   "--stream", stream, "--url", env.url, *extra)


def bootstrap(env: PipelineEnv, url_path: str) -> tuple[str, list[Any], list[Any]]:
    """(snapshot offset, the snapshot's events, the messages after it) from /bootstrap."""
    with urllib.request.urlopen(f"{env.url}{url_path}/bootstrap", timeout=10) as r:
        content_type, body, offset = r.headers["Content-Type"], r.read(), r.headers["Stream-Snapshot-Offset"]
    msg = email.message_from_bytes(f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    parts = [p.get_payload(decode=True) for p in msg.get_payload()]  # type: ignore[union-attr]
    return offset, json.loads(parts[0]), [json.loads(p) for p in parts[1:]]


def test_compact_then_bootstrap_equals_full_replay(pipeline_env: PipelineEnv, spark: Any, aws_env: None) -> None:
    env, url_path = pipeline_env, "/v1/stream/compact/state"
    events = state_events(400, 41)
    env.create(url_path, JSON)
    env.append_all(url_path, [json.dumps(events[i : i + 7]).encode() for i in range(0, len(events), 7)], JSON)
    result = run_cli("pipeline", "compact", "--store", env.store.url, "--s3-endpoint", env.s3_endpoint,
                     "--stream", "compact/state", "--url", env.url)
    assert result["published"] and result["entities"] == len(replay(events))
    later = state_events(50, 42)
    env.append_all(url_path, [json.dumps(later).encode()], JSON)

    snapshot_offset, snapshot, after = bootstrap(env, url_path)
    assert snapshot_offset == result["snapshot_offset"]
    assert all(e["headers"]["operation"] == "insert" for e in snapshot)
    booted = replay(after, replay(snapshot))
    assert booted == replay(events + later)

    with pytest.raises(urllib.error.HTTPError) as gone:  # retention: history before it is gone
        urllib.request.urlopen(f"{env.url}{url_path}?offset=-1", timeout=10)
    assert gone.value.code == 410
    rows = sorted(env.read(spark, stream="compact/state", include_tail="true", url=env.url).collect(),
                  key=lambda r: r.position)
    assert rows[0].offset == result["snapshot_offset"]
    assert [json.loads(r.value) for r in rows] == later


def test_a_stream_that_is_not_there_is_an_error_message_not_a_traceback(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, aws_env: None
) -> None:
    env = pipeline_env
    for args in (["export", "--stream", "nowhere", "--output", str(tmp_path / "out")],
                 ["compact", "--stream", "nowhere", "--url", env.url]):
        result = CliRunner().invoke(main, ["pipeline", *args, "--store", env.store.url,
                                           "--s3-endpoint", env.s3_endpoint])
        assert result.exit_code == 1, (args, result.output)
        assert "Error: stream 'nowhere' not found in store" in result.output, result.output
        assert "Traceback" not in result.output and result.exception is not None
        assert isinstance(result.exception, SystemExit)


def change(op: str, key: str, value: Any = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "cart", "key": key, "headers": {"operation": op}}
    if op != "delete":
        event["value"] = value
    return event


def test_a_second_compact_keeps_what_the_first_snapshot_holds(pipeline_env: PipelineEnv, aws_env: None) -> None:
    """The first compact's snapshot replaced the history before it (retention): the second
    folds that snapshot and the events after it, not only the events after it."""
    env, url_path = pipeline_env, "/v1/stream/compact/twice"
    env.create(url_path, JSON)
    first_events = [change("insert", "a", 1), change("insert", "b", 2), change("update", "a", 3), change("delete", "b")]
    env.append_all(url_path, [json.dumps(first_events).encode()], JSON)
    first = compact_cli(env, "compact/twice")
    assert first["entities"] == 1

    env.append_all(url_path, [json.dumps([change("insert", "c", 4)]).encode()], JSON)
    second = compact_cli(env, "compact/twice")
    offset, snapshot, after = bootstrap(env, url_path)
    assert offset == second["snapshot_offset"] and after == []
    assert replay(snapshot) == {("cart", "a"): 3, ("cart", "c"): 4}
    assert second["entities"] == 2
    assert (first["from_snapshot"], second["from_snapshot"]) == (None, first["snapshot_offset"])

    # a reset after the snapshot clears what it holds, as it would for a client replaying
    later = [{"headers": {"control": "reset"}}, change("upsert", "d", 5), {"headers": {"control": "snapshot-end"}}]
    env.append_all(url_path, [json.dumps(later).encode()], JSON)
    third = compact_cli(env, "compact/twice")
    assert (third["entities"], third["controls"], third["invalid"]) == (1, 2, 0)
    assert replay(bootstrap(env, url_path)[1]) == {("cart", "d"): 5}


def test_compact_refuses_a_stream_of_other_messages(pipeline_env: PipelineEnv, aws_env: None) -> None:
    """A JSON stream whose messages are not state-protocol messages: compact publishes nothing
    (a snapshot of `[]` would have made every message unreadable) and names the first
    offending message; --dry-run counts them."""
    env, url_path = pipeline_env, "/v1/stream/compact/other"
    env.create(url_path, JSON)
    messages = [{"x": 1}, {"x": 2}, {"type": "t", "key": "k", "value": 1}, change("insert", "ok", 1)]
    env.append_all(url_path, [json.dumps(messages).encode()], JSON)

    result = CliRunner().invoke(main, ["pipeline", "compact", "--store", env.store.url, "--s3-endpoint",
                                       env.s3_endpoint, "--stream", "compact/other", "--url", env.url])
    assert result.exit_code == 1, result.output
    assert "3 message(s) that are not state-protocol" in result.output
    assert re.search(r"first: offset [0-9]{16}_0{16}: neither headers\.operation", result.output)
    assert "neither headers.operation" in result.output and "Traceback" not in result.output
    assert [m for p in env.pages(url_path) if p.body for m in json.loads(p.body)] == messages  # nothing gone
    with urllib.request.urlopen(f"{env.url}{url_path}/bootstrap", timeout=10) as r:
        assert r.headers["Stream-Snapshot-Offset"] == "-1"

    dry = compact_cli(env, "compact/other", "--dry-run")
    assert (dry["published"], dry["invalid"], dry["events"], dry["entities"]) == (False, 3, 1, 1)
    assert re.fullmatch(r"offset [0-9]{16}_0{16}: neither headers\.operation .*", dry["first_invalid"])


@pytest.mark.parametrize("message, problem", [
    ('"just a string"', "not a JSON object"),
    ('{"type": "t", "key": 7, "value": 1, "headers": {"operation": "insert"}}', "key is not a non-empty string"),
    ('{"type": "", "key": "k", "value": 1, "headers": {"operation": "insert"}}', "type is not a non-empty string"),
    ('{"type": "t", "key": "k", "headers": {"operation": "update"}}', "a change without a value"),
    ('{"headers": {"control": "rewind"}}', "headers.control is not one of"),
])
def test_the_state_protocol_rule(spark: Any, message: str, problem: str) -> None:
    from pipeline.statefold import fold

    good = json.dumps(change("insert", "a", 1))
    rows = spark.createDataFrame([(0, "offset A", good), (1, "offset B", message), (2, "offset C", message)],
                                 "position long, where string, value string")
    folded = fold(rows)
    assert (folded.invalid, folded.events) == (2, 1)
    assert folded.first_invalid is not None and folded.first_invalid.startswith(f"offset B: {problem}")


@pytest.mark.parametrize("case", ["garbage offset", "nobody at --url", "no store directory"])
def test_bad_arguments_are_one_error_line_not_a_traceback(
    pipeline_env: PipelineEnv, tmp_path: Path, aws_env: None, case: str
) -> None:
    env, stream = pipeline_env, "cli/errors-" + case.replace(" ", "-").strip("-")
    env.create(f"/v1/stream/{stream}", JSON)
    env.append_all(f"/v1/stream/{stream}", [json.dumps([change("insert", "a", 1)]).encode()], JSON)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"
    compact = ["compact", "--store", env.store.url, "--s3-endpoint", env.s3_endpoint, "--stream", stream]
    args, message = {
        "garbage offset": ([*compact, "--url", env.url, "--offset", "garbage"],
                           "option 'offset': malformed offset 'garbage'"),
        "nobody at --url": ([*compact, "--url", nobody], f"HEAD {nobody}/v1/stream/{stream}: no answer"),
        "no store directory": (["export", "--store", f"file://{tmp_path}/nonexistent", "--prefix", "x",
                                "--output", str(tmp_path / "out")],
                               f"option 'store': file://{tmp_path}/nonexistent: no such directory"),
    }[case]
    result = CliRunner().invoke(main, ["pipeline", *args])
    assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.output
    assert message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()
