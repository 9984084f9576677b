"""`ds3 pipeline` bugs QA found, on the shared SparkSession and servers (tests/pipeline_fixtures.py):

- export of a selection whose first stream was compacted at its tail (nothing to read) exports
  the others (it raised StopIteration);
- an export killed after it recorded what it was about to write ("pending") is finished or
  undone by the next run, exactly once: killed by SIGKILL (a real `ds3 pipeline export`
  process) before and during Spark's write, and the states a kill leaves during the move of
  the staged files into the output (a first run's killed export used to make every later run
  fail with UNABLE_TO_INFER_SCHEMA);
- object store errors (no such S3 bucket, no or bad credentials, an endpoint nobody listens
  on) are one error line and exit status 1, not a botocore traceback;
- `--bucket` naming a bucket the store has no stream of is an error, not "nothing new".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ds3.cli import main
from shared import offsets
from tests.pipeline_fixtures import PipelineEnv
from tests.s3server import CLEARED_ENV, TEST_ENV
from tests.test_pipeline_jobs import COLUMNS, change, compact_cli, export_cli, exported
from tests.test_pipeline_read import JSON, OCTET, byte_bodies, json_bodies, write_closed

DS3 = str(Path(sys.executable).with_name("ds3"))
STATE = "_ds3_export_state.json"


def source_rows(env: PipelineEnv, spark: Any, prefix: str) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in env.read(spark, prefix=prefix).select(*COLUMNS).collect())


def assert_exactly_once(env: PipelineEnv, spark: Any, out: Path, prefix: str) -> None:
    rows = exported(spark, out)
    assert Counter(rows) == Counter(source_rows(env, spark, prefix)), "each message exactly once"
    assert export_cli(env, out, prefix)["exported_up_to"] == {}  # and the state says so
    assert not (out / "_ds3_export_staging").exists() and not (out / "_temporary").exists()


def data_files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and not p.name.startswith(("_", ".")))


# ---------------------------------------------------------------- 1. compacted at its tail
def test_a_stream_compacted_at_its_tail_contributes_nothing(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, aws_env: None
) -> None:
    """`tail/a` (first of the selection) has a snapshot at its sealed end: its earliest
    retained offset is its tail, nothing to read. `tail/b` exports as usual."""
    from pipeline.catalog import Catalog
    from pipeline.store import open_sync_store

    env, out = pipeline_env, tmp_path / "parquet"
    events = [change("insert", f"k{i}", {"n": i, "pad": "x" * 200}) for i in range(60)]
    env.create("/v1/stream/tail/a", JSON)
    end = env.append_all("/v1/stream/tail/a", [json.dumps(events[i:i + 6]).encode() for i in range(0, 60, 6)], JSON)
    env.wait_sealed("tail/a", 4096)
    write_closed(env, "/v1/stream/tail/b", "tail/b", OCTET, byte_bodies(20, 71, False))
    assert compact_cli(env, "tail/a", "--offset", end)["snapshot_offset"] == end

    opts = env.source_options()
    catalog = Catalog(open_sync_store(opts.pop("store"), **opts))

    def compacted() -> bool:
        desc = catalog.descriptor("tail/a")
        return desc is not None and getattr(desc, "snapshot_offset", None) == end
    deadline = time.monotonic() + 20
    while not compacted():
        assert time.monotonic() < deadline, "the snapshot never reached the descriptor in the store"
        time.sleep(0.1)
    desc = catalog.descriptor("tail/a")
    assert desc is not None
    plan = catalog.plan(desc)
    assert plan.earliest == offsets.parse(end).position and plan.sealed_end == plan.earliest  # nothing to read

    result = export_cli(env, out, "tail/")
    assert list(result["exported_up_to"]) == ["/v1/stream/tail/b"]
    assert {r[0] for r in exported(spark, out)} == {"tail/b"}
    assert_exactly_once(env, spark, out, "tail/")


# ---------------------------------------------------------------- 2. a killed export
def two_streams(env: PipelineEnv, prefix: str) -> None:
    write_closed(env, f"/v1/stream/{prefix}x", f"{prefix}x", JSON, json_bodies(40, 81))
    write_closed(env, f"/v1/stream/{prefix}y", f"{prefix}y", OCTET, byte_bodies(30, 82, False))


def test_a_first_export_killed_after_its_pending_record_is_redone(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, aws_env: None
) -> None:
    """The state an export of an earlier version leaves when killed on its first run right
    after recording its pending write: the output directory holds the state file only."""
    env, prefix = pipeline_env, "killed/"
    two_streams(env, prefix)
    scratch = tmp_path / "scratch"
    done = export_cli(env, scratch, prefix)["exported_up_to"]
    saved = json.loads((scratch / STATE).read_text())
    out = tmp_path / "parquet"
    out.mkdir()
    (out / STATE).write_text(json.dumps({"offsets": {}, "uids": {}, "pending": {
        "ends": done, "uids": saved["uids"], "first": [f"{prefix}x", 0, time.time() - 3600]}}))
    (out / "_temporary" / "0").mkdir(parents=True)  # Spark's job directory, as a killed write leaves it

    assert export_cli(env, out, prefix)["exported_up_to"] == done
    assert_exactly_once(env, spark, out, prefix)


@pytest.fixture
def export_env(aws_env: None) -> dict[str, str]:
    """The environment of a `ds3 pipeline export` process: moto's credentials, this checkout
    first on the path, Spark on the loopback."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    root = str(Path(__file__).resolve().parents[1])
    env.update(TEST_ENV, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
               SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    return env


def pending_in(out: Path) -> bool:
    try:
        return bool(json.loads((out / STATE).read_text()).get("pending"))
    except (OSError, ValueError):
        return False


def writing_in(out: Path) -> bool:
    """The pending write is recorded and a task of it has produced a Parquet file (in Spark's
    temporary directories, or the run's staging)."""
    return pending_in(out) and any(p.name.endswith(".parquet") and "/_" in str(p.relative_to(out.parent))
                                   for p in out.rglob("*"))


@pytest.mark.parametrize("when", ["pending recorded", "tasks writing"])
def test_an_export_killed_midway_is_redone_exactly_once(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, export_env: dict[str, str], when: str
) -> None:
    """A real `ds3 pipeline export` process (its own Spark driver), SIGKILLed as soon as its
    state file records the pending write, or as soon as a task has written a Parquet file;
    the next run leaves every message in the output once. Then the same once more on an
    output that holds a first run's rows (the second run killed)."""
    env, prefix = pipeline_env, "sigkill/" + when.split()[0] + "/"
    two_streams(env, prefix)
    out = tmp_path / "parquet"
    cmd = [DS3, "pipeline", "export", "--master", "local[1]", "--store", env.store.url,
           "--s3-endpoint", env.s3_endpoint, "--prefix", prefix, "--output", str(out)]
    ready = pending_in if when == "pending recorded" else writing_in

    def kill_midway() -> None:
        log = (tmp_path / "export.log").open("wb")
        proc = subprocess.Popen(cmd, env=export_env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)  # its JVM too: the whole group is killed
        try:
            deadline = time.monotonic() + 120
            while not ready(out):
                assert proc.poll() is None, f"export ended first: {(tmp_path / 'export.log').read_text()[-3000:]}"
                assert time.monotonic() < deadline, "no pending write after 120 s"
                time.sleep(0.005)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            log.close()
        assert pending_in(out), "killed before its commit"

    kill_midway()
    first = export_cli(env, out, prefix)["exported_up_to"]
    assert set(first) == {f"/v1/stream/{prefix}x", f"/v1/stream/{prefix}y"}
    assert_exactly_once(env, spark, out, prefix)

    write_closed(env, f"/v1/stream/{prefix}z", f"{prefix}z", JSON, json_bodies(30, 83))
    kill_midway()
    assert list(export_cli(env, out, prefix)["exported_up_to"]) == [f"/v1/stream/{prefix}z"]
    assert_exactly_once(env, spark, out, prefix)


@pytest.fixture
def staged_run(pipeline_env: PipelineEnv, tmp_path: Path, aws_env: None) -> Iterator[tuple[Path, list[Path], str]]:
    """(output, the run's data files, prefix): what an export leaves when killed after Spark
    committed its files into the staging directory (their names unique to the run). The
    files are a real export's, of the same streams, made in a scratch directory."""
    env, prefix = pipeline_env, f"staged/{tmp_path.name[-12:]}/"
    two_streams(env, prefix)
    scratch = tmp_path / "scratch"
    done = export_cli(env, scratch, prefix)["exported_up_to"]
    saved = json.loads((scratch / STATE).read_text())
    out = tmp_path / "parquet"
    staging = out / "_ds3_export_staging" / "run1"
    staging.mkdir(parents=True)
    files = data_files(scratch)
    assert len(files) >= 2
    for f in files:
        (staging / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(scratch / f, staging / f)
    (staging / "_SUCCESS").write_bytes(b"")
    (out / STATE).write_text(json.dumps({"offsets": {}, "uids": {}, "pending": {
        "ends": done, "uids": saved["uids"], "run": "run1"}}))
    yield out, files, prefix


def test_killed_after_spark_committed_before_it_said_staged(
    pipeline_env: PipelineEnv, spark: Any, staged_run: tuple[Path, list[Path], str]
) -> None:
    """The staged files are not recorded as complete: they are dropped, the rows written again."""
    out, _, prefix = staged_run
    assert len(export_cli(pipeline_env, out, prefix)["exported_up_to"]) == 2
    assert_exactly_once(pipeline_env, spark, out, prefix)


@pytest.mark.parametrize("moved", [0, 1, "all"])
def test_killed_while_moving_the_staged_files(
    pipeline_env: PipelineEnv, spark: Any, staged_run: tuple[Path, list[Path], str], moved: int | str
) -> None:
    """Recorded as staged, killed after moving none, some or all of the files into the
    output: the next run moves the rest and commits the offsets."""
    out, files, prefix = staged_run
    state = json.loads((out / STATE).read_text())
    state["pending"]["staged"] = True
    (out / STATE).write_text(json.dumps(state))
    staging = out / "_ds3_export_staging" / "run1"
    for f in files[: len(files) if moved == "all" else int(moved)]:
        (out / f).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / f, out / f)
    assert export_cli(pipeline_env, out, prefix)["exported_up_to"] == {}  # the killed run's, adopted
    assert data_files(out) == files
    assert_exactly_once(pipeline_env, spark, out, prefix)


# ---------------------------------------------------------------- 3. object store errors
def port_in_range() -> int:
    """A free port of 5700-5799 on the loopback."""
    for port in range(5700, 5800):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 5700-5799")


@pytest.fixture(scope="module")
def checking_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto server (its own process) that checks credentials: only IAM users' keys pass."""
    port = port_in_range()
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env.update(TEST_ENV, INITIAL_NO_AUTH_ACTION_COUNT="0")
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", ["export", "compact"])
@pytest.mark.parametrize("case", ["no such S3 bucket", "endpoint unreachable", "no credentials", "bad credentials"])
def test_object_store_errors_are_one_line(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, aws_env: None, request: pytest.FixtureRequest,
    case: str, command: str
) -> None:
    env = pipeline_env
    store, endpoint, environ = env.store.url, env.s3_endpoint, {}
    if case == "no such S3 bucket":
        store, message = "s3://no-such-bucket-here/ds3", "S3 bucket 'no-such-bucket-here' does not exist"
    elif case == "endpoint unreachable":
        endpoint = f"http://127.0.0.1:{free_port()}"
        message = f"at {endpoint} unreachable: Could not connect to the endpoint URL"
    elif case == "no credentials":
        environ = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
        message = "Unable to locate credentials"
    else:
        endpoint = request.getfixturevalue("checking_s3")
        message = "refused the credentials: 403 InvalidAccessKeyId"
    args = {"export": ["--prefix", "x/", "--output", str(tmp_path / "out")],
            "compact": ["--stream", "x/y", "--url", env.url]}[command]
    started = time.monotonic()
    result = CliRunner().invoke(main, ["pipeline", command, "--store", store, "--s3-endpoint", endpoint, *args],
                                env=environ)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: object store "), result.output
    assert message in lines[0] and "check --store" in lines[0], result.output
    assert time.monotonic() - started < 20  # the clients' retries would take a minute
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 4. --bucket
def test_a_bucket_the_store_has_no_stream_of_is_an_error(
    pipeline_env: PipelineEnv, spark: Any, tmp_path: Path, aws_env: None
) -> None:
    env, out = pipeline_env, tmp_path / "out"
    base = ["pipeline", "export", "--store", env.store.url, "--s3-endpoint", env.s3_endpoint, "--output", str(out)]
    result = CliRunner().invoke(main, [*base, "--bucket", "nope"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert result.output.strip() == (f"Error: bucket 'nope' not found in store {env.store.url}: no stream of it is "
                                     f"there (a bucket with no stream yet has nothing to read either)")
    assert not out.exists()

    # a bucket with streams, a --prefix that matches none of them: nothing to export, no error
    env.put_bucket("expb")
    env.create("/v1/buckets/expb/one", JSON)
    env.append_all("/v1/buckets/expb/one", json_bodies(3, 91), JSON)
    env.wait_sealed("\x00b/expb/one", 0)  # (its descriptor is in the store)
    result = CliRunner().invoke(main, [*base, "--bucket", "expb", "--prefix", "zzz"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["exported_up_to"] == {}


def test_compact_offers_only_the_options_of_one_stream() -> None:
    """Found by QA: `compact --help` listed --prefix and a --bucket "all its streams", which
    compact refuses."""
    shown = CliRunner().invoke(main, ["pipeline", "compact", "--help"]).output
    assert "--prefix" not in shown and "The bucket of --stream-id." in shown
    refused = CliRunner().invoke(main, ["pipeline", "compact", "--store", "file:///tmp", "--prefix", "x",
                                        "--url", "http://127.0.0.1:1"])
    assert refused.exit_code == 2 and "No such option '--prefix'" in refused.output
