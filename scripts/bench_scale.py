"""Writers scale out (issue 15 item 7): `ds3 dev --ingesters N` for N = 1, 2, 4, same run.

Run through `scripts/bench scale` (see docs/bench.md). For each N it starts `ds3 dev --ingesters N`
(a fresh data dir, the reader tier in front: its public port is the URL users get) and runs the
append load of `scripts/bench` (scripts/bench_load.mjs, 100 B messages, every writer on its own
stream, so streams spread over the ingesters by placement) with the same number of writers per
ingester (`--writers-per-ingester`, 16), so each ingester sees the same load whatever N is.

Between the load generator's MARK lines it samples the CPU time of every process of the tree by
role (each ingester by its --ingester-id, the reader with its workers, the `ds3 dev` supervisor)
and each ingester's /metrics (write operations and group commits committed). It reports, per N:
aggregate appends/s and CPU per append, and per ingester its appends/s, cores used, CPU-ms per
append and group size. On a machine with fewer cores than processes, aggregate throughput cannot
grow with N; what must not degrade is the work per append (per ingester and in the reader tier),
and the projection for a larger machine follows from it:

    cores = T * (reader_ms + ingester_ms) / 1000  =>  T = cores * 1000 / (reader_ms + ingester_ms)

with one ingester process per ~core (each is one Python process, GIL-bound, capped at
1000 / ingester_ms appends/s) and reader workers on the rest; the load generator runs elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped, unused-ignore]
from bench_run import (
    BenchError,
    Server,
    ds3_server,
    fmt,
    log,
    run_load,
    scenario_args,
    tree_cpu_times,
)

_ID = re.compile(r"--ingester-id[= ](\S+)")


def role_of(proc: psutil.Process) -> str | None:
    """`i<K>` for an ingester (its --ingester-id; `i1` when there is no cluster), `reader` for the
    reader and its workers, None for anything else (the supervisor)."""
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return None
    if " ingester " in f" {cmd} ":
        m = _ID.search(cmd)
        return m.group(1) if m else "i1"
    if " reader " in f" {cmd} ":
        return "reader"
    return None


def cpu_by_role(root: psutil.Process) -> dict[str, float]:
    out: dict[str, float] = {}
    for p, t in tree_cpu_times(root):
        role = role_of(p) or "other"
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def ingester_urls(data_dir: Path, count: int, fallback: str) -> dict[str, str]:
    if count == 1:
        return {"i1": fallback}
    desc = json.loads((data_dir / "cluster.json").read_text())
    return {i["id"]: i["url"] for i in desc["ingesters"]}


def ingester_counters(urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    """Per ingester: (write operations, group commits) so far."""
    out = {}
    for iid, url in urls.items():
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out[iid] = (metric(text, "ds3_wal_operations_total"), metric(text, "ds3_wal_commits_total"))
    return out


@dataclass
class Sampled(Server):
    """A `ds3 dev` whose cpu(), called by run_load at both MARK lines, also records the CPU per
    role and the ingesters' counters at that moment."""

    urls: dict[str, str] = field(default_factory=dict)
    samples: list[tuple[dict[str, float], dict[str, tuple[float, float]]]] = field(default_factory=list)

    def cpu(self) -> float:
        assert self.ps is not None
        roles = cpu_by_role(self.ps)
        self.samples.append((roles, ingester_counters(self.urls)))
        return sum(roles.values())


def run_one(n: int, p: argparse.Namespace, work: Path) -> dict[str, Any]:
    base = ds3_server(work, 3000, ["--ingesters", str(n), *p.ds3_arg], via="dev")
    server = Sampled(**{k: getattr(base, k) for k in base.__dataclass_fields__ if k not in ("popen", "ps", "log_file")})
    server.name = f"ds3 dev --ingesters {n}"
    writers = p.writers or p.writers_per_ingester * n
    log(f"bench scale: starting {server.name} ({writers} writers)")
    server.start()
    try:
        if n == 1:
            server.urls = {"i1": single_ingester_url(server)}
        else:
            server.urls = ingester_urls(server.data_dir, n, "")
        q = argparse.Namespace(**{**vars(p), "writers": writers})
        r = run_load(scenario_args("streams", server.url, q, f"scale{n}-{int(time.time())}"), server,
                     timeout=p.warmup + p.duration + 120)
    finally:
        server.stop()
    if len(server.samples) < 2:
        raise BenchError(f"{server.name}: the load generator printed no MARK lines")
    (cpu0, m0), (cpu1, m1) = server.samples[-2], server.samples[-1]
    seconds = r.window.seconds
    appends = int(r.data["appends"])
    roles = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
    per_ingester = {}
    for iid in sorted(server.urls):
        ops = m1[iid][0] - m0[iid][0]
        commits = m1[iid][1] - m0[iid][1]
        cpu = roles.get(iid, 0.0)
        per_ingester[iid] = {
            "appends_per_s": ops / seconds,
            "cores_used": cpu / seconds,
            "cpu_ms_per_append": cpu / ops * 1000 if ops else None,
            "group_size": ops / commits if commits else None,
        }
    ingester_cpu = sum(roles.get(i, 0.0) for i in server.urls)
    return {
        "ingesters": n,
        "writers": writers,
        "appends_per_s": r.data["appends_per_s"],
        "errors": r.data["errors"],
        "ack_p50_ms": r.data["ack"]["p50_ms"],
        "ack_p99_ms": r.data["ack"]["p99_ms"],
        "cpu_ms_per_append": sum(roles.values()) / appends * 1000 if appends else None,
        "reader_cpu_ms_per_append": roles.get("reader", 0.0) / appends * 1000 if appends else None,
        "ingester_cpu_ms_per_append": ingester_cpu / appends * 1000 if appends else None,
        "reader_cores_used": roles.get("reader", 0.0) / seconds,
        "ingester_cores_used": ingester_cpu / seconds,
        "loadgen_cores_used": r.window.loadgen_cpu / seconds if seconds else None,
        "per_ingester": per_ingester,
    }


def single_ingester_url(server: Server) -> str:
    """`ds3 dev` with one ingester picks its port itself: find the child listening."""
    assert server.ps is not None
    for child in server.ps.children(recursive=True):
        if role_of(child) == "i1":
            for c in child.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    return f"http://127.0.0.1:{c.laddr.port}"
    raise BenchError("could not find the ingester's port")


def projection(results: list[dict[str, Any]], cores: int) -> dict[str, Any]:
    """What `cores` cores would carry, from the most expensive per-append costs measured."""
    reader_ms = max(r["reader_cpu_ms_per_append"] for r in results)
    ingester_ms = max(r["ingester_cpu_ms_per_append"] for r in results)
    total = cores * 1000 / (reader_ms + ingester_ms)
    ingesters = math.ceil(total * ingester_ms / 1000)
    return {
        "cores": cores,
        "reader_cpu_ms_per_append": reader_ms,
        "ingester_cpu_ms_per_append": ingester_ms,
        "appends_per_s": total,
        "ingester_processes": ingesters,
        "reader_cores": cores - ingesters,
        "per_ingester_cap": 1000 / ingester_ms,
    }


def report(results: list[dict[str, Any]], proj: dict[str, Any]) -> str:
    lines = ["", "| ingesters | writers | appends/s | CPU-ms/append (all) | reader | ingesters | "
                 "per ingester: appends/s, cores, CPU-ms/append, group | ack p99 ms |",
             "|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        each = "; ".join(f"{i} {v['appends_per_s']:,.0f}/s {fmt(v['cores_used'], 2)} cores "
                         f"{fmt(v['cpu_ms_per_append'], 3)} ms g{fmt(v['group_size'], 1)}"
                         for i, v in r["per_ingester"].items())
        lines.append(f"| {r['ingesters']} | {r['writers']} | {r['appends_per_s']:,.0f} | "
                     f"{fmt(r['cpu_ms_per_append'], 3)} | {fmt(r['reader_cpu_ms_per_append'], 3)} | "
                     f"{fmt(r['ingester_cpu_ms_per_append'], 3)} | {each} | {fmt(r['ack_p99_ms'], 1)} |")
    lines += ["", f"Projection for {proj['cores']} cores (load generator elsewhere): "
              f"{proj['appends_per_s']:,.0f} appends/s = {proj['cores']} x 1000 / "
              f"({proj['reader_cpu_ms_per_append']:.3f} reader + {proj['ingester_cpu_ms_per_append']:.3f} "
              f"ingester CPU-ms per append), with {proj['ingester_processes']} ingesters (each capped at "
              f"{proj['per_ingester_cap']:,.0f} appends/s on its core) and {proj['reader_cores']} cores of "
              "reader workers."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ingesters", default="1,2,4", help="comma-separated cluster sizes (default 1,2,4)")
    ap.add_argument("--writers-per-ingester", type=int, default=16)
    ap.add_argument("--writers", type=int, default=0, help="a fixed number of writers instead")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--client", choices=("raw", "http"), default="raw")
    ap.add_argument("--cores", type=int, default=16, help="the deployment to project for")
    ap.add_argument("--quick", action="store_true", help="3 s per size")
    ap.add_argument("--ds3-arg", action="append", default=[], help="extra argument for `ds3 dev`")
    ap.add_argument("--json", type=Path, help="write the results here too")
    p = ap.parse_args()
    if p.quick:
        p.duration = 3.0
    # scenario_args reads these for the latency scenario only
    p.rate, p.samples = 200.0, 100
    sizes = [int(x) for x in p.ingesters.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="ds3-bench-scale-") as tmp:
        for n in sizes:
            res = run_one(n, p, Path(tmp))
            log(f"bench scale: {n} ingester(s): {res['appends_per_s']:,.0f} appends/s, "
                f"{fmt(res['cpu_ms_per_append'], 3)} CPU-ms/append")
            results.append(res)
    proj = projection(results, p.cores)
    print(report(results, proj))
    if p.json:
        p.json.write_text(json.dumps({"results": results, "projection": proj}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
