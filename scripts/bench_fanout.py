"""Live fan-out through `ds3 dev`'s public port (durable) against the reference server in memory,
in the same run (issue 13 item 3; item 5 with --mode many).

For each server, one after the other on 127.0.0.1: N subscribers on one JSON stream (long-poll,
then SSE, each from the tail), a writer appending {"i", "t"} at --rate msg/s for --seconds. Every
subscriber must see every message once and in order; the report gives the writer's achieved rate,
delivery latency p50/p99 (append sent -> subscriber parsed it) and the server's CPU seconds.
The writer starts with --warmup seconds of messages (default 2) whose delays are reported apart
(warmup_delivery_ms_p99): the load generator's first second is slow against either server.

    .venv/bin/python scripts/bench_fanout.py                   # 1,000 long-poll, then 1,000 SSE
    .venv/bin/python scripts/bench_fanout.py --mode many --subscribers 10000   # one reader worker
    .venv/bin/python scripts/bench_fanout.py --streams 500 --rate 500    # 500 streams, 2 followers each

Targets (issue 13): delivery p99 <= 100 ms and <= the reference's in-memory p99; the writer keeps
its rate; nothing lost or reordered. The load (scripts/bench_fanout.mjs, Node) connects from 20
loopback addresses (127.0.0.11-30), so the per-client live cap (100 per address by default) does
not refuse a benchmark's subscribers; DS3_MAX_LIVE_PER_CLIENT=0 is set as well.

`--mode many` runs one mixed load (half SSE, half long-poll) on `ds3 reader` started alone with
one worker in front of `ds3 ingester` (no reference), and reports the reader's RSS per live
connection and the file descriptors it held.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped, unused-ignore]
from bench_run import CONFORMANCE, Server, cannot_run, ensure_reference_deps, log, machine_busy
from benchlib import DS3, ROOT, free_port

LOAD = ROOT / "scripts" / "bench_fanout.mjs"
TARGET_P99_MS = 100.0


def reference_in_memory(work: Path, long_poll_ms: int) -> Server:
    ensure_reference_deps()
    port = free_port()
    return Server(
        name="reference (in memory)", cmd=["node", str(CONFORMANCE / "reference-server.mjs"), str(port)],
        env={"DS_LONG_POLL_MS": str(long_poll_ms), "DS_HOST": "127.0.0.1"}, cwd=CONFORMANCE,
        data_dir=work, log_path=work / "reference.log", ready_path="/__health_probe", ready_any=True, port=port,
    )


def ds3_dev(work: Path, long_poll_s: float) -> Server:
    data = Path(tempfile.mkdtemp(prefix="ds3-dev-", dir=work))
    port = free_port()
    return Server(
        name="ds3 dev", cmd=[str(DS3), "dev", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data),
                             "--long-poll-timeout", f"{long_poll_s:g}"],  # access log on, as users run it
        env={"DS3_MAX_LIVE_PER_CLIENT": "0"}, cwd=ROOT, data_dir=data, log_path=work / "ds3-dev.log",
        ready_path="/healthz", ready_any=False, port=port,
    )


def ds3_pair(work: Path, long_poll_s: float) -> tuple[Server, Server]:
    """`ds3 ingester` and one `ds3 reader` (one worker) in front of it, for --mode many."""
    data = Path(tempfile.mkdtemp(prefix="ds3-many-", dir=work))
    ing_port, rdr_port = free_port(), free_port()
    common = ["--long-poll-timeout", f"{long_poll_s:g}", "--log-level", "warning"]
    objects = (data / "objects").as_uri()
    (data / "objects").mkdir(parents=True)
    ingester = Server(
        name="ds3 ingester", cmd=[str(DS3), "ingester", "--host", "127.0.0.1", "--port", str(ing_port),
                                  "--data-dir", str(data), "--store", objects, *common],
        env={}, cwd=ROOT, data_dir=data, log_path=work / "ingester.log", ready_path="/healthz",
        ready_any=False, port=ing_port,
    )
    reader = Server(
        name="ds3 reader", cmd=[str(DS3), "reader", "--host", "127.0.0.1", "--port", str(rdr_port),
                                "--ingester", ingester.url, "--store", objects, "--no-access-log", *common],
        env={"DS3_MAX_LIVE_PER_CLIENT": "0", "DS3_WORKERS": "1"}, cwd=ROOT, data_dir=data,
        log_path=work / "reader.log", ready_path="/healthz", ready_any=False, port=rdr_port,
    )
    return ingester, reader


def run_load(base: str, path: str, mode: str, p: argparse.Namespace, subscribers: int,
             watch: psutil.Process | None = None) -> dict[str, Any]:
    cfg = {"base": base, "path": path, "mode": mode, "subscribers": subscribers, "rate": p.rate,
           "seconds": p.seconds, "warmup": p.warmup, "addresses": p.addresses, "settle": p.settle,
           "streams": p.streams}
    proc = subprocess.Popen(["node", str(LOAD), json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_raise_nofile)
    peak: dict[str, float] = {}
    while proc.poll() is None:
        if watch is not None:
            _sample(watch, peak)
        time.sleep(0.25)
    out, err = proc.communicate()
    if proc.returncode != 0 or not out.strip():
        raise RuntimeError(f"load generator failed ({proc.returncode}): {err[-2000:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result.update(peak)
    return result


def _sample(ps: psutil.Process, peak: dict[str, float]) -> None:
    """The reader's peak RSS and open descriptors (its workers included) while the load runs."""
    try:
        procs = [ps, *ps.children(recursive=True)]
        rss = sum(q.memory_info().rss for q in procs)
        fds = sum(q.num_fds() for q in procs)
    except psutil.Error:
        return
    peak["reader_rss_mib_peak"] = max(peak.get("reader_rss_mib_peak", 0.0), rss / 2**20)
    peak["reader_fds_peak"] = max(peak.get("reader_fds_peak", 0), fds)


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def scenario(server: Server, mode: str, p: argparse.Namespace, n: int, subscribers: int,
             watch: psutil.Process | None = None) -> dict[str, Any]:
    busy0, total0 = machine_busy()
    cpu0, t0 = server.cpu(), time.monotonic()
    r = run_load(server.url, f"/v1/stream/fanout-{mode}-{n}", mode, p, subscribers, watch)
    r["server_cpu_s"] = round(server.cpu() - cpu0, 2)
    busy1, total1 = machine_busy()
    r["machine_busy_share"] = round((busy1 - busy0) / max(1e-9, total1 - total0), 2)
    r["wall_s"] = round(time.monotonic() - t0, 1)
    r["ok"] = (r["complete_subscribers"] == subscribers and r["out_of_order"] == 0 and r["errors"] == 0)
    log(f"  {server.name} {mode}: {short(r)}")
    return r


def short(r: dict[str, Any]) -> str:
    return (f"writer {r['writer_rate']:.1f}/{r['target_rate']} msg/s, delivery p50 {fmt(r['delivery_ms_p50'])} ms "
            f"p99 {fmt(r['delivery_ms_p99'])} ms (warm-up p99 {fmt(r.get('warmup_delivery_ms_p99'))}), complete {r['complete_subscribers']}/{r['subscribers']}, "
            f"out of order {r['out_of_order']}, errors {r['errors']}, server CPU {r['server_cpu_s']} s, "
            f"load CPU {r['loadgen_cpu_s']:.1f} s, machine busy {r['machine_busy_share']:.0%}")


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def bench_pair(p: argparse.Namespace, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    modes = ["long-poll", "sse"]
    for name, make in (("reference", lambda: reference_in_memory(work, int(p.long_poll * 1000))),
                       ("ds3", lambda: ds3_dev(work, p.long_poll))):
        for n in range(p.repeat):
            server = make()
            log(f"bench_fanout: starting {server.name} (round {n + 1})")
            server.start()
            try:
                for mode in modes:
                    results.setdefault(name, {}).setdefault(mode, []).append(
                        scenario(server, mode, p, n, p.subscribers))
            finally:
                server.stop()
    verdicts = []
    for mode in modes:
        ours = [r["delivery_ms_p99"] for r in results["ds3"][mode]]
        ref = [r["delivery_ms_p99"] for r in results["reference"][mode]]
        best_ours, best_ref = min(ours), min(ref)
        verdicts.append((f"{mode}: every message to every subscriber, in order",
                         all(r["ok"] for r in results["ds3"][mode])))
        verdicts.append((f"{mode}: writer keeps its rate (>= 95%)",
                         all(r["writer_rate"] >= 0.95 * p.rate for r in results["ds3"][mode])))
        verdicts.append((f"{mode}: p99 {fmt(best_ours)} ms <= {TARGET_P99_MS:g} ms", best_ours <= TARGET_P99_MS))
        verdicts.append((f"{mode}: p99 {fmt(best_ours)} ms <= reference in memory {fmt(best_ref)} ms",
                         best_ours <= best_ref))
    results["verdicts"] = [{"what": w, "pass": ok} for w, ok in verdicts]
    return results


def bench_many(p: argparse.Namespace, work: Path) -> dict[str, Any]:
    ingester, reader = ds3_pair(work, p.long_poll)
    ingester.start()
    try:
        reader.start()
        try:
            assert reader.ps is not None
            base_rss = sum(q.memory_info().rss for q in [reader.ps, *reader.ps.children(recursive=True)]) / 2**20
            r = scenario(reader, "mixed", p, 0, p.subscribers, watch=reader.ps)
        finally:
            reader.stop()
    finally:
        ingester.stop()
    r["reader_rss_mib_idle"] = round(base_rss, 1)
    r["reader_kib_per_connection"] = round((r.get("reader_rss_mib_peak", base_rss) - base_rss) * 1024
                                           / max(1, p.subscribers), 1)
    return {"many": r, "verdicts": [{"what": f"{p.subscribers} mixed live subscribers on one reader worker "
                                             "without errors, all messages in order", "pass": r["ok"]}]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["pair", "many"], default="pair")
    ap.add_argument("--subscribers", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=1,
                    help="streams the subscribers follow (subscriber k follows stream k %% S, message i goes to "
                         "stream i %% S): many streams with a few followers each, as a chat has")
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--long-poll", type=float, default=30.0, help="long-poll timeout of both servers (s)")
    ap.add_argument("--addresses", type=int, default=20, help="loopback source addresses of the subscribers")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between connecting and writing")
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of messages written before the measured ones (their delays are reported apart)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds per server (the best p99 is compared)")
    ap.add_argument("--json", type=Path, help="write the results here")
    p = ap.parse_args(argv)
    if cannot_run("bench_fanout", node_for="the load generator and the reference server"):
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    try:
        results = bench_many(p, work) if p.mode == "many" else bench_pair(p, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["machine"] = {"cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    print(json.dumps(results, indent=2))
    for v in results["verdicts"]:
        log(f"{'PASS' if v['pass'] else 'FAIL'}  {v['what']}")
    if p.json:
        p.json.write_text(json.dumps(results, indent=2))
    return 0 if all(v["pass"] for v in results["verdicts"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
