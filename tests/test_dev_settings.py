"""DS3_* settings reach `ds3 dev`'s ingester and reader (before, dev dropped every DS3_*
variable, so limits, auth and workers could not be set for it), and those that cannot apply
are refused with their name."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jwt
import pytest

from tests.cluster import scrape
from tests.procs import DS3, free_port

SECRET = "s" * 40


@contextmanager
def dev(tmp_path: Path, env: dict[str, str], *args: str) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "dev.log"
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("DS3_")}, **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen([DS3, "dev", "--port", str(port), "--data-dir", str(tmp_path / "d"), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=full, start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while "ds3 dev ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)


def _call(url: str, method: str, body: bytes | None = None, token: str | None = None) -> int:
    headers = {"Content-Type": "text/plain"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method=method, headers=headers),
                                    timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_limits_and_workers_set_in_the_environment_apply(tmp_path: Path) -> None:
    with dev(tmp_path, {"DS3_WRITE_RATE": "0.5", "DS3_WRITE_BURST": "3", "DS3_WORKERS": "2",
                         "DS3_TRUSTED_PROXIES": "none"}) as base:
        assert scrape(base)["ds3_reader_workers"] == 2
        statuses = [_call(f"{base}/v1/stream/lim", "PUT")]
        statuses += [_call(f"{base}/v1/stream/lim", "POST", b"x") for _ in range(10)]
        # limits are per worker: at most 2 x 3 writes pass, then 429
        assert statuses[0] == 201 and statuses.count(429) >= 3, statuses


def test_auth_set_in_the_environment_applies(tmp_path: Path) -> None:
    with dev(tmp_path, {"DS3_JWT_SECRET": SECRET, "DS3_WORKERS": "2"}) as base:
        assert _call(f"{base}/v1/stream/sec", "PUT") == 401
        token = jwt.encode({"sub": "t", "scope": "read:* write:*", "exp": int(time.time()) + 60}, SECRET,
                           algorithm="HS256")
        assert _call(f"{base}/v1/stream/sec", "PUT", token=token) == 201
        assert _call(f"{base}/v1/stream/sec", "POST", b"x", token=token) == 204
    # said once by the ingester and once by the reader (not by each of its workers: found by QA)
    assert (tmp_path / "dev.log").read_text().count("auth is on (HS256 JWT)") == 2


@pytest.mark.parametrize("name, value", [("DS3_STORE", "s3://bucket/p"), ("DS3_INGESTER", "http://127.0.0.1:1"),
                                         ("DS3_S3_ENDPOINT", "http://127.0.0.1:1")])
def test_settings_that_cannot_apply_are_refused_by_name(tmp_path: Path, name: str, value: str) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DS3_")}, name: value}
    r = subprocess.run([DS3, "dev", "--port", str(free_port()), "--data-dir", str(tmp_path / "d")],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and name in r.stderr, r.stderr


@pytest.mark.parametrize("name, value", [("DS3_WRITE_RATE", "-5"), ("DS3_WRITE_RATE", "abc"),
                                         ("DS3_DESCRIPTOR_TTL", "-1")])
def test_a_bad_setting_for_the_children_is_refused_once_before_anything_starts(tmp_path: Path, name: str,
                                                                                value: str) -> None:
    """Each child used to refuse it with the internal `python -m ds3.cli ingester` in its usage
    text, once per ingester, after dev had written a new cluster description."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DS3_")}, name: value}
    r = subprocess.run([DS3, "dev", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"), "--ingesters", "2"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count(f"{name}={value}: ") == 1 and "ds3.cli" not in r.stderr, r.stderr
    assert not (tmp_path / "d" / "cluster.json").exists()


@pytest.mark.parametrize("name, value", [("DS3_TOKENS", "notjson"), ("DS3_TOKENS", '[{"token": "short-secret"}]'),
                                         ("DS3_JWT_SECRET", "short-secret"), ("DS3_INTERNAL_TOKEN", "short-secret")])
def test_bad_credentials_are_refused_before_anything_starts_and_not_echoed(tmp_path: Path, name: str,
                                                                           value: str) -> None:
    """DS3_TOKENS was parsed only by the ingester as it built its app: dev started, then said
    the ingester "did not start" below the child's usage text (found by QA). And a refusal names
    the variable with its value, which for a secret must not reach the terminal or a log."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DS3_")}, name: value}
    r = subprocess.run([DS3, "dev", "--port", str(free_port()), "--data-dir", str(tmp_path / "d")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count(f"{name}=(secret: not shown): ") == 1 and "ds3.cli" not in r.stderr, r.stderr
    assert value not in r.stderr and "secret" in r.stderr and not (tmp_path / "d").exists()


def _dev_run(tmp_path: Path, *args: str, port: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS3_")}
    return subprocess.run([DS3, "dev", "--port", str(port or free_port()), "--data-dir", str(tmp_path / "d"), *args],
                          env=env, capture_output=True, text=True, timeout=60)


def test_a_port_in_use_is_refused_before_anything_says_ready(tmp_path: Path) -> None:
    """Another server on the port used to answer dev's readiness check: dev said "ready",
    then its reader failed to listen."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = _dev_run(tmp_path, port=taken.getsockname()[1])
    assert r.returncode == 1, r.stderr
    assert "cannot listen on 127.0.0.1 port" in r.stderr and "dev ready" not in r.stderr, r.stderr
    assert not (tmp_path / "d" / "objects").exists()  # nothing was started


def test_the_ingesters_ports_can_be_chosen(tmp_path: Path) -> None:
    """QA: a user behind a firewall (or given a port range) could not choose the ingester's
    port: always a random free one. --ingester-port P: P, P+1.. for --ingesters N; a port in
    use or the public one is refused before anything starts."""
    import socket

    def two_free_ports() -> int:
        for _ in range(50):
            first = free_port()
            with socket.socket() as a, socket.socket() as b:
                try:
                    a.bind(("127.0.0.1", first))
                    b.bind(("127.0.0.1", first + 1))
                except OSError:
                    continue
            return first
        raise AssertionError("no two consecutive free ports")

    first = two_free_ports()
    with dev(tmp_path, {}, "--ingesters", "2", "--ingester-port", str(first)) as url:
        assert _call(f"{url}/v1/stream/a", "PUT") == 201
        for port in (first, first + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
                assert r.status == 200
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        r = _dev_run(tmp_path / "busy", "--ingester-port", str(busy))
    assert r.returncode == 1 and f"port {busy}" in r.stderr, r.stderr
    assert not (tmp_path / "busy" / "d" / "objects").exists()
    public = free_port()
    r = _dev_run(tmp_path / "same", "--ingester-port", str(public), port=public)
    assert r.returncode == 2 and "DS3_INGESTER_PORT" in r.stderr and "public port" in r.stderr, r.stderr


def test_a_data_dir_keeps_its_layout_whatever_the_number_of_ingesters(tmp_path: Path) -> None:
    """A data dir of one ingester started with `--ingesters 2` used to start empty, its streams
    out of sight: it is refused, saying how to start it. One of `--ingesters 2` started without
    it (it was refused too) stays a cluster, of one: i2 hands its streams to i1 and retires."""
    with dev(tmp_path, {}) as url:
        assert _call(f"{url}/v1/stream/kept", "PUT") == 201
    r = _dev_run(tmp_path, "--ingesters", "2")
    assert r.returncode == 1 and "holds one ingester's write-ahead log" in r.stderr, r.stderr
    two = tmp_path / "two"
    two.mkdir()
    names = [f"kept-{n}" for n in range(8)]
    with dev(two, {}, "--ingesters", "2") as url:
        for name in names:
            assert _call(f"{url}/v1/stream/{name}", "PUT") == 201
            assert _call(f"{url}/v1/stream/{name}", "POST", name.encode()) == 204
    with dev(two, {}) as url:
        for name in names:
            with urllib.request.urlopen(f"{url}/v1/stream/{name}?offset=-1", timeout=10) as r2:
                assert r2.read() == name.encode()
        deadline = time.monotonic() + 30
        while not (two / "d" / "retired").is_dir():
            assert time.monotonic() < deadline, (two / "dev.log").read_text()
            time.sleep(0.2)
        assert [p.name for p in (two / "d" / "retired").iterdir()] == ["i2-g2"]
        assert _call(f"{url}/v1/stream/kept-0", "POST", b"!") == 204


@pytest.mark.parametrize("name, value", [("DS3_SEAL_BYTES", "0"), ("DS3_SEAL_AGE", "0"),
                                         ("DS3_LONG_POLL_TIMEOUT", "-1"), ("DS3_PORT", "99999")])
def test_dev_checks_its_own_settings_before_starting_anything(tmp_path: Path, name: str, value: str) -> None:
    """They were checked by the child they went to, after dev had started others, in that
    child's `python -m ds3.cli ingester` usage text."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DS3_")}, name: value}
    args = [DS3, "dev", "--data-dir", str(tmp_path / "d")] + ([] if name == "DS3_PORT" else ["--port", str(free_port())])
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and name in r.stderr and "Usage: ds3 dev" in r.stderr, r.stderr
    assert "python -m ds3.cli" not in r.stderr and not (tmp_path / "d").exists()


@pytest.mark.parametrize("after", ["cluster description generation", "moving"])
def test_ctrl_c_while_starting_stops_cleanly(tmp_path: Path, after: str) -> None:
    """A Ctrl-C while dev starts (here: 3 ingesters, then 2 with i3 handing its streams over)
    used to wait for everything to be ready, then log "the ingester ... did not start" and
    "Task exception was never retrieved ... Session is closed" (found by QA)."""
    with dev(tmp_path, {}, "--ingesters", "3") as url:
        for n in range(20):
            assert _call(f"{url}/v1/stream/c-{n}", "PUT") == 201
    log = tmp_path / "interrupted.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS3_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([DS3, "dev", "--port", str(free_port()), "--data-dir", str(tmp_path / "d"),
                                 "--ingesters", "2"], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + 30
    while after not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    assert proc.wait(20) == 0, log.read_text()
    text = log.read_text()
    # (a child still starting its interpreter when the group's SIGINT lands prints Python's own
    # KeyboardInterrupt traceback: that is Python's, not ds3's, and is not looked for here)
    for bad in ("did not start", "never retrieved", "Session is closed", "ERROR"):
        assert bad not in text, text
    with dev(tmp_path, {}, "--ingesters", "2") as url:  # nothing lost
        for n in range(20):
            assert _call(f"{url}/v1/stream/c-{n}", "HEAD") == 200, n


def test_a_misspelt_setting_is_named_once_with_the_one_meant(tmp_path: Path) -> None:
    """A DS3_* variable that is no setting was ignored without a word (the server ran with the
    default the user meant to change). Now dev says so, once (not again in its children)."""
    with dev(tmp_path, {"DS3_MAX_LIVE_PER_CLIENTS": "5", "DS3_WRITE_RATE": "0"}) as base:
        assert _call(f"{base}/v1/stream/spelt", "PUT") == 201
    log = (tmp_path / "dev.log").read_text()
    said = "DS3_MAX_LIVE_PER_CLIENTS is not a ds3 setting: it is ignored (did you mean DS3_MAX_LIVE_PER_CLIENT?)"
    assert log.count(said) == 1, log
    assert "DS3_WRITE_RATE" not in log


@pytest.mark.parametrize("environ, said", [
    ({"DS3_PORT": "1", "HOME": "/root", "DS3_READER_WORKER": "1", "DS3_TEST_X": "1"}, {}),
    ({"DS3_SEALBYTES": "1"}, {"DS3_SEALBYTES": "(did you mean DS3_SEAL_BYTES?)"}),
    ({"DS3_NOTHING_LIKE_IT": "1"}, {"DS3_NOTHING_LIKE_IT": "is not a ds3 setting: it is ignored"}),
])
def test_unknown_settings(environ: dict[str, str], said: dict[str, str]) -> None:
    from ds3.cli import main
    from ds3.settings import known_settings, unknown_settings

    found = unknown_settings(environ, known_settings(main))
    assert set(found) == set(said)
    for name, text in said.items():
        assert text in found[name]


@pytest.mark.parametrize("args", [["cluster", "show"], ["pipeline", "export", "--help"]])
def test_pipeline_and_cluster_commands_name_a_misspelt_setting(tmp_path: Path, args: list[str]) -> None:
    """`ds3 pipeline` and `ds3 cluster` read DS3_* variables too, and said nothing of a misspelt
    one (the servers log it). Now they say it on stderr, once, and carry on."""
    from click.testing import CliRunner

    from ds3.cli import main

    env = {"DS3_STOR": (tmp_path / "objects").as_uri(), "DS3_STORE": (tmp_path / "objects").as_uri()}
    result = CliRunner().invoke(main, args, env=env)
    said = "warning: DS3_STOR is not a ds3 setting: it is ignored (did you mean DS3_STORE?)"
    assert result.stderr.count(said) == 1, (result.stdout, result.stderr)


def test_a_sigkilled_dev_takes_its_servers_with_it(tmp_path: Path) -> None:
    """Found by QA: `kill -9` of `ds3 dev` left its ingester and reader serving (holding the port
    and the data dir's lock: the next `ds3 dev` could not start). They drain and stop; a new dev
    starts on the same port and data dir and finds the stream."""
    port = free_port()
    log = tmp_path / "dev.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS3_")}
    cmd = [DS3, "dev", "--port", str(port), "--data-dir", str(tmp_path / "d")]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 40
        while "ds3 dev ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/v1/stream/s"
        assert _call(url, "PUT", b"kept") == 201
        proc.kill()  # the dev process alone, not its group
        proc.wait(10)
        deadline = time.monotonic() + 20
        while subprocess.run(["pgrep", "-f", "--", f"--port {port} "], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the reader is still running"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    with dev(tmp_path, {}) as again:
        assert _call(f"{again}/v1/stream/s", "GET") == 200
