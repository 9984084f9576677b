"""`ds3 dev`: one ingester (or N, `--ingesters N`) and one reader as supervised child processes,
stopped together.

With N > 1 ingesters (issue 15): ids i1..iN, each with its own WAL in DATA_DIR/iK and a private
port, all sealing into the one local store DATA_DIR/objects; dev writes the cluster description
naming them to DATA_DIR/cluster.json (a generation above the last one written there, so a
restart never goes back), and the ingesters (--ingester-id iK --cluster FILE) and the reader
(--cluster FILE: it routes each request to its stream's owner) read it. Ids are kept across
restarts, so every stream finds the same ingester again as long as N is the same. With a larger
N, streams move to the new ingesters; with a smaller one, the ingesters left out run until they
have handed theirs to the others, and then stop (ds3/retiring.py)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from ds3.process import DEV_PARENT_ENV
from ds3.retiring import Retiring, left_out
from shared.cluster import load_cluster_file
from shared.localfile import write_durably
from shared.placement import Cluster, PlacementError

log = logging.getLogger("ds3.dev")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> OSError | None:
    """Why `port` cannot be listened on at `host` now, or None. Checked before anything
    starts: the readiness check would otherwise find whatever already answers there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:  # (no SO_REUSEPORT: any listener there counts)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def layout_mismatch(data_dir: Path, ingesters: int) -> str | None:
    """Why `data_dir` cannot be run with `ingesters` ingesters (its streams would not be seen),
    or None. One ingester keeps its WAL in DATA_DIR/wal; several, theirs in DATA_DIR/iK, placed
    by DATA_DIR/cluster.json (a data dir once run that way stays a cluster, of one if asked)."""
    cluster_file = data_dir / "cluster.json"
    if ingesters > 1 and not cluster_file.exists() and any((data_dir / "wal").glob("*.mdb")):
        return (f"{data_dir} holds one ingester's write-ahead log ({data_dir / 'wal'}): its streams would not be "
                f"seen by {ingesters} ingesters; start it without --ingesters, or give another --data-dir")
    return None


def _wait_ready(url: str, proc: subprocess.Popen[bytes], stopping: Callable[[], bool] = lambda: False,
                timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None or stopping():
            return False
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.05)
    return False


# Settings `ds3 dev` takes itself and hands on as flags (its own options).
DEV_OWN: Final = frozenset({
    "DS3_HOST", "DS3_PORT", "DS3_DATA_DIR", "DS3_LONG_POLL_TIMEOUT", "DS3_SEAL_BYTES", "DS3_SEAL_AGE",
    "DS3_LOG_LEVEL", "DS3_LOG_FORMAT", "DS3_ACCESS_LOG", "DS3_WORKERS", "DS3_INGESTERS", "DS3_INGESTER_PORT",
})
# Settings that cannot apply: `ds3 dev` decides them.
NOT_FOR_DEV: Final = {
    "DS3_STORE": "ds3 dev keeps its objects in DATA_DIR/objects; run `ds3 ingester` and `ds3 reader` "
                 "for another store",
    "DS3_S3_ENDPOINT": "ds3 dev uses a local-directory store, not S3",
    "DS3_INGESTER": "ds3 dev starts its own ingester",
    "DS3_INGESTER_ID": "ds3 dev names its ingesters itself (i1..iN with --ingesters N)",
    "DS3_CLUSTER": "ds3 dev writes its own cluster description (DATA_DIR/cluster.json with --ingesters N)",
}


class DevSettingError(ValueError):
    """A DS3_* variable that `ds3 dev` cannot apply (the message names it and says why)."""


def child_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment of `ds3 dev`'s ingester and reader: every DS3_* setting of the user's
    goes on to both (each takes the options it has and ignores the rest, as `ds3 ingester` and
    `ds3 reader` do), except those dev took as its own options (passed as flags) and those
    that cannot apply, which are refused."""
    for name, why in NOT_FOR_DEV.items():
        if environ.get(name):
            raise DevSettingError(f"{name} cannot be set for `ds3 dev`: {why}")
    env = {k: v for k, v in environ.items() if k not in DEV_OWN}
    # The processes share an internal token (in the environment: not visible in `ps`), so the
    # ingesters know their reader and leave per-client limits to it: the user's, or a fresh one.
    env.setdefault("DS3_INTERNAL_TOKEN", secrets.token_urlsafe(32))
    return env


AUTH_SETTINGS: Final = ("DS3_TOKENS_FILE", "DS3_TOKENS", "DS3_JWT_SECRET", "DS3_JWKS_FILE", "DS3_JWKS_URL")


def _supervise(children: list[subprocess.Popen[bytes]], stopping: Callable[[], bool], retiring: list[Retiring],
               cluster_file: Path, generation: int, retired_root: Path) -> int:
    while not stopping():
        for r in list(retiring):
            if r.proc.poll() is None and r.check(cluster_file, generation, retired_root):
                retiring.remove(r)
                children.remove(r.proc)
        for child in children:
            if child.poll() is not None:
                log.error("a ds3 process exited (code %s); stopping the others", child.returncode)
                return 1
        time.sleep(0.2)
    return 0


def write_cluster_file(path: Path, ingesters: list[tuple[str, str]],
                       leaving: Sequence[tuple[str, str]] = ()) -> Cluster:
    """The description naming `ingesters`, at a generation above the one in `path` (if any).

    It carries the last run's as its `previous`, with this run's URLs (the ids are stable, the
    ports are not): with another `--ingesters N`, a stream's new owner then asks the ingester
    that held it (ingester/moves.py) instead of answering 404 until the sweeps have moved it.
    `leaving`: ingesters started outside the description to hand their streams over (ds3/
    retiring.py); they count as members of the previous one even if the last run had already
    left them out (it was stopped before they were done)."""
    generation, previous = 1, None
    urls = dict([*ingesters, *leaving])
    if path.exists():
        try:
            old = load_cluster_file(path)
            generation = old.generation + 1
            gone = [i.id for i in old.ingesters if i.id not in urls]
            if gone:
                log.warning("ingesters %s of the last run have no data dir here any more: streams they held are "
                            "gone", ", ".join(gone))
            kept = [(i.id, urls[i.id]) for i in old.ingesters if i.id in urls]
            kept += [(i, url) for i, url in leaving if old.get(i) is None]
            if kept:
                previous = Cluster.of(kept, old.generation)
        except PlacementError as e:
            log.warning("%s; writing a new one", e)
    cluster = Cluster.of(ingesters, generation, previous=previous)
    write_durably(path, cluster.encode())  # readers of the file never see half of it
    return cluster


def run_dev(
    *, host: str, port: int, data_dir: Path, long_poll_timeout: float, seal_bytes: int, seal_age: float,
    log_level: str, log_format: str = "text", access_log: bool | None = None, workers: int | None = None,
    ingesters: int = 1, ingester_port: int = 0,
) -> int:
    stopping = False

    def stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    # First of all: a Ctrl-C at any moment of the start stops it cleanly (it landed between the
    # cluster file's write and these lines once: click's "Aborted!", exit status 1).
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    data_dir = data_dir.resolve()
    mismatch = layout_mismatch(data_dir, ingesters)
    if mismatch is not None:
        log.error("ds3 dev: %s", mismatch)
        return 1
    wanted = [(host, port)] + [("127.0.0.1", ingester_port + n) for n in range(ingesters if ingester_port else 0)]
    for where, number in wanted:
        busy = port_in_use(where, number)
        if busy is not None:
            log.error("ds3 dev: cannot listen on %s port %d: %s", where, number, busy.strerror or busy)
            return 1
    objects = data_dir / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    ds3 = [sys.executable, "-m", "ds3.cli"]
    common = ["--long-poll-timeout", str(long_poll_timeout), "--log-level", log_level, "--log-format", log_format]
    if access_log is not None:  # else each process's own default
        common.append("--access-log" if access_log else "--no-access-log")
    env = {**child_environment(dict(os.environ)), DEV_PARENT_ENV: str(os.getpid())}
    store = ["--store", objects.as_uri(), "--seal-bytes", str(seal_bytes), "--seal-age", str(seal_age)]
    ingester_urls = [f"http://127.0.0.1:{ingester_port + n if ingester_port else _free_port('127.0.0.1')}"
                     for n in range(ingesters)]
    commands: list[list[str]] = []
    routing: list[str]
    leaving: list[tuple[str, str]] = []  # ingesters of an earlier run, left out now (ds3/retiring.py)
    generation = 0
    cluster_file = data_dir / "cluster.json"
    if ingesters == 1 and not cluster_file.exists():
        commands.append([*ds3, "ingester", "--host", "127.0.0.1", "--port", ingester_urls[0].rsplit(":", 1)[1],
                         "--data-dir", str(data_dir), *store, *common])
        routing = ["--ingester", ingester_urls[0]]
    else:  # (a data dir run with several ingesters stays a cluster, of one ingester if asked)
        leaving = [(i, f"http://127.0.0.1:{_free_port('127.0.0.1')}") for i in left_out(data_dir, ingesters)]
        cluster = write_cluster_file(cluster_file, [(f"i{n + 1}", url) for n, url in enumerate(ingester_urls)],
                                     leaving)
        generation = cluster.generation
        log.info("cluster description generation %d in %s: %s", cluster.generation, cluster_file,
                 ", ".join(i.describe() for i in cluster.ingesters))
        if leaving:
            log.info("ingesters %s of an earlier run are left out: each runs until it has handed its streams to "
                     "the others, then stops", ", ".join(i for i, _ in leaving))
        for ingester_id, url in [*((f"i{n + 1}", url) for n, url in enumerate(ingester_urls)), *leaving]:
            own = data_dir / ingester_id
            own.mkdir(parents=True, exist_ok=True)
            commands.append([*ds3, "ingester", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
                             "--data-dir", str(own), *store, "--ingester-id", ingester_id,
                             "--cluster", str(cluster_file), *common])
        ingester_urls += [url for _, url in leaving]
        routing = ["--cluster", str(cluster_file)]
    children: list[subprocess.Popen[bytes]] = []

    def not_started(what: str) -> int:
        if stopping:  # a Ctrl-C while starting: not a failure
            log.info("ds3 dev: stopped while starting")
            return 0
        log.error("%s did not start", what)
        return 1

    if stopping:
        return not_started("ds3 dev")
    try:
        for command in commands:
            children.append(subprocess.Popen(command, env=env))
        for url, child in zip(ingester_urls, children, strict=True):
            if not _wait_ready(url, child, lambda: stopping):
                return not_started(f"the ingester at {url}")
        members = len(children) - len(leaving)
        retiring = [Retiring(i, data_dir / i, proc) for (i, _), proc in zip(leaving, children[members:], strict=True)]
        reader = subprocess.Popen(
            [*ds3, "reader", "--host", host, "--port", str(port), *routing,
             "--store", objects.as_uri(), *(["--workers", str(workers)] if workers else []), *common],
            env=env,
        )
        children.append(reader)
        local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # (asyncio binds "::" IPv6-only)
        if not _wait_ready(f"http://{f'[{local}]' if ':' in local else local}:{port}", reader, lambda: stopping):
            return not_started("the reader")
        if any(env.get(k) for k in AUTH_SETTINGS):
            log.info("ds3 dev ready on http://%s:%d (auth on; data in %s)", host, port, data_dir)
        else:
            log.info("ds3 dev ready on http://%s:%d (no auth: local development only; data in %s)",
                     host, port, data_dir)
            log.info("auth is off: anyone who can reach the port may write and delete. To require tokens, set "
                     "DS3_TOKENS_FILE, DS3_JWT_SECRET, DS3_JWKS_FILE or DS3_JWKS_URL (for `ds3 dev` too; "
                     "README: Deploying with auth)")
        return _supervise(children, lambda: stopping, retiring, cluster_file, generation, data_dir / "retired")
    finally:
        for child in reversed(children):
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
