"""Start and stop real ds3 processes for tests (127.0.0.1 only; callers stop what they start)."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shared.placement import Cluster

DS3 = str(Path(sys.executable).with_name("ds3"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A ds3 subcommand running as a child process."""

    args: list[str]
    port: int
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # where it listens (a test network's address: tests/netns.py)
    wrap: list[str] = field(default_factory=list)  # a command line prefix (`ip netns exec NS`)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> Proc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, **self.env}
        self.popen = subprocess.Popen(
            [*self.wrap, DS3, *self.args], stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.args} exited early:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.args} not ready in {timeout}s:\n{self.log_path.read_text()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks run, like a power cut for the process."""
        if self.popen and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def ingester(data_dir: Path, *extra: str, port: int | None = None, host: str = "127.0.0.1",
             wrap: list[str] | None = None) -> Proc:
    """An unstarted `ds3 ingester` on 127.0.0.1 (or `host`, run under `wrap`: a test network's
    host, tests/netns.py) with its log beside the data dir."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    args = ["ingester", "--host", host, "--port", str(port), "--data-dir", str(data_dir), *extra]
    return Proc(args=args, port=port, log_path=data_dir.parent / f"ingester-{port}.log", host=host,
                wrap=wrap or [])


def reader(work_dir: Path, ingester_url: str | None, store_url: str, *extra: str, port: int | None = None) -> Proc:
    """An unstarted `ds3 reader` on 127.0.0.1 in front of `ingester_url` (None: it follows the
    store prefix's owner)."""
    port = port or free_port()
    work_dir.mkdir(parents=True, exist_ok=True)
    # One worker unless the test asks for more: `--workers` defaults to the CPU count, and most
    # tests count one process's requests (tests/test_workers.py runs several).
    workers = [] if "--workers" in extra else ["--workers", "1"]
    to = ["--ingester", ingester_url] if ingester_url is not None else []
    args = ["reader", "--host", "127.0.0.1", "--port", str(port), *to, "--store", store_url, *workers, *extra]
    return Proc(args=args, port=port, log_path=work_dir / f"reader-{port}.log")


def request(p: Proc, method: str, path: str, body: bytes = b"",
            headers: dict[str, str] | None = None, timeout: float = 15.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request to `p` on a connection of its own: (status, lower-cased headers, body)."""
    c = http.client.HTTPConnection(p.host, p.port, timeout=timeout)
    try:
        c.request(method, path, body=body or None, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def metrics(p: Proc) -> str:
    """`p`'s /metrics exposition."""
    with urllib.request.urlopen(f"{p.url}/metrics", timeout=5) as r:
        return str(r.read().decode())


def metric(text: str, name: str) -> float | None:
    """The value of the unlabelled sample `name` in an exposition, or None."""
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def write_cluster(store_root: Path, ingesters: dict[str, str]) -> Cluster:
    """Write the cluster description {id: url} into the local store at `store_root`, as
    `ds3 cluster set` does (the next generation); the description written."""
    import asyncio

    from shared.cluster import set_cluster
    from shared.objectstore import LocalStore

    async def run() -> Cluster:
        store = LocalStore(store_root)
        try:
            return await set_cluster(store, ingesters)
        finally:
            await store.close()

    return asyncio.run(run())


@contextlib.contextmanager
def lane_and_aiohttp(root: Path, *extra: str) -> Iterator[tuple[Proc, Proc]]:
    """Two started `ds3 ingester`s sealing into local stores under `root` with `extra`
    arguments: the first with the fast lane, the second without (DS3_FAST_LANE=0, aiohttp's
    handlers answer everything), for tests comparing their answers."""
    made = []
    for name in ("fast", "slow"):
        p = ingester(root / name / "wal", "--store", f"file://{root / name / 'objects'}", *extra)
        if name == "slow":
            p.env["DS3_FAST_LANE"] = "0"
        made.append(p)
    made[0].start()
    try:
        made[1].start()
        try:
            yield made[0], made[1]
        finally:
            made[1].stop()
    finally:
        made[0].stop()



def read_all(p: Proc, path: str) -> bytes:
    """Every byte of a stream through `p`, page by page (a sealed chunk answers one page at a
    time) until Stream-Up-To-Date."""
    out, offset = b"", "-1"
    for _ in range(10_000):
        status, headers, page = request(p, "GET", f"{path}?offset={offset}")
        assert status == 200, (path, offset, status, page[:200])
        out += page
        if headers.get("stream-up-to-date") == "true":
            return out
        offset = headers["stream-next-offset"]
    raise AssertionError(f"{path}: no end after 10,000 pages")
