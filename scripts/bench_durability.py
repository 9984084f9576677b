"""`--durability store` vs `--durability local` (issue 14, item 7), same machine, same run.

    scripts/bench durability                 # moto (its own process) and a local-directory store
    scripts/bench durability --quick         # 2 s per scenario
    scripts/bench durability --stores file --duration 10 --json out.json
    scripts/bench durability --rounds 3      # every mode 3 times, in alternating order: medians

For each object store (moto's S3 server as a process of its own; a local directory) and each
mode, a fresh `ds3 ingester --store ... --durability MODE` (its own prefix / directory, a fresh
data dir) takes scripts/bench_load.mjs's load (the same generator as scripts/bench):

  a. 32 writers of 100-byte appends, each on its own stream;
  b. 32 writers on one stream;

appends/s and ack p50/p99 (ms, from the load generator: request sent -> answer), the ingester's
CPU per 1,000 appends, moto's ("store CPU": a real S3 costs us none), and how many of the
machine's cores were busy meanwhile (all processes: on a shared machine, what else ran). Before the
loads, the PUT latency of a small object (1 KiB, If-None-Match: *, as a log segment is written)
is measured against the same store: p50/p99 over --put-samples sequential PUTs; during each load,
the segment PUTs the ingester made are read from its histogram (ds3_log_segment_put_seconds).

Targets (issue 14): store mode's appends/s at least half of local mode's; store mode's ack p99
at most local's p99 plus one store PUT's p99 (checked with the segment PUTs' p99 of the same
load; the quiet PUT's is printed beside it). The writers are a closed loop (each sends again
once answered): appends/s is writers / ack latency, so at 32 writers the ratio is a ratio of
latencies; --writers 256 shows what group commit amortises (docs/architecture.md, "Benchmark").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import Any

import psutil  # type: ignore[import-untyped, unused-ignore]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_run import (  # noqa: E402
    BenchError,
    ds3_problem,
    ds3_server,
    fmt,
    log,
    median_of,
    run_load,
    scenario_args,
    throughput_summary,
)

from shared.objectstore import open_store  # noqa: E402

TARGET_RATIO = 0.5
KINDS = (("streams", "{} writers x own stream"), ("shared", "{} writers x one stream"))


def kinds(writers: int) -> list[tuple[str, str]]:
    """KINDS with the writer count in their labels."""
    return [(kind, label.format(writers)) for kind, label in KINDS]


def put_latency(url: str, endpoint: str | None, samples: int) -> dict[str, float]:
    """p50/p99/max ms of `samples` sequential 1 KiB PUTs (if_absent, new keys) to the store."""

    async def run() -> list[float]:
        store = open_store(url, s3_endpoint=endpoint)
        body = b"x" * 1024
        out: list[float] = []
        try:
            for i in range(samples + 5):
                t = time.perf_counter()
                await store.put(f"bench-put/{i:06d}", body, content_type="application/octet-stream",
                                if_absent=True)
                if i >= 5:  # the first few open connections
                    out.append((time.perf_counter() - t) * 1000)
            for i in range(samples + 5):
                await store.delete(f"bench-put/{i:06d}")
        finally:
            await store.close()
        return sorted(out)

    t = asyncio.run(run())
    return {"p50_ms": t[len(t) // 2], "p99_ms": t[min(len(t) - 1, int(len(t) * 0.99))], "max_ms": t[-1],
            "samples": len(t)}


def segment_puts(url: str) -> dict[float, float]:
    """The ingester's segment PUT histogram (ds3_log_segment_put_seconds) as {le: count}."""
    from tests.cluster import scrape

    m = scrape(url)
    prefix = 'ds3_log_segment_put_seconds_bucket{le="'
    return {float(k[len(prefix):-2]): v for k, v in m.items() if k.startswith(prefix)}


def quantile_ms(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile (ms) of the PUTs observed between two scrapes, interpolated within its
    bucket as Prometheus's histogram_quantile does (None: no PUT)."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0.0) for le in les]  # cumulative
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lo, below = 0.0, 0.0
    for le, n in zip(les, counts, strict=True):
        if n >= rank:
            if le == float("inf"):
                return lo * 1000
            return (lo + (le - lo) * (rank - below) / max(n - below, 1e-9)) * 1000
        lo, below = le, n
    return None


def _busy_cores() -> float:
    t = psutil.cpu_times()
    return float(t.user + t.system + t.nice + t.irq + t.softirq)


def bench_mode(store_url: str, endpoint: str | None, mode: str, p: argparse.Namespace,
               work: Path, store_pid: int | None) -> dict[str, Any]:
    durability, _, uploads = mode.partition("/")
    extra = ["--store", store_url, "--durability", durability, "--log-level", "warning"]
    if uploads:
        extra += ["--log-uploads", uploads]
    if endpoint is not None:
        extra += ["--s3-endpoint", endpoint]
    server = ds3_server(work, 1000, extra)
    server.log_path = work / f"ds3-{durability}{uploads}-{int(time.time() * 1000)}.log"
    out: dict[str, Any] = {}
    log(f"bench: ds3 ingester --durability {mode} on {store_url}")
    server.start()
    prefix = f"bench-{durability}{uploads}-{int(time.time())}"
    try:
        for kind, label in kinds(p.writers):
            # (whole load, warmup included: the shares of what else ran, not exact per-append costs)
            store_proc = psutil.Process(store_pid) if store_pid is not None else None
            store_cpu0 = sum(store_proc.cpu_times()[:2]) if store_proc is not None else 0.0
            busy0, t0 = _busy_cores(), time.monotonic()
            puts0 = segment_puts(server.url)
            r = run_load(scenario_args(kind, server.url, p, f"{prefix}-{kind}"), server,
                         timeout=p.warmup + p.duration + 120)
            puts1 = segment_puts(server.url)
            elapsed = time.monotonic() - t0
            out[kind] = throughput_summary(r)
            s = out[kind]
            # The segment PUTs the ingester made under this load, as it timed them (warm-up
            # included; in local mode the few background ones)
            s["segment_put_p50_ms"], s["segment_put_p99_ms"] = quantile_ms(puts0, puts1, 0.5), quantile_ms(puts0, puts1, 0.99)
            s["segments"] = (puts1.get(float("inf"), 0.0) - puts0.get(float("inf"), 0.0))
            s["machine_busy_cores"] = (_busy_cores() - busy0) / elapsed
            total = int(r.data.get("appends", 0)) + int(r.data.get("warmup_appends", 0))
            s["store_cpu_s_per_1000_appends"] = (
                (sum(store_proc.cpu_times()[:2]) - store_cpu0) / total * 1000 if store_proc is not None and total else None)
            log(f"bench:   {label}: {s['appends_per_s']:.0f} appends/s, ack p50 {fmt(s['ack_p50_ms'], 2)} ms, "
                f"p99 {fmt(s['ack_p99_ms'], 2)} ms, {s['errors']} errors")
    finally:
        server.stop()
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's results over its rounds: per scenario, bench_run's median_of, and the rounds'
    appends/s as they came."""
    out: dict[str, Any] = {}
    for kind in runs[0]:
        rows = [r[kind] for r in runs]
        out[kind] = median_of(rows)
        if len(runs) > 1:
            out[kind]["rounds_appends_per_s"] = [round(row["appends_per_s"]) for row in rows]
    return out


def report(results: dict[str, Any], p: argparse.Namespace) -> list[tuple[str, bool, str]]:
    checks: list[tuple[str, bool, str]] = []
    rounds = f"; medians of {p.rounds} rounds" if p.rounds > 1 else ""
    print(f"\nds3 ingester, --durability local vs store: {p.writers} writers, {p.size}-byte appends, "
          f"{p.warmup:g}s warmup + {p.duration:g}s per scenario{rounds}")
    for store_name, r in results.items():
        put = r["put"]
        print(f"\n{store_name}  (1 KiB PUT: p50 {fmt(put['p50_ms'], 2)} ms, p99 {fmt(put['p99_ms'], 2)} ms, "
              f"max {fmt(put['max_ms'], 2)} ms over {put['samples']})")
        modes = [m for m in r if m != "put"]
        print(f"  {'scenario':<26}{'mode':<10}{'appends/s':>11}{'ack p50':>9}{'ack p99':>9}{'errors':>8}"
              f"{'segment PUT p50/p99':>21}{'CPU-s/1000':>12}{'store CPU':>11}{'busy cores':>12}")
        for kind, label in kinds(p.writers):
            for mode in modes:
                s = r[mode][kind]
                loaded = f"{fmt(s.get('segment_put_p50_ms'), 2)}/{fmt(s.get('segment_put_p99_ms'), 2)}"
                print(f"  {label:<26}{mode:<10}{fmt(s['appends_per_s'], 0):>11}{fmt(s['ack_p50_ms'], 2):>9}"
                      f"{fmt(s['ack_p99_ms'], 2):>9}{s['errors']:>8}{loaded:>21}{fmt(s['cpu_s_per_1000_appends'], 3):>12}"
                      f"{fmt(s.get('store_cpu_s_per_1000_appends'), 3):>11}{fmt(s.get('machine_busy_cores'), 2):>12}"
                      + (f"   rounds: {', '.join(f'{n:,}' for n in s['rounds_appends_per_s'])}"
                         if "rounds_appends_per_s" in s else ""))
            loc = r["local"][kind]
            for mode in modes[1:]:
                sto = r[mode][kind]
                ratio = sto["appends_per_s"] / loc["appends_per_s"] if loc["appends_per_s"] else 0.0
                quiet = loc["ack_p99_ms"] + put["p99_ms"]
                loaded_p99 = sto.get("segment_put_p99_ms")
                bound = loc["ack_p99_ms"] + loaded_p99 if loaded_p99 is not None else quiet
                print(f"  {'':<26}{mode}/local {ratio:.2f} (target >= {TARGET_RATIO}); p99 "
                      f"{fmt(sto['ack_p99_ms'], 2)} vs local p99 + segment PUT p99 = {fmt(bound, 2)} ms "
                      f"(with the quiet PUT's p99: {fmt(quiet, 2)} ms)")
                checks.append((f"{store_name}, {label}: {mode}/local appends/s >= {TARGET_RATIO}",
                               ratio >= TARGET_RATIO, f"{ratio:.2f}"))
                checks.append((f"{store_name}, {label}: {mode} ack p99 <= local p99 + segment PUT p99",
                               sto["ack_p99_ms"] <= bound, f"{sto['ack_p99_ms']:.2f} <= {bound:.2f} ms"))
    print()
    for name, ok, detail in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return checks


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default="s3,file", help="comma-separated: s3 (moto), file")
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per scenario")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--writers", type=int, default=32)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--client", default="raw", choices=["raw", "http"])
    ap.add_argument("--put-samples", type=int, default=300)
    ap.add_argument("--log-uploads", default="1,4",
                    help="store mode is run once for each of these --log-uploads values (segment PUTs in flight)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every mode this many times, the order reversed every other round (a drift in the "
                         "machine's speed then falls on every mode alike), and report medians")
    ap.add_argument("--quick", action="store_true", help="2 s per scenario, 100 PUT samples")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (servers' logs)")
    p = ap.parse_args(argv)
    if p.rounds < 1:
        ap.error("--rounds must be at least 1")
    if p.quick:
        p.duration, p.put_samples = 2.0, 100
    problem = ds3_problem()
    if problem:
        log(f"bench: {problem}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="ds3-bench-durability-"))
    results: dict[str, Any] = {}
    try:
        with ExitStack() as stack:
            for name in p.stores.split(","):
                if name == "s3":
                    from tests.moto_keepalive import MotoProcess  # moto as a process of its own
                    from tests.s3server import aws_test_env
                    stack.enter_context(aws_test_env())
                    moto = MotoProcess()
                    moto.start()
                    stack.callback(moto.stop)
                    bucket = moto.new_bucket()
                    base, endpoint, label = f"s3://{bucket}", moto.endpoint, f"moto S3 ({moto.endpoint})"
                    store_pid: int | None = moto.pid
                elif name == "file":
                    root = work / "objects"
                    root.mkdir()
                    base, endpoint, label = f"file://{root}", None, f"local directory ({root})"
                    store_pid = None
                else:
                    raise BenchError(f"unknown store {name!r} (s3, file)")
                log(f"bench: {label}: PUT latency, {p.put_samples} samples ...")
                r: dict[str, Any] = {"put": put_latency(f"{base}/put-probe", endpoint, p.put_samples)}
                modes = ["local"] + [f"store/{n}" for n in p.log_uploads.split(",")]
                runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
                for rnd in range(p.rounds):
                    for mode in modes if rnd % 2 == 0 else modes[::-1]:
                        url = f"{base}/{mode.replace('/', '-')}-{rnd}"
                        runs[mode].append(bench_mode(url, endpoint, mode, p, work, store_pid))
                for mode in modes:
                    r[mode] = medians(runs[mode])
                results[label] = r
        checks = report(results, p)
        if p.json is not None:
            p.json.write_text(json.dumps({"results": results, "checks": checks}, indent=2, default=str))
        return 0
    except BenchError as e:
        log(f"bench: {e}")
        return 1
    finally:
        if p.keep:
            log(f"bench: work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(main(sys.argv[1:]))
