"""Benchmark `ds3 ingester` against the Node reference server (`@durable-streams/server`, file-backed).

Run through `scripts/bench` (see docs/bench.md). For each server, one after the other on 127.0.0.1, each
with a fresh data dir and the same long-poll timeout, it measures:

  a. appends/s with 32 concurrent writers of 100-byte messages, each writer on its own stream;
  b. the same with all 32 writers on one stream;
  c. append-to-delivery latency through a long-poll (p50/p99): one writer appending at a steady rate
     while a reader loops long-poll GETs from the returned Stream-Next-Offset;

and the server's CPU seconds (process plus children, psutil) per 1,000 appends in a and b. It prints a
table per server, the ratios, and PASS/FAIL against the targets, and writes everything as JSON.

The load comes from scripts/bench_load.mjs (Node, a minimal keep-alive HTTP/1.1 client); its ceiling is
measured first against a trivial server that answers 204 at once, and its CPU use is reported for every
scenario so that a load-generator bottleneck would show.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import psutil  # type: ignore[import-untyped, unused-ignore]
from benchlib import DS3, ROOT, free_port, machine_speed

LOAD = ROOT / "scripts" / "bench_load.mjs"
BENCH_TOKEN = "bench-token-0123456789abcdef"  # --auth: ds3 takes it for writes; the reference ignores it
CONFORMANCE = ROOT / "tests" / "conformance"

# Targets from the issue: ds3 vs the reference's durable (file-backed) mode.
TARGET_THROUGHPUT_X = 5.0  # ds3 appends/s >= 5x the reference's
TARGET_CPU_X = 0.25  # ds3 CPU per append <= 1/4 of the reference's
SERVERS = ("reference", "ds3")
# Above these, the report warns that the machine was not quiet (other programs' CPU, a busy disk).
NOISY_OTHER_CORES = 0.25
NOISY_FSYNC_MS = 5.0


class BenchError(Exception):
    """A benchmark step failed (server did not start, load generator failed, ...)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tree_cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU seconds of a process and its live descendants (and the children it reaped)."""
    return float(sum(t.user + t.system + t.children_user + t.children_system for _p, t in tree_cpu_times(proc)))


def tree_cpu_times(proc: psutil.Process) -> list[tuple[psutil.Process, Any]]:
    """(process, its cpu_times()) for a process and its live descendants (gone ones skipped)."""
    out = []
    procs = [proc]
    try:
        procs += proc.children(recursive=True)
    except psutil.Error:
        pass
    for p in procs:
        try:
            out.append((p, p.cpu_times()))
        except psutil.Error:
            continue
    return out


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far, summed over all cores."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t)
    return total - idle, total


def stop_process(popen: subprocess.Popen[Any] | None, grace: float = 10.0) -> None:
    """SIGTERM the process group (each child runs in its own session), then SIGKILL after `grace` s."""
    if popen is None or popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        popen.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        popen.wait(5)


# --------------------------------------------------------------------------------------------------
# Servers under test


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    cwd: Path
    data_dir: Path
    log_path: Path
    ready_path: str  # GET this path until ready_any or a 200
    ready_any: bool  # any HTTP status means ready (the reference has no health endpoint)
    port: int
    popen: subprocess.Popen[bytes] | None = None
    ps: psutil.Process | None = None
    log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            self.cmd,
            cwd=self.cwd,
            env={**os.environ, **self.env},
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.ps = psutil.Process(self.popen.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise BenchError(
                    f"{self.name} exited early (code {self.popen.returncode}); log:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=1) as r:
                    if self.ready_any or r.status == 200:
                        return
            except urllib.error.HTTPError:
                if self.ready_any:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise BenchError(f"{self.name} not ready on {self.url} after {timeout:.0f}s; log:\n{self.log_tail()}")

    def cpu(self) -> float:
        assert self.ps is not None
        return tree_cpu_seconds(self.ps)

    def stop(self) -> None:
        stop_process(self.popen)
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def ensure_reference_deps() -> None:
    if (CONFORMANCE / "node_modules" / "@durable-streams" / "server").is_dir():
        return
    if not (CONFORMANCE / "package.json").is_file():
        raise BenchError(f"{CONFORMANCE}/package.json not found: the reference server harness is missing")
    log(f"bench: installing the reference server's npm deps in {CONFORMANCE} ...")
    subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund"], cwd=CONFORMANCE, check=True, stdout=sys.stderr
    )


def reference_server(work: Path, long_poll_ms: int) -> Server:
    ensure_reference_deps()
    data = Path(tempfile.mkdtemp(prefix="reference-data-", dir=work))
    port = free_port()
    return Server(
        name="reference",
        cmd=["node", str(CONFORMANCE / "reference-server.mjs"), str(port)],
        env={"DS_DATA_DIR": str(data), "DS_LONG_POLL_MS": str(long_poll_ms), "DS_HOST": "127.0.0.1"},
        cwd=CONFORMANCE,
        data_dir=data,
        log_path=work / "reference.log",
        ready_path="/__health_probe",
        ready_any=True,
        port=port,
    )


def ds3_problem() -> str | None:
    """Why `ds3 ingester` cannot be benchmarked here, or None when it can."""
    if not DS3.exists():
        return f"{DS3} does not exist (run scripts/dev or scripts/test once to install ds3 into .venv)"
    try:
        r = subprocess.run([str(DS3), "ingester", "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ds3 ingester --help` failed: {e}"
    if r.returncode != 0:
        return f"`ds3 ingester --help` exited {r.returncode}: {(r.stderr or r.stdout).strip()[-500:]}"
    return None


def cannot_run(bench: str, node_for: str | None = None) -> bool:
    """Say why `bench` cannot run here (ds3 not installed; node missing when it is needed, for
    `node_for`), and whether so."""
    problem = ds3_problem()
    if problem is None and node_for is not None and shutil.which("node") is None:
        problem = f"node is required ({node_for})"
    if problem is not None:
        log(f"{bench}: {problem}")
    return problem is not None


def ds3_long_poll_args(long_poll_ms: int) -> list[str]:
    """The ingester's long-poll timeout option, found in its --help (seconds unless the name says ms)."""
    r = subprocess.run([str(DS3), "ingester", "--help"], capture_output=True, text=True, timeout=60)
    m = re.search(r"(--long-poll[\w-]*)", r.stdout)
    if not m:
        return []
    opt = m.group(1)
    if opt.endswith("-ms"):
        return [opt, str(long_poll_ms)]
    return [opt, f"{long_poll_ms / 1000:g}"]


def ds3_server(work: Path, long_poll_ms: int, extra: list[str], via: str = "ingester", auth: bool = False) -> Server:
    """`ds3 ingester` alone, or (via="dev") `ds3 dev`: the URL a new user is given, its public
    port being the reader (workers: the CPU count) in front of the ingester. Its CPU counts every
    process of the tree; per-client limits are off (the load comes from one address)."""
    data = Path(tempfile.mkdtemp(prefix="ds3-data-", dir=work))
    port = free_port()
    cmd = [str(DS3), via, "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)]
    cmd += ds3_long_poll_args(long_poll_ms) + extra
    env = {"DS3_WRITE_RATE": "0", "DS3_CREATE_RATE": "0", "DS3_MAX_LIVE_PER_CLIENT": "0"} if via == "dev" else {}
    if auth:  # writes need a token: the load generator's
        env["DS3_TOKENS"] = json.dumps([{"token": BENCH_TOKEN, "sub": "bench", "read": ["*"], "write": ["*"]}])
    return Server(
        name="ds3",
        cmd=cmd,
        env=env,
        cwd=ROOT,
        data_dir=data,
        log_path=work / "ds3.log",
        ready_path="/healthz",
        ready_any=False,
        port=port,
    )


# --------------------------------------------------------------------------------------------------
# Load generator


@dataclass
class Window:
    """CPU accounting between the load generator's "MARK start" and "MARK end"."""

    seconds: float = 0.0
    server_cpu: float = 0.0
    loadgen_cpu: float = 0.0
    machine_busy_cpu: float = 0.0
    machine_total_cpu: float = 0.0
    top_others: list[tuple[str, float]] = field(default_factory=list)  # (process, cores) besides ours
    disk: dict[str, Any] = field(default_factory=dict)  # FsyncProbe results during the window


def process_cpu_snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (name, user + system CPU seconds) of every process; kernel threads are named "[kernel]"."""
    snap: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter(["name", "cpu_times", "ppid", "cmdline"]):
        info = proc.info
        t = info["cpu_times"]
        if t is None:
            continue
        kernel = info["ppid"] == 2 or (proc.pid == 2)
        name = "[kernel]" if kernel else " ".join((info["cmdline"] or [info["name"] or "?"])[:2])[-60:]
        snap[proc.pid] = (name, t.user + t.system)
    return snap


def top_other_processes(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    exclude: set[int],
    seconds: float,
) -> list[tuple[str, float]]:
    """The biggest CPU users in a window besides the excluded pids, as (name, cores), grouped by name."""
    by_name: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        if pid in exclude:
            continue
        used = cpu - before[pid][1] if pid in before else cpu  # a process born in the window: all of it
        if used > 0:
            by_name[name] = by_name.get(name, 0.0) + used
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:3]
    return [(name, round(cpu / seconds, 3)) for name, cpu in top if seconds and cpu / seconds >= 0.02]


@dataclass
class LoadResult:
    data: dict[str, Any]
    window: Window = field(default_factory=Window)


class FsyncProbe(threading.Thread):
    """During a measured window: a 100-byte append + fdatasync every `interval` s in the data root.

    Its latencies show whether the disk was slow while the server was measured (other programs'
    writes share the disk and its journal); at 10/s it adds next to nothing to the load.
    """

    def __init__(self, directory: Path, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.path = directory / f"fsync-probe-{os.getpid()}-{time.monotonic_ns()}"
        self.interval = interval
        self.times: list[float] = []
        self.halt = threading.Event()

    def run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while not self.halt.wait(self.interval):
                t = time.perf_counter()
                os.write(fd, b"x" * 100)
                os.fdatasync(fd)
                self.times.append((time.perf_counter() - t) * 1000)
        finally:
            os.close(fd)
            self.path.unlink(missing_ok=True)

    def finish(self) -> dict[str, Any]:
        self.halt.set()
        self.join(10)
        t = sorted(self.times)
        if not t:
            return {"samples": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
        return {
            "samples": len(t),
            "p50_ms": t[len(t) // 2],
            "p99_ms": t[min(len(t) - 1, int(len(t) * 0.99))],
            "max_ms": t[-1],
        }


def run_load(
    args: list[str], server: Server | None, timeout: float, probe_dir: Path | None = None
) -> LoadResult:
    """Run bench_load.mjs with `args`; sample CPU times when it prints the MARK lines."""
    popen = subprocess.Popen(
        ["node", str(LOAD), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(timeout, lambda: stop_process(popen, grace=1))
    watchdog.start()
    try:
        lg = psutil.Process(popen.pid)
        w = Window()
        start: tuple[float, float, float, float, float] | None = None
        snap: dict[int, tuple[str, float]] = {}
        probe: FsyncProbe | None = None
        last = ""
        assert popen.stdout is not None
        for raw in popen.stdout:
            line = raw.strip()
            if line in ("MARK start", "MARK end"):
                now = time.monotonic()
                srv = server.cpu() if server else 0.0
                lgc = tree_cpu_seconds(lg)
                busy, total = machine_busy()
                if line == "MARK start":
                    start = (now, srv, lgc, busy, total)
                    snap = process_cpu_snapshot()
                    if probe_dir is not None:
                        probe = FsyncProbe(probe_dir)
                        probe.start()
                elif start is not None:
                    w = Window(
                        now - start[0], srv - start[1], lgc - start[2], busy - start[3], total - start[4]
                    )
                    ours = {os.getpid(), popen.pid}
                    if server is not None and server.ps is not None:
                        ours.add(server.ps.pid)
                        try:
                            ours |= {c.pid for c in server.ps.children(recursive=True)}
                        except psutil.Error:
                            pass
                    w.top_others = top_other_processes(snap, process_cpu_snapshot(), ours, w.seconds)
                    if probe is not None:
                        w.disk = probe.finish()
                        probe = None
            elif line:
                last = line
        popen.wait(timeout)
        err = popen.stderr.read() if popen.stderr else ""
        if popen.returncode != 0 or not last.startswith("{"):
            raise BenchError(
                f"load generator {args[0]} failed (exit {popen.returncode}): {err.strip()[-2000:]}"
            )
        return LoadResult(json.loads(last), w)
    finally:
        if probe is not None:
            probe.finish()
        watchdog.cancel()
        stop_process(popen, grace=2)


def scenario_args(kind: str, url: str, p: argparse.Namespace, prefix: str) -> list[str]:
    common = ["--url", url, "--size", str(p.size), "--warmup", str(p.warmup), "--prefix", prefix]
    common += ["--client", p.client]
    if getattr(p, "auth", False):
        common += ["--token", BENCH_TOKEN]
    if kind == "latency":
        return ["latency", *common, "--rate", str(p.rate), "--samples", str(p.samples)]
    layout = "per-writer" if kind == "streams" else "shared"
    return [
        "throughput",
        *common,
        "--writers",
        str(p.writers),
        "--layout",
        layout,
        "--duration",
        str(p.duration),
    ]


def throughput_summary(r: LoadResult) -> dict[str, Any]:
    d, w = r.data, r.window
    appends = int(d["appends"])
    return {
        "appends_per_s": d["appends_per_s"],
        "appends": appends,
        "seconds": d["seconds"],
        "errors": d["errors"],
        "error_samples": d["error_samples"],
        "ack_p50_ms": d["ack"]["p50_ms"],
        "ack_p99_ms": d["ack"]["p99_ms"],
        "ack_max_ms": d["ack"]["max_ms"],
        "server_cpu_s": w.server_cpu,
        "cpu_s_per_1000_appends": (w.server_cpu / appends * 1000) if appends else None,
        "server_cores_used": w.server_cpu / w.seconds if w.seconds else None,
        "loadgen_cpu_s": w.loadgen_cpu,
        "loadgen_cores_used": w.loadgen_cpu / w.seconds if w.seconds else None,
        "machine_busy_pct": 100 * w.machine_busy_cpu / w.machine_total_cpu if w.machine_total_cpu else None,
        "other_cores_used": other_cores(w),
        "top_other_processes": w.top_others,
        "disk_probe_p99_ms": w.disk.get("p99_ms"),
        "disk_probe": w.disk,
    }


def other_cores(w: Window) -> float | None:
    """CPU used by everything but the server and the load generator (other programs, kernel I/O work)."""
    if not w.seconds:
        return None
    return max(0.0, w.machine_busy_cpu - w.server_cpu - w.loadgen_cpu) / w.seconds


def latency_summary(r: LoadResult) -> dict[str, Any]:
    d, w = r.data, r.window
    return {
        "p50_ms": d["latency"]["p50_ms"],
        "p90_ms": d["latency"]["p90_ms"],
        "p99_ms": d["latency"]["p99_ms"],
        "max_ms": d["latency"]["max_ms"],
        "samples": d["latency"]["count"],
        "rate_per_s": d["rate"],
        "lost": d["lost"],
        "errors": d["errors"],
        "error_samples": d["error_samples"],
        "ack_p50_ms": d["ack"]["p50_ms"],
        "ack_p99_ms": d["ack"]["p99_ms"],
        "ack_max_ms": d["ack"]["max_ms"],
        "server_cpu_s": w.server_cpu,
        "loadgen_cores_used": w.loadgen_cpu / w.seconds if w.seconds else None,
        "other_cores_used": other_cores(w),
        "top_other_processes": w.top_others,
        "disk_probe_p99_ms": w.disk.get("p99_ms"),
        "disk_probe": w.disk,
    }


def measure_ceiling(p: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Scenario a against a trivial 204 server (bench_load.mjs sink): the load generator's ceiling."""
    port = free_port()
    sink = subprocess.Popen(
        ["node", str(LOAD), "sink", "--port", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert sink.stdout is not None
        if not sink.stdout.readline().startswith("listening"):
            raise BenchError("the trivial 204 server did not start")
        q = argparse.Namespace(**{**vars(p), "duration": min(p.duration, 3.0)})
        r = run_load(
            scenario_args("streams", f"http://127.0.0.1:{port}", q, "ceiling"), None, timeout=q.duration + 60
        )
        out = throughput_summary(r)
        out["sink_cpu_s"] = tree_cpu_seconds(psutil.Process(sink.pid))
        for k in ("server_cpu_s", "cpu_s_per_1000_appends", "server_cores_used"):
            out.pop(k)
        return out
    finally:
        stop_process(sink, grace=2)


def bench_server(server: Server, p: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"url": server.url, "data_dir": str(server.data_dir)}
    log(f"bench: starting {server.name}: {' '.join(server.cmd)}")
    t = time.monotonic()
    server.start()
    log(f"bench: {server.name} ready on {server.url} in {time.monotonic() - t:.1f}s (data {server.data_dir})")
    prefix = f"bench-{int(time.time())}"
    try:
        for kind in ("streams", "shared"):
            label = "32 writers, own streams" if kind == "streams" else "32 writers, one stream"
            log(f"bench: {server.name}: {label}, {p.warmup:g}s warmup + {p.duration:g}s ...")
            args = scenario_args(kind, server.url, p, f"{prefix}-{kind}")
            r = run_load(args, server, timeout=p.warmup + p.duration + 120, probe_dir=work)
            out[kind] = throughput_summary(r)
            log(
                f"bench: {server.name}: {out[kind]['appends_per_s']:.0f} appends/s, "
                f"{fmt(out[kind]['cpu_s_per_1000_appends'], 3)} CPU-s/1000"
            )
        log(f"bench: {server.name}: latency, {p.samples} samples at {p.rate:g}/s ...")
        r = run_load(
            scenario_args("latency", server.url, p, f"{prefix}-lat"),
            server,
            timeout=p.warmup + p.samples / p.rate + 120,
            probe_dir=work,
        )
        out["latency"] = latency_summary(r)
        log(
            f"bench: {server.name}: delivery p50 {fmt(out['latency']['p50_ms'], 2)} ms, "
            f"p99 {fmt(out['latency']['p99_ms'], 2)} ms"
        )
    finally:
        server.stop()
    if server.popen is not None and server.popen.returncode not in (0, -signal.SIGTERM, None):
        out["exit_code"] = server.popen.returncode
    return out


SECTIONS = ("streams", "shared", "latency")


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result per server from several rounds: the median of each number, errors and losses summed."""
    if len(runs) == 1:
        return {**runs[0], "rounds": 1}
    out: dict[str, Any] = {"url": runs[-1]["url"], "rounds": len(runs), "per_round": runs}
    for sec in SECTIONS:
        out[sec] = median_of([r[sec] for r in runs])
    return out


def median_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One scenario's summaries over several rounds: the median of each number, errors and
    losses summed (scripts/bench_durability.py's rounds too)."""
    agg: dict[str, Any] = {}
    for key in rows[0]:
        vals = [r[key] for r in rows]
        if key in ("errors", "lost", "appends"):
            agg[key] = sum(vals)
        elif key == "error_samples":
            agg[key] = [e for v in vals for e in v][:5]
        elif all(isinstance(v, int | float) for v in vals):
            agg[key] = statistics.median(vals)
        else:
            agg[key] = vals[-1]
    return agg


# --------------------------------------------------------------------------------------------------
# Report


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def server_table(name: str, r: dict[str, Any]) -> str:
    rounds = f", median of {r['rounds']} rounds" if r.get("rounds", 1) > 1 else ""
    lines = [f"{name}  ({r['url']}{rounds})"]
    lines.append(
        f"  {'scenario':<26}{'appends/s':>11}{'CPU-s/1000':>12}{'srv cores':>11}{'ack p50':>9}{'ack p99':>9}"
        f"{'ack max':>9}{'errors':>8}{'loadgen':>9}{'other':>7}{'disk p99':>10}"
    )
    for kind, label in (("streams", "32 writers x own stream"), ("shared", "32 writers x one stream")):
        s = r[kind]
        lines.append(
            f"  {label:<26}{fmt(s['appends_per_s'], 0):>11}{fmt(s['cpu_s_per_1000_appends'], 3):>12}"
            f"{fmt(s['server_cores_used'], 2):>11}{fmt(s['ack_p50_ms'], 1):>9}{fmt(s['ack_p99_ms'], 1):>9}"
            f"{fmt(s.get('ack_max_ms'), 1):>9}{s['errors']:>8}{fmt(100 * (s['loadgen_cores_used'] or 0), 0) + '%':>9}"
            f"{fmt(s['other_cores_used'], 2):>7}{fmt(s['disk_probe_p99_ms'], 2):>10}"
        )
    lat = r["latency"]
    lines.append(
        f"  append->long-poll delivery at {lat['rate_per_s']:g}/s: p50 {fmt(lat['p50_ms'], 2)} ms, "
        f"p99 {fmt(lat['p99_ms'], 2)} ms, max {fmt(lat['max_ms'], 2)} ms over {lat['samples']:.0f} samples"
        f" (lost {lat['lost']}, errors {lat['errors']})"
    )
    lines.append(
        f"  {'':<26}(during it: loadgen {fmt(100 * (lat['loadgen_cores_used'] or 0), 0)}%, other "
        f"{fmt(lat['other_cores_used'], 2)} cores, disk p99 {fmt(lat['disk_probe_p99_ms'], 2)} ms)"
    )
    return "\n".join(lines)


def noise_warnings(r: dict[str, Any]) -> list[str]:
    """Signs that something else on the machine disturbed this server's numbers."""
    out = []
    for kind in ("streams", "shared", "latency"):
        other = r[kind].get("other_cores_used")
        if other is not None and other > NOISY_OTHER_CORES:
            top = ", ".join(f"{name} {cores:.2f}" for name, cores in r[kind].get("top_other_processes", []))
            out.append(
                f"{kind}: everything else used {other:.2f} cores during the measurement"
                + (f" (top: {top})" if top else "")
            )
    for kind in ("streams", "shared", "latency"):
        d = r[kind].get("disk_probe_p99_ms")
        if d is not None and d > NOISY_FSYNC_MS:
            out.append(
                f"{kind}: a 100-byte fdatasync took {d:.1f} ms at p99 meanwhile "
                "(a busy disk; the server's own writes count too)"
            )
    return out


def compare(results: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, bool, str]]]:
    ref, ds3 = results["reference"], results["ds3"]
    ratios: dict[str, Any] = {}
    checks: list[tuple[str, bool, str]] = []
    for kind, label in (("streams", "own streams"), ("shared", "one stream")):
        tx = ratio(ds3[kind]["appends_per_s"], ref[kind]["appends_per_s"])
        cx = ratio(ds3[kind]["cpu_s_per_1000_appends"], ref[kind]["cpu_s_per_1000_appends"])
        ratios[kind] = {
            "throughput_ds3_over_reference": tx,
            "cpu_per_append_ds3_over_reference": cx,
            "cpu_per_append_reference_over_ds3": (1 / cx) if cx else None,
        }
        clean = ds3[kind]["errors"] == 0
        checks.append(
            (
                f"throughput, {label}: ds3/reference = {fmt(tx, 2)}x (target >= {TARGET_THROUGHPUT_X:g}x)",
                tx is not None and tx >= TARGET_THROUGHPUT_X and clean,
                "" if clean else f"ds3 had {ds3[kind]['errors']} errors",
            )
        )
        checks.append(
            (
                f"CPU per append, {label}: ds3/reference = {fmt(cx, 3)}x (target <= {TARGET_CPU_X:g}x; "
                f"reference/ds3 = {fmt(ratios[kind]['cpu_per_append_reference_over_ds3'], 2)}x)",
                cx is not None and cx <= TARGET_CPU_X,
                "",
            )
        )
    rp, dp = ref["latency"]["p99_ms"], ds3["latency"]["p99_ms"]
    ratios["latency"] = {
        "p99_ms": {"reference": rp, "ds3": dp},
        "p50_ms": {"reference": ref["latency"]["p50_ms"], "ds3": ds3["latency"]["p50_ms"]},
    }
    complete = ds3["latency"]["lost"] == 0 and ds3["latency"]["errors"] == 0
    checks.append(
        (
            f"delivery p99: ds3 {fmt(dp, 2)} ms vs reference {fmt(rp, 2)} ms (target: lower)",
            dp is not None and rp is not None and dp < rp and complete,
            "" if complete else "ds3 lost messages or had errors",
        )
    )
    return ratios, checks


def machine_info(work: Path) -> dict[str, Any]:
    fs = "?"
    best = ""
    for part in psutil.disk_partitions(all=True):
        if str(work).startswith(part.mountpoint) and len(part.mountpoint) > len(best):
            best, fs = part.mountpoint, part.fstype
    node = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    return {
        "ds3_git_commit": git.stdout.strip() or None,
        "ds3_git_dirty": bool(dirty.stdout.strip()),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "node": node,
        "data_filesystem": fs,
        "data_root": str(work),
        **machine_speed(),
    }


# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Benchmark ds3 ingester against the Node reference server (file-backed). See docs/bench.md.",
    )
    ap.add_argument("--duration", type=float, default=10.0, help="seconds measured per throughput scenario")
    ap.add_argument("--warmup", type=float, default=1.0, help="warmup seconds before each scenario")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 s scenarios, 400 latency samples")
    ap.add_argument("--writers", type=int, default=32, help="concurrent writers (default 32)")
    ap.add_argument("--size", type=int, default=100, help="message size in bytes (default 100)")
    ap.add_argument("--rate", type=float, default=200.0, help="latency scenario: appends per second")
    ap.add_argument("--samples", type=int, default=1000, help="latency scenario: measured messages")
    ap.add_argument("--long-poll-ms", type=int, default=3000, help="long-poll timeout for both servers")
    ap.add_argument(
        "--only", choices=SERVERS, action="append", help="benchmark only this server (repeatable)"
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="repeat everything N times (fresh servers) and report medians"
    )
    ap.add_argument(
        "--client",
        choices=("raw", "http"),
        default="raw",
        help="load generator's HTTP client: raw (node:net, cheapest) or http (node:http keep-alive Agent)",
    )
    ap.add_argument("--no-ceiling", action="store_true", help="skip the load-generator ceiling check")
    ap.add_argument("--ds3-arg", action="append", default=[], help="extra argument for `ds3 ingester` / `ds3 dev`")
    ap.add_argument("--auth", action="store_true",
                    help="ds3 with auth on (a static token; appends carry it): what a public deployment runs")
    ap.add_argument("--via", choices=("ingester", "dev"), default="ingester",
                    help="ds3 as `ds3 ingester` alone (default) or as `ds3 dev`, through its public port (the "
                         "reader in front of the ingester, as users get it)")
    ap.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="where the servers' fresh data dirs go (default: a new dir under $TMPDIR); keep it on a real disk",
    )
    ap.add_argument(
        "--keep-data", action="store_true", help="do not delete the data dirs and logs afterwards"
    )
    ap.add_argument(
        "--out", type=Path, default=ROOT / ".bench" / "bench-results.json", help="JSON results file"
    )
    p = ap.parse_args(argv)
    if p.quick:
        p.duration = min(p.duration, 3.0)
        p.samples = min(p.samples, 400)
    if p.rounds < 1:
        ap.error("--rounds must be at least 1")
    if p.size < 40:
        ap.error(
            "--size must be at least 40 bytes (the latency messages carry a sequence number and a timestamp)"
        )
    return p


def main(argv: list[str]) -> int:
    p = parse_args(argv)
    if shutil.which("node") is None:
        log("bench: node is not on PATH (needed for the load generator and the reference server)")
        return 2
    wanted = list(p.only or SERVERS)
    problems: dict[str, str] = {}
    if "ds3" in wanted:
        why = ds3_problem()
        if why:
            problems["ds3"] = why
            wanted.remove("ds3")
            log(f"bench: SKIPPING ds3: {why}")
    if not wanted:
        log("bench: nothing to benchmark")
        return 2

    if p.data_root is not None:
        p.data_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ds3-bench-", dir=p.data_root))
    results: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(work),
        "params": {
            "duration_s": p.duration,
            "warmup_s": p.warmup,
            "writers": p.writers,
            "message_bytes": p.size,
            "latency_rate_per_s": p.rate,
            "latency_samples": p.samples,
            "long_poll_timeout_ms": p.long_poll_ms,
            "quick": p.quick,
            "rounds": p.rounds,
            "client": p.client,
            "ds3_via": p.via,
        },
        "servers": {},
        "skipped": problems,
    }
    if results["machine"]["data_filesystem"] in ("tmpfs", "ramfs"):
        log(
            f"bench: WARNING: {work} is on {results['machine']['data_filesystem']}: fsync costs nothing there"
        )

    code = 0
    try:
        if not p.no_ceiling:
            log("bench: load-generator ceiling against a trivial 204 server ...")
            results["loadgen_ceiling"] = measure_ceiling(p, work)
            c = results["loadgen_ceiling"]
            log(
                f"bench: ceiling {c['appends_per_s']:.0f} req/s with 32 writers "
                f"(load generator used {100 * (c['loadgen_cores_used'] or 0):.0f}% of a core)"
            )
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in wanted}
        failed: set[str] = set()
        for rnd in range(p.rounds):
            # Alternate which server goes first, so a drift in machine load hits both alike.
            order = wanted if rnd % 2 == 0 else wanted[::-1]
            for name in order:
                if name in failed:
                    continue
                if p.rounds > 1:
                    log(f"bench: round {rnd + 1}/{p.rounds}: {name}")
                server = (
                    reference_server(work, p.long_poll_ms)
                    if name == "reference"
                    else ds3_server(work, p.long_poll_ms, p.ds3_arg, p.via, p.auth)
                )
                try:
                    runs[name].append(bench_server(server, p, work))
                except BenchError as e:
                    log(f"bench: {name} FAILED: {e}")
                    results["servers"][name] = {"error": str(e)}
                    failed.add(name)
                    code = 1
                finally:
                    server.stop()
                    if not p.keep_data:
                        shutil.rmtree(server.data_dir, ignore_errors=True)
        for name in wanted:
            if name not in failed:
                results["servers"][name] = aggregate(runs[name])
    except KeyboardInterrupt:
        log("bench: interrupted")
        return 130
    finally:
        if not p.keep_data:
            shutil.rmtree(work, ignore_errors=True)

    print_report(results, p)
    p.out.parent.mkdir(parents=True, exist_ok=True)
    p.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nJSON results: {p.out}")
    if p.keep_data:
        print(f"data dirs and server logs kept in {work}")
    verdict = results.get("verdict")
    if verdict == "FAIL":
        code = code or 1
    return code


def print_report(results: dict[str, Any], p: argparse.Namespace) -> None:
    m = results["machine"]
    print()
    print(
        f"Durable Streams append benchmark: {p.writers} writers x {p.size} B, {p.duration:g} s "
        f"(+{p.warmup:g} s warmup) per scenario; latency {p.samples} samples at {p.rate:g}/s; "
        f"long-poll timeout {p.long_poll_ms} ms"
    )
    print(
        f"machine: {m['cpus']} cores ({m['cpu_model']}), {m['memory_gib']} GiB, data on {m['data_filesystem']}; "
        f"a Python loop step {m['python_loop_ns']} ns, a syscall {m['syscall_ns']} ns (benchlib.machine_speed)"
    )
    c = results.get("loadgen_ceiling")
    if c:
        print(
            f"load-generator ceiling (trivial 204 server, {p.writers} writers): {c['appends_per_s']:,.0f} req/s, "
            f"load generator at {100 * (c['loadgen_cores_used'] or 0):.0f}% of a core"
        )
    ok: dict[str, dict[str, Any]] = {}
    for name, r in results["servers"].items():
        print()
        if "error" in r:
            print(f"{name}: FAILED: {r['error']}")
        else:
            ok[name] = r
            print(server_table(name, r))
            for w in noise_warnings(r):
                print(f"  WARNING: {w}")
    for name, why in results["skipped"].items():
        print(f"\n{name}: not measured: {why}")
    print(
        "\n(CPU-s/1000: server CPU seconds, process + children, per 1,000 acknowledged appends; "
        "srv cores: server CPU s per wall s; ack: POST round trip in ms; loadgen: load-generator CPU, "
        "% of one core; other: cores used by everything else during the measurement; disk p99: p99 of a "
        "100-byte append + fdatasync probed 10 times a second in the data root during the measurement)"
    )
    if "reference" in ok and "ds3" in ok:
        ratios, checks = compare({"reference": ok["reference"], "ds3": ok["ds3"]})
        results["ratios"] = ratios
        results["checks"] = [{"check": t, "pass": passed, "note": note} for t, passed, note in checks]
        print("\nratios (ds3 vs reference)")
        for kind, label in (("streams", "own streams"), ("shared", "one stream")):
            r = ratios[kind]
            print(
                f"  {label:<12} throughput ds3/reference {fmt(r['throughput_ds3_over_reference'], 2)}x   "
                f"CPU per append reference/ds3 {fmt(r['cpu_per_append_reference_over_ds3'], 2)}x "
                f"(ds3/reference {fmt(r['cpu_per_append_ds3_over_reference'], 3)}x)"
            )
        lat = ratios["latency"]
        print(
            f"  delivery p99  reference {fmt(lat['p99_ms']['reference'], 2)} ms   ds3 {fmt(lat['p99_ms']['ds3'], 2)} ms"
            f"   (p50 {fmt(lat['p50_ms']['reference'], 2)} / {fmt(lat['p50_ms']['ds3'], 2)} ms)"
        )
        for kind, label in (("streams", "own streams"), ("shared", "one stream")):
            print(
                f"  append ack under load, {label}: p50 reference {fmt(ok['reference'][kind]['ack_p50_ms'], 1)} ms"
                f" / ds3 {fmt(ok['ds3'][kind]['ack_p50_ms'], 1)} ms, p99 reference "
                f"{fmt(ok['reference'][kind]['ack_p99_ms'], 1)} ms / ds3 {fmt(ok['ds3'][kind]['ack_p99_ms'], 1)} ms"
            )
        print("\ntargets")
        for text, passed, note in checks:
            print(f"  {'PASS' if passed else 'FAIL'}  {text}{'  (' + note + ')' if note else ''}")
        results["verdict"] = "PASS" if all(passed for _, passed, _ in checks) else "FAIL"
        print(f"\noverall: {results['verdict']}")
    else:
        missing = [s for s in SERVERS if s not in ok]
        print(f"\nratios and targets: not computed ({', '.join(missing)} not measured)")


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    sys.exit(main(sys.argv[1:]))
