"""One of three ingesters SIGKILLed under load, with real processes (issue 15, item 6): a reader
routes 12 writer threads over streams placed on all three; ingester b is killed mid-load. The
writers of a's and c's streams carry on without a single refusal while b is down; b's writers
get 503s (the reader cannot reach it), nothing else. b restarts on its own data dir and every
append acknowledged before, during and after is there, in order, exactly once. Every stream
seals all the time (4 KiB chunks, or 0.3 s old), so the kill lands among seals and uploads
and the final reads cross from sealed chunks to the WAL's tail."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests import procs
from tests.procs import request

TEXT = {"Content-Type": "text/plain"}




def test_one_ingester_of_three_killed_the_others_carry_on_and_its_streams_come_back(tmp_path: Path) -> None:
    store_root = tmp_path / "objects"
    ports = {i: procs.free_port() for i in "abc"}
    cluster = procs.write_cluster(store_root, {i: f"http://127.0.0.1:{ports[i]}" for i in "abc"})
    common = ["--store", store_root.as_uri(), "--cluster-refresh", "0.2", "--write-rate", "0",
              "--seal-bytes", "4096", "--seal-age", "0.3"]
    ingesters = {i: procs.ingester(tmp_path / i, *common, "--ingester-id", i, port=ports[i]) for i in "abc"}
    reader = procs.reader(tmp_path / "reader", ingesters["a"].url, store_root.as_uri(), "--write-rate", "0")
    started: list[procs.Proc] = []
    try:
        for p in (*ingesters.values(), reader):
            p.start()
            started.append(p)
        # four streams on each ingester, one writer thread each
        streams: dict[str, list[str]] = {i: [] for i in "abc"}
        n = 0
        while any(len(v) < 4 for v in streams.values()):
            path = f"crash-{n}"
            n += 1
            owner = cluster.owner(path).id
            if len(streams[owner]) < 4:
                streams[owner].append(path)
                assert request(reader, "PUT", f"/v1/stream/{path}", headers=TEXT)[0] == 201
        acked: dict[str, list[bytes]] = {p: [] for v in streams.values() for p in v}
        refused: dict[str, int] = {i: 0 for i in "abc"}
        other: list[tuple[str, int, bytes]] = []
        stop = threading.Event()
        down = threading.Event()  # set while b is dead: refusals of a's and c's streams count then

        def writer(owner: str, path: str) -> None:
            i = 0
            while not stop.is_set():
                body = b"%s-%d;" % (path.encode(), i)
                # an idempotent producer: a retry of an append whose answer was lost with b is
                # deduplicated, so the stream holds every acknowledged body exactly once
                headers = {**TEXT, "Producer-Id": path, "Producer-Epoch": "0", "Producer-Seq": str(i)}
                try:
                    status, _, text = request(reader, "POST", f"/v1/stream/{path}", body, headers, timeout=10)
                except OSError as e:
                    other.append((path, -1, str(e).encode()))
                    continue
                if status in (200, 204):
                    acked[path].append(body)
                    i += 1
                elif status == 503:
                    refused[owner] += 1
                    time.sleep(0.05)
                else:
                    other.append((path, status, text))

        threads = [threading.Thread(target=writer, args=(o, p)) for o, v in streams.items() for p in v]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)
            before = {p: len(v) for p, v in acked.items()}
            ingesters["b"].kill()
            down.set()
            time.sleep(2.0)
            during = {p: len(v) for p, v in acked.items()}
            ingesters["b"].start()
            time.sleep(1.0)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not other, other[:5]
        # a's and c's streams carried on while b was down, without one refusal
        assert refused["a"] == refused["c"] == 0
        for owner in "ac":
            for p in streams[owner]:
                assert during[p] > before[p] + 10, (p, before[p], during[p])
        # b's streams: refused while down, writing again after the restart
        assert refused["b"] > 0
        for p in streams["b"]:
            assert len(acked[p]) > during[p], p
        # every acknowledged append is there, in order, once (read through the reader)
        for p, bodies in acked.items():
            got = procs.read_all(reader, f"/v1/stream/{p}")
            assert got == b"".join(bodies), (p, len(got), sum(map(len, bodies)))
        sealed = [f for f in (store_root / "chunks").rglob("*") if f.is_file() and f.name.isdigit()]
        assert len(sealed) >= 12, f"only {len(sealed)} chunks sealed: the kill met no seal"
    finally:
        for p in reversed(started):
            p.stop()
