"""A frozen owner (SIGSTOP) behind a reader, with a standby that takes its place: the requests
the reader had sent to it answer 503 once the standby holds the lease, not when the reader's
read timeout (a minute) runs out; the clients' retries go to the standby. In both topologies
that have standbys: the store prefix's single owner (the reader follows its ownership record),
and a cluster member (the reader reads the member's record once a request to it stalls).

Before, a frozen ingester failed nothing: an append sent to it waited 60 s for its 503 (measured
here in both topologies), and for a cluster member the reader did not even look for a standby
until then."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared.placement import Cluster, Ingester
from tests import procs
from tests.procs import request

TEXT = {"Content-Type": "text/plain"}
ANSWERED_WITHIN = 20.0  # the lease (2 s) plus clock skew (1 s) and the record's reads, with room to spare


def _read(reader: procs.Proc, path: str) -> bytes:
    status, _, body = request(reader, "GET", f"{path}?offset=-1")
    assert status == 200, (status, body)
    return body


@dataclass
class Setup:
    a: procs.Proc  # the owner (or member a)
    standby: procs.Proc
    reader: procs.Proc
    others: list[procs.Proc]
    path: str  # a stream a owns

    def stop(self) -> None:
        assert self.a.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.a.popen.pid, signal.SIGCONT)
        for p in (self.reader, self.standby, self.a, *self.others):
            p.stop()


def _logs(setup: Setup) -> str:
    """The last lines of every process's log (what a failure needs: the dirs do not outlive it)."""
    out = []
    for p in (setup.reader, setup.standby, setup.a, *setup.others):
        text = p.log_path.read_text(errors="replace") if p.log_path.exists() else "(no log)"
        out.append(f"--- {p.log_path}:\n" + "\n".join(text.splitlines()[-25:]))
    return "\n".join(out)


def _start(tmp_path: Path, topology: str) -> Setup:
    store_root = tmp_path / "objects"
    pa, pa2, pb = procs.free_port(), procs.free_port(), procs.free_port()
    common = ["--store", store_root.as_uri(), "--durability", "store", "--lease-seconds", "2", "--write-rate", "0"]
    member: list[str] = []
    path = "/v1/stream/s"
    others: list[procs.Proc] = []
    if topology == "cluster member":
        urls = {"a": f"http://127.0.0.1:{pa}", "b": f"http://127.0.0.1:{pb}"}
        procs.write_cluster(store_root, urls)
        cluster = Cluster(1, tuple(Ingester(i, u) for i, u in urls.items()))
        path = "/v1/stream/" + next(s for s in (f"s-{n}" for n in range(100)) if cluster.owner(s).id == "a")
        common += ["--cluster-refresh", "0.5"]
        member = ["--ingester-id", "a"]
        others.append(procs.ingester(tmp_path / "b", *common, "--ingester-id", "b", port=pb).start())
    a = procs.ingester(tmp_path / "a", *common, *member, port=pa).start()
    standby = procs.ingester(tmp_path / "a2", *common, *member, "--standby", port=pa2).start()
    reader = procs.reader(tmp_path / "reader", None, store_root.as_uri(), "--write-rate", "0",
                          *(["--cluster-refresh", "0.5"] if member else [])).start()
    return Setup(a, standby, reader, others, path)


@pytest.mark.parametrize("topology", ["single owner", "cluster member"])
def test_requests_waiting_at_a_frozen_owner_fail_fast_once_a_standby_takes_over(
        tmp_path: Path, topology: str) -> None:
    setup = _start(tmp_path, topology)
    a, reader, path = setup.a, setup.reader, setup.path
    assert a.popen is not None
    try:
        assert request(reader, "PUT", path, headers=TEXT)[0] == 201
        for i in range(10):
            assert request(reader, "POST", path, b"%d\n" % i, TEXT)[0] == 204
        os.kill(a.popen.pid, signal.SIGSTOP)
        answers: dict[str, tuple[int, dict[str, str], float]] = {}

        def send(name: str, method: str, to: str, body: bytes) -> None:
            started = time.monotonic()
            status, headers, _ = request(reader, method, to, body, TEXT, timeout=45)
            answers[name] = (status, headers, time.monotonic() - started)

        # an append (the reader's lane) and a create (aiohttp's path), both waiting at a
        sending = [threading.Thread(target=send, args=("append", "POST", path, b"frozen\n")),
                   threading.Thread(target=send, args=("create", "PUT", path + "-new", b""))]
        for t in sending:
            t.start()
        for t in sending:
            t.join(50)
        assert set(answers) == {"append", "create"}, f"unanswered in 45 s: {answers}\n{_logs(setup)}"
        for name, (status, headers, took) in answers.items():
            assert status == 503 and headers.get("retry-after"), (name, status)
            assert took < ANSWERED_WITHIN, f"the {name} waited {took:.1f} s at the frozen owner"
        # the clients' retries reach the standby
        deadline = time.monotonic() + ANSWERED_WITHIN
        while (status := request(reader, "POST", path, b"after\n", TEXT)[0]) != 204:
            assert status == 503 and time.monotonic() < deadline, status
            time.sleep(0.2)
        assert _read(reader, path) == b"".join(b"%d\n" % i for i in range(10)) + b"after\n"
        metrics = request(reader, "GET", "/metrics")[2].decode()
        assert "ds3_reader_abandoned_total 2.0" in metrics, [m for m in metrics.splitlines() if "abandon" in m]
        print(f"\n{topology}: waiting requests answered 503 after "
              + ", ".join(f"{took:.2f} s ({name})" for name, (_, _, took) in sorted(answers.items())))
        # the old owner resumed acknowledges nothing, and the stream is the standby's
        os.kill(a.popen.pid, signal.SIGCONT)
        assert request(a, "POST", path, b"late\n", TEXT)[0] == 503
        # once it has read the record, its refusal names who took over (it said "another ingester")
        deadline = time.monotonic() + 10
        while b"took it over" not in (said := request(a, "POST", path, b"late\n", TEXT))[2]:
            assert said[0] == 503 and time.monotonic() < deadline, said
            time.sleep(0.1)
        assert setup.standby.url.encode() in said[2], said
        assert _read(reader, path) == b"".join(b"%d\n" % i for i in range(10)) + b"after\n"
    finally:
        setup.stop()


def test_a_member_resumed_after_its_standby_took_over_sends_readers_to_the_standby(tmp_path: Path) -> None:
    """Frozen with no request waiting on it, a member's standby takes over; resumed, the old
    member answers 503 (fenced), alive: no forward failed, so the reader kept sending it the
    member's streams (until `ds3 cluster set`). Its 503 says it is fenced (DS3-Fenced), and the
    reader looks the member up as after a failed forward."""
    setup = _start(tmp_path, "cluster member")
    a, reader, path = setup.a, setup.reader, setup.path
    assert a.popen is not None
    try:
        assert request(reader, "PUT", path, headers=TEXT)[0] == 201
        assert request(reader, "POST", path, b"0\n", TEXT)[0] == 204
        os.kill(a.popen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while request(setup.standby, "GET", "/readyz")[0] != 200:  # it holds the lease
            assert time.monotonic() < deadline, "the standby never took over"
            time.sleep(0.2)
        os.kill(a.popen.pid, signal.SIGCONT)
        status, headers, _ = request(a, "POST", path, b"late\n", TEXT)
        assert status == 503 and headers.get("ds3-fenced") == "true"
        deadline, refused = time.monotonic() + ANSWERED_WITHIN, 0
        while (status := request(reader, "POST", path, b"1\n", TEXT)[0]) != 204:
            assert status == 503 and time.monotonic() < deadline, (status, refused)
            refused += 1
            time.sleep(0.2)
        assert _read(reader, path) == b"0\n1\n"
        print(f"\n{refused} appends refused by the resumed old member before the reader went to the standby")
    finally:
        setup.stop()


@pytest.mark.parametrize("topology", ["single owner", "cluster member"])
def test_a_request_on_aiohttps_path_at_a_frozen_owner_fails_fast_too(tmp_path: Path, topology: str) -> None:
    """A request the reader's lane does not take (a client's `Connection: close`) waits on
    aiohttp's path; alone at the frozen owner, it is watched for stalls as well (it waited the
    read timeout, a minute, when nothing on the lane tripped the watch)."""
    setup = _start(tmp_path, topology)
    a, reader, path = setup.a, setup.reader, setup.path
    assert a.popen is not None
    try:
        assert request(reader, "PUT", path, headers=TEXT)[0] == 201
        os.kill(a.popen.pid, signal.SIGSTOP)
        started = time.monotonic()
        try:
            status, headers, _ = request(reader, "POST", path, b"x\n", {**TEXT, "Connection": "close"}, timeout=45)
        except TimeoutError:
            pytest.fail("no answer in 45 s at the frozen owner:\n" + _logs(setup))
        took = time.monotonic() - started
        assert status == 503 and headers.get("retry-after"), status
        assert took < ANSWERED_WITHIN, f"waited {took:.1f} s at the frozen owner"
    finally:
        setup.stop()
