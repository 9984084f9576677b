"""The owning ingester cut off by the network (a partition, tests/netns.py), not killed or
frozen: it runs on a host of its own with a client beside it, the store, the standby, the
reader and the other clients on the far side. Packets to and from it vanish (a blackhole: its
requests in flight neither fail nor finish), the standby takes over once the lease lapses, and
then the partition heals, so what the old owner sent meanwhile (TCP retransmits it) arrives
late. What users must see:

- `--durability store`: every append acknowledged on either side is in the stream exactly once,
  in its producer's order; the client beside the old owner gets no acknowledgement from it
  after the cut (its segments cannot land) and a 503 within seconds, not a hang; the clients
  behind the reader reach the standby; after the heal the old owner stays fenced.
- `--durability local`: the same, except that what the old owner acknowledged and had not
  shipped is lost, and it is bounded: the old owner stops acknowledging once the log is
  --max-ship-lag behind, and nothing acknowledged long before the cut is lost.
- Either way, an empty disk restoring from the store afterwards (the standby killed too)
  serves the stream byte for byte as the standby did: nothing the old owner sent late is
  replayed over the new owner's log.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netns, procs
from tests.netwriter import Attempt, Writer, read_attempts
from tests.procs import request
from tests.s3server import TEST_ENV, MotoS3

ROOT = Path(__file__).resolve().parent.parent
TEXT = {"Content-Type": "text/plain"}
LEASE = 2.0
SHIP_INTERVAL, MAX_SHIP_LAG = 0.2, 1.0  # local durability
TAKEOVER_WITHIN = 20.0  # the lease, clock-skew allowance and record reads, with room to spare
LINE = re.compile(rb"([a-z]\d+-\d+)-(\d+)\n")  # <producer>-<epoch>-<seq>


@pytest.fixture
def network() -> Iterator[netns.Network]:
    if (why := netns.available()) is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true, but {why} (scripts/test installs iproute2 when run as root)")
        pytest.skip(why)
    with netns.Network() as net:
        yield net


def _by_epoch(producer: str, attempts: list[Attempt]) -> dict[str, list[Attempt]]:
    """{"<producer>-<epoch>": its attempts}."""
    out: dict[str, list[Attempt]] = {}
    for a in attempts:
        out.setdefault(f"{producer}-{a.epoch}", []).append(a)
    return out


def _lines(body: bytes) -> dict[str, list[int]]:
    """{"<producer>-<epoch>": [seq, ...]} in stream order; every byte must be one of the
    writers' lines."""
    assert LINE.sub(b"", body) == b"", "bytes no writer sent"
    seqs: dict[str, list[int]] = {}
    for producer, seq in LINE.findall(body):
        seqs.setdefault(producer.decode(), []).append(int(seq))
    return seqs


@pytest.mark.parametrize("durability", ["store", "local"])
def test_an_owner_cut_off_by_the_network_loses_nothing_it_may_not(
        tmp_path: Path, network: netns.Network, durability: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in TEST_ENV.items():
        monkeypatch.setenv(k, v)
    main = network.main
    assert main is not None
    a = network.add_host("a")
    started: list[procs.Proc] = []
    side_writer: subprocess.Popen[bytes] | None = None
    stop = threading.Event()
    writers: list[Writer] = []
    threads: list[threading.Thread] = []
    with MotoS3(main.ip) as s3, _stopping(started):
        store = f"s3://{s3.new_bucket()}/p"
        common = ["--store", store, "--s3-endpoint", s3.endpoint, "--durability", durability,
                  "--lease-seconds", str(LEASE), "--write-rate", "0"]
        if durability == "local":
            common += ["--ship-interval", str(SHIP_INTERVAL), "--max-ship-lag", str(MAX_SHIP_LAG)]
        try:
            owner = procs.ingester(tmp_path / "a", *common, host=a.ip, wrap=a.run([]))
            started.append(owner.start())
            standby = procs.ingester(tmp_path / "standby", *common, "--standby")
            started.append(standby.start())
            reader = procs.reader(tmp_path / "reader", None, store, "--s3-endpoint", s3.endpoint, "--write-rate", "0")
            started.append(reader.start())
            path = "/v1/stream/p"
            assert request(reader, "PUT", path, headers=TEXT)[0] == 201

            writers += [Writer("127.0.0.1", reader.port, path, f"r{i}") for i in range(3)]
            threads += [threading.Thread(target=w.run, args=(stop,)) for w in writers]
            for t in threads:
                t.start()
            side_log = tmp_path / "side-writer.jsonl"
            with open(side_log, "wb") as out:
                side_writer = subprocess.Popen(
                    a.run([sys.executable, "-m", "tests.netwriter", a.ip, str(owner.port), path, "a0"]),
                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            time.sleep(1.5)
            assert all(w.acked for w in writers), "the writers got no acknowledgement before the cut"

            network.cut(a)
            cut = time.time()  # after: a request sent since cannot have reached the old owner
            # The clients behind the reader reach the standby once it holds the lease.
            deadline = time.monotonic() + TAKEOVER_WITHIN
            while sum(1 for w in writers for x in w.acked if x.sent > cut + LEASE) < 30:
                assert time.monotonic() < deadline, f"no acknowledgements from the standby: {_since(writers, cut)}"
                time.sleep(0.1)
            network.heal(a)
            healed = time.time()
            # The old owner hears it was superseded; what it sent late arrives.
            deadline = time.monotonic() + 15
            while "'ds3-fenced': 'true'" not in (fenced := _post_raw(owner, path)):
                assert time.monotonic() < deadline, f"the old owner still answers: {fenced}"
                time.sleep(0.2)
            time.sleep(3.0)
        finally:
            stop.set()
            if side_writer is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(side_writer.pid, 15)
                side_writer.wait(10)
            network.heal(a)
            for t in threads:
                t.join(35)

        side = read_attempts(side_log.read_text())
        body = procs.read_all(reader, path)
        seqs = _lines(body)
        # Every producer's appends are there once each, in order, and every acknowledged one
        # is (local durability: but those the old owner had not shipped); at most the one
        # attempt in flight when a writer stopped is there unacknowledged.
        lost: list[Attempt] = []
        everyone: dict[str, list[Attempt]] = _by_epoch("a0", side)
        for w in writers:
            everyone |= _by_epoch(w.producer, w.attempts)
        for producer, attempts in everyone.items():
            acked = {x.seq: x for x in attempts if x.acked}
            got = seqs.get(producer, [])
            assert got == sorted(set(got)), f"{producer}: duplicated or out of order: {got}"
            lost += [x for s, x in acked.items() if s not in got]
            if got:
                assert got[-1] <= max(acked, default=-1) + 1, f"{producer}: unacknowledged appends: {got[-5:]}"
        assert set(seqs) <= set(everyone), f"appends of epochs no writer used: {set(seqs) - set(everyone)}"
        side_after = [x for x in side if x.acked and x.answered > cut]
        if durability == "store":
            assert not lost, f"acknowledged and lost: {lost}"
            # The old owner acknowledges only once a segment is in the store: not across the cut.
            assert all(x.answered < cut + 0.5 for x in side_after), side_after
        else:
            # The old owner acknowledged until the log was --max-ship-lag behind, no longer,
            # and what is lost was acknowledged at most a ship interval or so before the cut.
            assert all(x.answered < cut + MAX_SHIP_LAG + 0.5 for x in side_after), side_after
            assert all(x.answered > cut - SHIP_INTERVAL - 0.5 for x in lost), lost
        # The client beside the old owner was answered (503), not left hanging.
        waits = [x.answered - x.sent for x in side if x.sent > cut]
        assert waits and max(waits) < 10, f"the old owner kept its client waiting {max(waits, default=0):.1f} s"
        assert not [x for x in side if x.acked and x.sent > healed], "the old owner acknowledged after the heal"
        from_standby = min(x.answered for w in writers for x in w.acked if x.sent > cut)
        print(f"\n{durability}: the standby's first acknowledgement through the reader {from_standby - cut:.2f} s after "
              f"the cut; the old owner's last {max((x.answered for x in side_after), default=cut) - cut:.2f} s "
              f"after it; {sum(len(v) for v in seqs.values())} appends, {len(lost)} acknowledged and lost")

        # An empty disk restoring from the store (the standby gone too) serves the same bytes,
        # once the standby's log has caught up (local durability: it ships in the background).
        deadline = time.monotonic() + 10
        while procs.metric(procs.metrics(standby), "ds3_log_queued_commits") != 0:
            assert time.monotonic() < deadline, "the standby's log does not catch up"
            time.sleep(0.1)
        standby.kill()
        fresh = procs.ingester(tmp_path / "fresh", *common, "--standby")
        started.append(fresh.start())
        deadline = time.monotonic() + TAKEOVER_WITHIN
        while (status := request(reader, "HEAD", path)[0]) != 200:
            assert time.monotonic() < deadline, f"the restored ingester does not serve: {status}"
            time.sleep(0.2)
        assert procs.read_all(reader, path) == body


@contextlib.contextmanager
def _stopping(started: list[procs.Proc]) -> Iterator[None]:
    """Stop every process in `started` on the way out, however the test ends (a process left in
    the owner's namespace would keep it, and its ports, alive)."""
    try:
        yield
    finally:
        for p in reversed(started):
            with contextlib.suppress(ProcessLookupError):
                p.stop()


def _since(writers: list[Writer], t: float) -> dict[str, list[tuple[int, int, int]]]:
    """Each writer's attempts sent after `t`: (epoch, seq, status), runs of one answer folded."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for w in writers:
        runs = out.setdefault(w.producer, [])
        for x in w.attempts:
            if x.sent > t and (not runs or runs[-1] != (x.epoch, x.seq, x.status)):
                runs.append((x.epoch, x.seq, x.status))
    return out


def _post_raw(p: procs.Proc, path: str) -> str:
    """A plain append straight to `p`: its status and headers as one string."""
    try:
        status, headers, body = request(p, "POST", path, b"late\n", TEXT, timeout=2)
    except OSError as e:
        return repr(e)
    return f"{status} {headers} {body[:200]!r}"
