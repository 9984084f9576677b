"""moto's S3 as a process of its own that keeps HTTP connections alive, as S3 and MinIO do.

`moto_server` runs moto's WSGI app on werkzeug's development server, which answers every
request with `Connection: close` (werkzeug/serving.py: "Always close the connection"; its
http.server base cannot drain a body before the next request line). Every store request of a
benchmark then pays a new TCP connection and a new server thread, which no real object store
charges: the durability benchmark's `store` mode (one PUT per group commit) measured against
that would be measuring werkzeug. This serves the same app (and the same conditional-write
lock, tests/s3server.py) with waitress, a production WSGI server with HTTP/1.1 keep-alive.

    python -m tests.moto_keepalive --host 127.0.0.1 --port 5000
    with MotoProcess() as s3: ...        # the same, started and stopped for a benchmark
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

import waitress  # type: ignore[import-untyped]
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from waitress.task import WSGITask  # type: ignore[import-untyped]

from tests.procs import free_port
from tests.s3server import MotoS3  # (importing it installs the atomic conditional PUT)

ROOT = Path(__file__).resolve().parent.parent


class MotoProcess(MotoS3):
    """This server as a process of its own (in a benchmark's process it would share a GIL with
    the benchmark's client); `keepalive=False`: `moto_server` itself (werkzeug), which writes
    each answer straight to its socket from the request's thread, where waitress hands it to its
    event loop thread to send. For large objects that costs: scripts/bench catchup (8 MiB
    chunks, 2026-11-29) measured moto at 1.76 CPU-s per GiB on direct GETs and 2.24-2.56 on the
    reader's under waitress, 1.28 and 1.44-1.76 under moto_server, and the reader's ratio
    0.68-0.86 against 0.85-1.06: that benchmark keeps moto_server, whose connection set-up is
    nothing beside an 8 MiB answer."""

    def __init__(self, ip_address: str = "127.0.0.1", keepalive: bool = True) -> None:
        super().__init__(ip_address)
        self.keepalive = keepalive

    def start(self) -> None:
        port = free_port()
        if self.keepalive:
            cmd = [sys.executable, "-m", "tests.moto_keepalive", "--host", self.ip_address, "--port", str(port)]
        else:
            cmd = [str(Path(sys.executable).with_name("moto_server")), "-H", self.ip_address, "-p", str(port)]
        self._proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://{self.ip_address}:{port}"
        from tests.cluster import wait_for  # (tests.cluster imports much more than this module needs)

        wait_for(self._answers, 20, "moto (tests/moto_keepalive.py)")

    def _answers(self) -> bool:
        if self._proc.poll() is not None:
            raise RuntimeError(f"tests/moto_keepalive.py exited with {self._proc.returncode}")
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        super().stop()  # (its boto3 client)
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_build_response_header = WSGITask.build_response_header


def _keep_alive_without_body(self: WSGITask) -> Any:
    """waitress closes the connection after any HTTP/1.1 answer with no Content-Length, even
    one that has no body by definition (204, 304, 1xx: RFC 9112 forbids Content-Length on a
    204): every DELETE (moto answers 204) would cost a new connection. Those keep it."""
    closing = (self.has_body or self.version != "1.1" or self.close_on_finish
               or self.request.headers.get("CONNECTION", "").lower() == "close"
               or any(k.lower() == "connection" and v.lower() == "close" for k, v in self.response_headers))
    if closing:
        return _build_response_header(self)
    self.set_close_on_finish = lambda: None  # (for this call: an instance attribute over the method)
    try:
        return _build_response_header(self)
    finally:
        del self.set_close_on_finish


WSGITask.build_response_header = _keep_alive_without_body


def _exit(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=8, help="waitress worker threads")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit)
    logging.getLogger("waitress").setLevel(logging.ERROR)
    app = DomainDispatcherApplication(create_backend_app)
    # A chunk object is a few MiB: waitress would otherwise spool bodies over 512 KiB (and
    # answers over 1 MiB) to temporary files, and read in 8 KiB pieces.
    waitress.serve(app, host=args.host, port=args.port, threads=args.threads,
                   inbuf_overflow=64 << 20, outbuf_overflow=64 << 20, recv_bytes=1 << 16,
                   channel_timeout=300, connection_limit=1000, ident="moto")


if __name__ == "__main__":
    main()
