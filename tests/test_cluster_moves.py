"""Moving streams when the cluster description changes (issue 15, items 4 and 6), with real
processes: ingesters sharing a local-directory store, a reader routing by the description in
the store, the description changed like `ds3 cluster set` does. Through the reader, every
moved stream reads the same bytes at the same offsets before and after, keeps its producer
state, Stream-Seq, closure, TTL and content type, and takes appends on its new owner; adding an
ingester under load loses and duplicates no acknowledged append; removing one hands its streams
to the rest; an old owner that is down answers nothing (503) until it is back; a lost answer or
move-done is retried without a duplicate."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared import moveformat
from shared.placement import Cluster
from tests import procs
from tests.procs import request

TEXT = {"Content-Type": "text/plain"}
JSON = {"Content-Type": "application/json"}
# Small chunks and a short seal age: some chunks are sealed in the store, some still in the WAL.
COMMON = ["--write-rate", "0", "--seal-bytes", "1024", "--seal-age", "30"]


@dataclass
class Deployment:
    root: Path
    ports: dict[str, int]
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)
    refresh: str = "0.2"  # --cluster-refresh of every process
    extra: tuple[str, ...] = ()  # more ingester options
    ingesters: dict[str, procs.Proc] = field(default_factory=dict)
    reader: procs.Proc | None = None

    @property
    def store_root(self) -> Path:
        return self.root / "objects"

    def url(self, i: str) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def describe(self, ids: str) -> Cluster:
        return procs.write_cluster(self.store_root, {i: self.url(i) for i in ids})

    def start(self, i: str) -> procs.Proc:
        p = self.ingesters.get(i)
        if p is None:
            p = procs.ingester(self.root / i, "--store", self.store_root.as_uri(), *COMMON, "--ingester-id", i,
                               "--cluster-refresh", self.refresh, *self.extra, port=self.ports[i])
            p.env.update(self.extra_env.get(i, {}))
            self.ingesters[i] = p
        return p.start()

    def start_reader(self, first: str, refresh: str | None = None) -> procs.Proc:
        self.reader = procs.reader(self.root / "reader", self.url(first), self.store_root.as_uri(),
                                   "--cluster-refresh", refresh or self.refresh, "--write-rate", "0").start()
        return self.reader

    def stop(self) -> None:
        if self.reader is not None:
            self.reader.stop()
        for p in self.ingesters.values():
            p.stop()


@contextmanager
def deployment(tmp_path: Path, ids: str, refresh: str = "0.2", extra: tuple[str, ...] = (),
               **env: dict[str, str]) -> Iterator[Deployment]:
    d = Deployment(tmp_path, {i: procs.free_port() for i in ids}, dict(env), refresh=refresh, extra=extra)
    try:
        yield d
    finally:
        d.stop()


def readyz(p: procs.Proc) -> dict[str, object]:
    try:
        with urllib.request.urlopen(f"{p.url}/readyz", timeout=5) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return dict(json.loads(e.read()))


def moves(p: procs.Proc) -> dict[str, int]:
    return readyz(p)["cluster"]["moves"]  # type: ignore[index,no-any-return]


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def names(prefix: str, want: Callable[[str], bool], n: int = 1) -> list[str]:
    out = [s for s in (f"{prefix}-{k}" for k in range(5000)) if want(s)][:n]
    assert len(out) == n
    return out


def snapshot_of(reader: procs.Proc, path: str, offsets: list[str]) -> dict[str, object]:
    """What a client sees of a stream: HEAD's headers, and the body and next offset read from
    each of `offsets` (and from the start)."""
    status, h, _ = request(reader, "HEAD", path)
    assert status == 200, (path, status)
    seen: dict[str, object] = {"head": {k: h.get(k) for k in ("content-type", "stream-next-offset",
                                                            "stream-closed", "stream-ttl")}}
    for off in ["-1", *offsets]:
        status, h, body = request(reader, "GET", f"{path}?offset={off}")
        assert status == 200, (path, off, status, body)
        seen[off] = (body, h.get("stream-next-offset"), h.get("stream-up-to-date"))
    return seen


def test_adding_an_ingester_moves_its_streams_with_everything(tmp_path: Path) -> None:
    with deployment(tmp_path, "abc") as d:
        before, after = Cluster.of({"a": "http://x:1", "b": "http://x:2"}), Cluster.of(
            {"a": "http://x:1", "b": "http://x:2", "c": "http://x:3"})

        def to_c(s: str) -> bool:
            return after.owner(s).id == "c"

        d.describe("ab")
        for i in "abc":
            d.start(i)
        reader = d.start_reader("a")
        sealed, unsealed, closed, producer, ttl, jsonseq = (
            f"/v1/stream/{s}" for s in names("mv", to_c, 6))
        stays = f"/v1/stream/{names('stay', lambda s: not to_c(s))[0]}"
        bucket = names("bk", lambda b: after.bucket_owner(b).id == "c")[0]
        offsets: dict[str, list[str]] = {}

        def put(path: str, headers: dict[str, str], body: bytes = b"") -> None:
            status, h, text = request(reader, "PUT", path, body, headers)
            assert status == 201, (path, status, text)
            offsets[path] = [h["stream-next-offset"]]

        def post(path: str, body: bytes, headers: dict[str, str]) -> dict[str, str]:
            status, h, text = request(reader, "POST", path, body, headers)
            assert status in (200, 204), (path, status, text)
            offsets[path].append(h["stream-next-offset"])
            return h

        for path in (sealed, unsealed, closed, stays):
            put(path, TEXT)
        for k in range(13):  # 13 x 300 B over 1 KiB chunks: three sealed chunks, and an open one
            post(sealed, bytes([65 + k]) * 300, TEXT)
        post(unsealed, b"hello ", TEXT)
        post(unsealed, b"world", TEXT)
        post(closed, b"the end", TEXT)
        post(closed, b"", {"Stream-Closed": "true"})
        post(stays, b"untouched", TEXT)
        put(producer, TEXT)
        for seq in range(5):
            post(producer, b"p%d;" % seq, {**TEXT, "Producer-Id": "w1", "Producer-Epoch": "2",
                                          "Producer-Seq": str(seq)})
        put(ttl, {**TEXT, "Stream-TTL": "3600"})
        post(ttl, b"expiring", TEXT)
        put(jsonseq, JSON)
        post(jsonseq, b'[{"n":1},{"n":2}]', {**JSON, "Stream-Seq": "0005"})
        post(jsonseq, b'{"n":3}', {**JSON, "Stream-Seq": "0007"})
        assert request(reader, "PUT", f"/v1/buckets/{bucket}")[0] == 201
        bucket_streams = [f"/v1/buckets/{bucket}/s{k}" for k in range(3)]
        for path in bucket_streams:
            put(path, TEXT)
            post(path, path.encode(), TEXT)
        everything = [sealed, unsealed, closed, producer, ttl, jsonseq, stays, *bucket_streams]
        wait_for("a chunk sealed", lambda: any(
            f.name.isdigit() for f in (d.store_root / "chunks").rglob("*")))
        seen = {p: snapshot_of(reader, p, offsets[p]) for p in everything}

        polled: list[tuple[int, bytes]] = []
        tail = offsets[ttl][-1]
        poll = threading.Thread(target=lambda: polled.append(request(
            reader, "GET", f"{ttl}?offset={tail}&live=long-poll", timeout=60)[::2]))  # type: ignore[arg-type]
        poll.start()  # a long-poll waiting on the old owner when the description changes
        time.sleep(0.3)
        d.describe("abc")  # generation 2 adds c
        # every moved key reaches c (pulled by the first request, or pushed by the old owners' sweep)
        wait_for("the old owners' sweeps", lambda: all(
            moves(d.ingesters[i])["pending_out"] == 0 for i in "ab") and moves(d.ingesters["c"])["moved_in"] >= 7)
        for p in everything:
            assert snapshot_of(reader, p, offsets[p]) == seen[p], p
        assert sum(moves(d.ingesters[i])["moved_out"] for i in "ab") == moves(d.ingesters["c"])["moved_in"] == 7
        text = procs.metrics(d.ingesters["c"])
        assert procs.metric(text, "ds3_cluster_moved_in_total") == 7
        assert procs.metric(text, "ds3_cluster_move_seconds_count") == 7
        assert procs.metric(procs.metrics(d.ingesters["a"]), "ds3_cluster_moves_pending_out") == 0
        # c holds them: the old owners refuse them with 421 naming c
        status, h, _ = request(d.ingesters["a"] if before.owner(unsealed[11:]).id == "a" else d.ingesters["b"],
                               "GET", f"{unsealed}?offset=-1")
        assert status == 421 and h["ds3-owner-id"] == "c"
        status, h, _ = request(d.ingesters["c"], "HEAD", unsealed)
        assert status == 200
        # producer state moved: a retry of the last acknowledged append is a duplicate, the next one appends
        ph = {**TEXT, "Producer-Id": "w1", "Producer-Epoch": "2"}
        status, h, _ = request(reader, "POST", producer, b"p4;", {**ph, "Producer-Seq": "4"})
        assert status == 204 and h["producer-seq"] == "4"
        status, _, _ = request(reader, "POST", producer, b"p6;", {**ph, "Producer-Seq": "6"})
        assert status == 409  # a gap: the new owner knows seq 4 was the last
        assert request(reader, "POST", producer, b"p5;", {**ph, "Producer-Seq": "5"})[0] == 200
        assert procs.read_all(reader, producer) == b"p0;p1;p2;p3;p4;p5;"
        # Stream-Seq, closure, appends, the bucket
        assert request(reader, "POST", jsonseq, b'{"n":4}', {**JSON, "Stream-Seq": "0006"})[0] == 409
        assert request(reader, "POST", jsonseq, b'{"n":4}', {**JSON, "Stream-Seq": "0008"})[0] == 204
        assert procs.read_all(reader, jsonseq) == b'[{"n":1},{"n":2},{"n":3},{"n":4}]'
        assert request(reader, "POST", closed, b"more", TEXT)[0] == 409
        assert request(reader, "POST", sealed, b"Z" * 10, TEXT)[0] == 204
        assert procs.read_all(reader, sealed) == b"".join(bytes([65 + k]) * 300 for k in range(13)) + b"Z" * 10
        status, _, body = request(reader, "GET", f"/v1/buckets/{bucket}/streams")
        assert status == 200 and [s["stream_id"] for s in json.loads(body)["streams"]] == ["s0", "s1", "s2"]
        assert request(reader, "PUT", f"/v1/buckets/{bucket}/s3", headers=TEXT)[0] == 201
        # the long-poll that waited on the old owner is answered by the new one
        assert request(reader, "POST", ttl, b" more", TEXT)[0] == 204
        poll.join(30)
        assert polled == [(200, b" more")]
        # and a fresh stream placed on c is created there as usual
        fresh = f"/v1/stream/{names('fresh', to_c)[0]}"
        assert request(reader, "PUT", fresh, headers=TEXT)[0] == 201


@pytest.mark.parametrize("refresh", ["0.2", "5"])
def test_adding_an_ingester_under_load_loses_and_duplicates_nothing(tmp_path: Path, refresh: str) -> None:
    """Issue 15 item 6: 6 idempotent writers over 30 streams through a reader while c joins.
    With a refresh interval of 5 s (the default) too: whoever reads the new description first,
    a 421 makes the others re-read it at once, so the pause does not wait for the interval."""
    with deployment(tmp_path, "abc", refresh=refresh) as d:
        d.describe("ab")
        for i in "abc":
            d.start(i)
        reader = d.start_reader("a")
        streams = [f"/v1/stream/load-{k}" for k in range(30)]
        for s in streams:
            assert request(reader, "PUT", s, headers=TEXT)[0] == 201
        acked: dict[str, list[bytes]] = {s: [] for s in streams}
        pauses: list[float] = []
        refused = [0]
        other: list[object] = []
        stop = threading.Event()

        def writer(mine: list[str]) -> None:
            seqs = dict.fromkeys(mine, 0)
            while not stop.is_set():
                for s in mine:
                    body = b"%s-%d;" % (s.encode(), seqs[s])
                    headers = {**TEXT, "Producer-Id": s, "Producer-Epoch": "0", "Producer-Seq": str(seqs[s])}
                    first = time.monotonic()
                    while True:  # retry this append (same seq) until acknowledged
                        try:
                            status, _, text = request(reader, "POST", s, body, headers, timeout=30)
                        except OSError as e:
                            other.append((s, repr(e)))
                            continue
                        if status in (200, 204):
                            break
                        if status == 503:
                            refused[0] += 1
                            time.sleep(0.05)
                            continue
                        other.append((s, status, text))
                        return
                    pauses.append(time.monotonic() - first)
                    acked[s].append(body)
                    seqs[s] += 1

        threads = [threading.Thread(target=writer, args=(streams[k::6],)) for k in range(6)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.5)
            cluster = d.describe("abc")
            time.sleep(3.0 + float(refresh))  # every process reads it within its interval: all under load
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not other, other[:5]
        # c, started before it was added, never said it "may be stopped" (it held nothing yet)
        assert "may be stopped" not in d.ingesters["c"].log_path.read_text()
        moved = [s for s in streams if cluster.owner(s[11:]).id == "c"]
        assert moved, "no stream moved to c"
        wait_for("the sweeps", lambda: all(moves(d.ingesters[i])["pending_out"] == 0 for i in "ab"))
        assert moves(d.ingesters["c"])["moved_in"] == len(moved)
        for s in streams:
            assert procs.read_all(reader, s) == b"".join(acked[s]), s
        total = sum(len(v) for v in acked.values())
        pauses.sort()
        print(f"\nadding an ingester under load (--cluster-refresh {refresh}): {total} appends acknowledged, {len(moved)} of 30 streams "
              f"moved to c, {refused[0]} 503s retried; longest pause a writer saw {pauses[-1] * 1000:.0f} ms, "
              f"p99 {pauses[int(len(pauses) * 0.99)] * 1000:.1f} ms")
        assert pauses[-1] < 5.0


@pytest.mark.parametrize("durability", ["local", "store"])
def test_removing_an_ingester_hands_its_streams_to_the_rest(tmp_path: Path, durability: str) -> None:
    """With --durability store too: the freeze, the import and the drop are logged commits,
    each answered only once its segment is in the store."""
    with deployment(tmp_path, "abc", extra=("--durability", durability)) as d:
        three = d.describe("abc")
        for i in "abc":
            d.start(i)
        # The reader re-reads the description only when an ingester does not answer (below).
        reader = d.start_reader("a", refresh="600")
        on_c = [f"/v1/stream/{s}" for s in names("rm", lambda s: three.owner(s).id == "c", 4)]
        for k, s in enumerate(on_c):
            assert request(reader, "PUT", s, headers=TEXT)[0] == 201
            for _n in range(k * 4 + 1):  # up to 13 x 100 B: some sealed
                assert request(reader, "POST", s, b"%d" % k * 100, TEXT)[0] == 204
        seen = {s: procs.read_all(reader, s) for s in on_c}
        two = d.describe("ab")  # c leaves; it keeps running until its streams are out
        wait_for("c's sweep", lambda: moves(d.ingesters["c"])["retired_at"] == two.generation)
        assert moves(d.ingesters["c"])["pending_out"] == 0
        assert moves(d.ingesters["c"])["moved_out"] == len(on_c)
        assert sum(moves(d.ingesters[i])["moved_in"] for i in "ab") == len(on_c)
        d.ingesters["c"].stop()
        fresh = [f"/v1/stream/{s}" for s in names("new", lambda s: three.owner(s).id == "c", 3)]
        # A reader that has not read the new description yet still sends c's keys to c: the
        # first request finds c stopped (503, retry), and the reader looks again at once.
        first = request(reader, "GET", fresh[0])
        assert first[0] == 503 and b"unreachable" in first[2], first
        # Streams c never held, placed on it by the previous description: their new owners do not
        # wait for c (stopped) once it said it holds nothing. They answered 503 until the next
        # description change.
        wait_for("the reader's re-read", lambda: request(reader, "GET", fresh[0])[0] != 503, timeout=5)
        absent = request(reader, "GET", fresh[0])
        assert absent[0] == 404, absent
        for s in fresh:
            created = request(reader, "PUT", s, headers=TEXT)
            assert created[0] == 201, created
            assert request(reader, "POST", s, b"new", TEXT)[0] == 204
            assert procs.read_all(reader, s) == b"new"
        for s in on_c:
            assert procs.read_all(reader, s) == seen[s]
            assert request(d.ingesters[two.owner(s[11:]).id], "HEAD", s)[0] == 200
            assert request(reader, "POST", s, b"after", TEXT)[0] == 204
            assert procs.read_all(reader, s) == seen[s] + b"after"
        if durability == "store":  # a receiver's disk lost: the store's log gives the moved streams back
            target = next(i for i in "ab" if moves(d.ingesters[i])["moved_in"])
            d.ingesters[target].stop()
            shutil.rmtree(d.root / target)
            d.start(target)
            mine = [s for s in on_c if two.owner(s[11:]).id == target]
            assert mine
            for s in mine:
                assert procs.read_all(reader, s) == seen[s] + b"after"
                assert request(reader, "POST", s, b"!", TEXT)[0] == 204


def test_an_ingester_removed_while_down_hands_its_streams_over_when_it_is_back(tmp_path: Path) -> None:
    """c is down; the operator removes it, then adds d (two changes: c is in neither the current
    description nor the previous one). Started again, c's sweep offers its streams to their new
    owners, which did not know c and answered 204 after the usual pull: c dropped nothing but
    retired, and its streams answered 404 (found by QA). Now the owner pulls from where c says
    it is."""
    with deployment(tmp_path, "abcd") as d:
        three = d.describe("abc")
        for i in "abc":
            d.start(i)
        reader = d.start_reader("a")
        on_c = [f"/v1/stream/{s}" for s in names("down", lambda s: three.owner(s).id == "c", 3)]
        for k, s in enumerate(on_c):
            assert request(reader, "PUT", s, headers=TEXT)[0] == 201
            for _n in range(k * 6 + 1):  # some sealed, some not
                assert request(reader, "POST", s, b"%d" % k * 100, TEXT)[0] == 204
        seen = {s: procs.read_all(reader, s) for s in on_c}
        d.ingesters["c"].stop()
        d.describe("ab")
        final = d.describe("abd")
        d.start("d")
        for s in on_c:  # not held by its owner, and c unknown to the description: 404 meanwhile
            assert request(reader, "HEAD", s)[0] in (404, 503), s
        d.ingesters["c"].start()
        wait_for("c to hand over and retire", lambda: moves(d.ingesters["c"])["retired_at"] == final.generation)
        assert moves(d.ingesters["c"])["moved_out"] == len(on_c)
        for s in on_c:
            assert procs.read_all(reader, s) == seen[s], s
            assert request(reader, "POST", s, b"more", TEXT)[0] == 204
            assert procs.read_all(reader, s) == seen[s] + b"more", s


def test_old_owner_killed_then_back_and_lost_answers_retried(tmp_path: Path) -> None:
    """a is SIGKILLed before its stream moves to c: c answers 503 naming a until a restarts, then
    the move completes with nothing lost. b's stream moving to c: its export asked twice (the
    first answer lost) is the same twice; c never says move-done (DS3_TEST_LOSE_MOVE_DONE), and
    b's sweep drops its frozen copy once c holds the stream."""
    with deployment(tmp_path, "abc", c={"DS3_TEST_LOSE_MOVE_DONE": "1"}) as d:
        first = d.describe("ab")
        three = Cluster.of({i: d.url(i) for i in "abc"})
        for i in "ab":
            d.start(i)
        reader = d.start_reader("a")
        killed = f"/v1/stream/{names('kill', lambda s: first.owner(s).id == 'a' and three.owner(s).id == 'c')[0]}"
        retried = f"/v1/stream/{names('lost', lambda s: first.owner(s).id == 'b' and three.owner(s).id == 'c')[0]}"
        for s in (killed, retried):
            assert request(reader, "PUT", s, headers=TEXT)[0] == 201
            for n in range(5):
                assert request(reader, "POST", s, b"%d;" % n, {**TEXT, "Producer-Id": "p", "Producer-Epoch": "0",
                                                             "Producer-Seq": str(n)})[0] == 200
        d.ingesters["a"].kill()
        d.describe("abc")  # c is not running yet: b's sweep cannot hand its stream over

        # the export of `retried` asked twice (as c would), the first answer lost: the same bytes twice
        exports = []
        for _ in range(2):
            status, _, body = request(d.ingesters["b"], "POST", "/_ds3/move-out", json.dumps(
                {"key": retried[len("/v1/stream/"):], "generation": 2, "to": "c"}).encode())
            assert status == 200, body
            exports.append(body)
        assert exports[0] == exports[1]
        export = moveformat.decode(exports[0])
        assert [r[3] for r in export.streams[0].records] == [b"%d;" % n for n in range(5)]
        status, h, _ = request(d.ingesters["b"], "GET", f"{retried}?offset=-1")
        assert status == 421 and h["ds3-owner-id"] == "c"  # frozen: b takes nothing more for it

        c = d.start("c")
        status, h, body = request(reader, "GET", f"{killed}?offset=-1")
        assert status == 503 and "retry-after" in h, (status, body)
        assert b"moving here from ingester a" in body and b"does not answer" in body, body
        d.start("a")  # back on its own data dir: the move completes
        assert procs.read_all(reader, killed) == b"0;1;2;3;4;"
        # c pulled `retried` (a third export), and the producer state came with it
        assert request(reader, "POST", retried, b"4;", {**TEXT, "Producer-Id": "p", "Producer-Epoch": "0",
                                                       "Producer-Seq": "4"})[0] == 204  # a duplicate
        assert procs.read_all(reader, retried) == b"0;1;2;3;4;"
        # c never said move-done: the old owners' sweeps see c holds them and drop their copies
        wait_for("the sweeps to drop the frozen copies", lambda: all(
            moves(d.ingesters[i])["pending_out"] == 0 and moves(d.ingesters[i])["moved_out"] == 1 for i in "ab"),
            timeout=60)
        assert moves(c)["moved_in"] == 2
        for s in (killed, retried):
            assert procs.read_all(reader, s) == b"0;1;2;3;4;"


def test_streams_in_fork_relationships_move_too(tmp_path: Path) -> None:
    """Adding ingester c moves: a source whose fork stays on a (the fork then reads a shadow of
    it, with a pin at c), a fork whose source stays on a (pinned there), and a fork of a's
    stream that lived on b (its pin at a is untouched). Everything reads the same before and
    after, each takes its own appends, and deleting sources and forks still releases in order:
    a deleted source is 410 while a fork reads it, 404 once the last fork is gone."""
    with deployment(tmp_path, "abc") as d:
        first = d.describe("ab")
        three = Cluster.of({i: d.url(i) for i in "abc"})
        for i in "abc":
            d.start(i)
        reader = d.start_reader("a")

        def on(prefix: str, before: str, after: str) -> str:
            return "/v1/stream/" + names(prefix, lambda s: first.owner(s).id == before and three.owner(s).id == after)[0]

        src, src_fork = on("src", "a", "c"), on("srcfork", "a", "a")  # the source moves, its fork stays
        stay, moving_fork = on("stay", "a", "a"), on("mvfork", "a", "c")  # the fork moves, its source stays
        far, far_fork = on("far", "a", "a"), on("farfork", "b", "c")  # a fork of a's stream moves from b to c
        for source in (src, stay, far):
            assert request(reader, "PUT", source, headers=TEXT)[0] == 201
            for n in range(12):  # 1 KiB chunks: some of it sealed, the rest in the WAL
                assert request(reader, "POST", source, f"{source[-8:]}:{n:03d};".encode() * 8, TEXT)[0] == 204
        for fork, source in ((src_fork, src), (moving_fork, stay), (far_fork, far)):
            assert request(reader, "PUT", fork, headers={"Stream-Forked-From": source})[0] == 201
            assert request(reader, "POST", fork, b"own-before;", TEXT)[0] == 204
        every = (src, src_fork, stay, moving_fork, far, far_fork)
        before = {s: procs.read_all(reader, s) for s in every}

        d.describe("abc")
        wait_for("the moves", lambda: all(moves(d.ingesters[i])["pending_out"] == 0 for i in "ab")
                 and moves(d.ingesters["c"])["moved_in"] >= 3)
        for s in every:
            assert procs.read_all(reader, s) == before[s], s
        for s in every:
            assert request(reader, "POST", s, b"after;", TEXT)[0] == 204
            assert procs.read_all(reader, s) == before[s] + b"after;", s
        assert request(d.ingesters["c"], "HEAD", src)[0] == 200 and request(d.ingesters["a"], "HEAD", src)[0] == 421

        # deletions still release in order, across the moved relationships
        for source, fork in ((src, src_fork), (stay, moving_fork), (far, far_fork)):
            assert request(reader, "DELETE", source)[0] == 204
            assert request(reader, "HEAD", source)[0] == 410, source  # a fork still reads it
            assert procs.read_all(reader, fork) == before[fork] + b"after;"
            assert request(reader, "DELETE", fork)[0] == 204
            wait_for(f"{source} to be gone", lambda source=source: request(reader, "HEAD", source)[0] == 404)
