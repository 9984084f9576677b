"""An idempotent producer for tests across a network (tests/netns.py): appends
`<producer>-<epoch>-<seq>\n` with Producer-Id/Epoch/Seq, moving to the next seq only once one is
acknowledged and retrying the same seq after anything else (a 503, a timeout, a reset), as a
client library does. A 409 (a sequence gap: the server lost appends it had acknowledged, which
`--durability local` allows) restarts the producer with the next epoch at seq 0, as a producer
restart does. Every attempt is recorded with wall-clock times, so a test can line outcomes up
with a fault.

Run in a thread (`Writer(...).run(stop)`) or, on another host, as a process that prints one
JSON line per attempt until SIGTERM:

    python -m tests.netwriter HOST PORT PATH PRODUCER
"""

from __future__ import annotations

import http.client
import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TextIO


@dataclass(frozen=True)
class Attempt:
    epoch: int
    seq: int
    status: int  # 0: no answer (timeout, reset, refused)
    sent: float  # time.time()
    answered: float

    @property
    def acked(self) -> bool:
        return self.status in (200, 204)


@dataclass
class Writer:
    host: str
    port: int
    path: str
    producer: str
    timeout: float = 30.0
    attempts: list[Attempt] = field(default_factory=list)
    out: TextIO | None = None  # where each attempt is printed as a JSON line, if anywhere

    def run(self, stop: threading.Event) -> None:
        epoch, seq, conn = 0, 0, None
        while not stop.is_set():
            if conn is None:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            sent = time.time()
            status = 0
            try:
                conn.request("POST", self.path, body=f"{self.producer}-{epoch}-{seq}\n".encode(), headers={
                    "Content-Type": "text/plain", "Producer-Id": self.producer,
                    "Producer-Epoch": str(epoch), "Producer-Seq": str(seq)})
                r = conn.getresponse()
                r.read()
                status = r.status
                if r.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = None
            attempt = Attempt(epoch, seq, status, sent, time.time())
            self.attempts.append(attempt)
            if self.out is not None:
                print(json.dumps(asdict(attempt)), file=self.out, flush=True)
            if attempt.acked:
                seq += 1
            elif status == 409:
                epoch, seq = epoch + 1, 0
            else:
                stop.wait(0.1)
        if conn is not None:
            conn.close()

    @property
    def acked(self) -> list[Attempt]:
        return [a for a in self.attempts if a.acked]


def read_attempts(text: str) -> list[Attempt]:
    """The attempts a writer process printed."""
    return [Attempt(**json.loads(line)) for line in text.splitlines() if line.strip()]


def main(argv: list[str]) -> None:
    host, port, path, producer = argv
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # The loop runs in a thread so that SIGTERM is handled while a request waits; an attempt
    # still waiting then is not printed (its outcome is unknown, as a client killed mid-way).
    t = threading.Thread(target=Writer(host, int(port), path, producer, out=sys.stdout).run, args=(stop,),
                         daemon=True)
    t.start()
    while not stop.wait(0.1) and t.is_alive():
        pass
    t.join(1.0)
    sys.stdout.flush()

if __name__ == "__main__":
    main(sys.argv[1:])
