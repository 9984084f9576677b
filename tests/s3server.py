"""A throwaway S3 for tests: moto's standalone server in a thread of the test process.

moto's in-process mocks (mock_aws) do not patch aiobotocore, so tests talk HTTP to a real
(moto) server on 127.0.0.1 with an ephemeral port, exactly as production talks to MinIO.

Conditional writes: moto 5.2.5 enforces If-None-Match: * and If-Match on put_object (412, and
404 NoSuchKey for If-Match on a missing key, as AWS). It checks and then stores without a lock
of its own, so two racing requests can both pass: the window is a few Python statements, not
hit in 1000 rounds of 8 racers on a quiet machine, but hit once in a CI-like run under load
(two If-Match winners). S3 and MinIO decide a conditional write atomically, so this server
does too: its conditional PUTs run one at a time (_put_object_atomically). It never answers
409 ConditionalRequestConflict (tests fake that one).

    with MotoS3() as s3:             # or s3.start() / s3.stop()
        bucket = s3.new_bucket()
        store = open_store(f"s3://{bucket}/p", s3_endpoint=s3.endpoint)
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Final, Self

import boto3  # type: ignore[import-untyped]
from moto import backends as moto_backends
from moto.s3.responses import S3Response
from moto.server import ThreadedMotoServer

# Dummy credentials and region for botocore; the AWS_* variables that would point elsewhere
# (a developer's profile, endpoint, instance metadata) are cleared while a server runs.
TEST_ENV: Final = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
CLEARED_ENV: Final = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                      "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")

_names = itertools.count()


@contextmanager
def aws_test_env() -> Iterator[None]:
    """Set TEST_ENV (and clear CLEARED_ENV) for the duration, then restore the environment."""
    saved = {k: os.environ.get(k) for k in (*TEST_ENV, *CLEARED_ENV)}
    os.environ.update(TEST_ENV)
    for k in CLEARED_ENV:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_CONDITIONAL_PUTS: Final = threading.Lock()
_moto_put_object = S3Response.put_object


def _put_object_atomically(self: S3Response) -> Any:
    """moto's put_object, one conditional PUT at a time (see the module docstring)."""
    if self.headers.get("If-Match") is None and self.headers.get("If-None-Match") is None:
        return _moto_put_object(self)
    with _CONDITIONAL_PUTS:
        return _moto_put_object(self)


S3Response.put_object = _put_object_atomically  # type: ignore[method-assign]

# moto's dispatcher asks `host in list_of_moto_modules()` for every request, and that lists
# moto's package directory and stats each entry (~150 isdir calls): under the durability
# benchmark's small segment PUTs, 30% of moto's CPU (py-spy, 2026-11-30), which a real S3 never
# charges us. The list cannot change while the process runs: computed once.
_MOTO_MODULES: Final = tuple(moto_backends.list_of_moto_modules())
moto_backends.list_of_moto_modules = lambda: _MOTO_MODULES


class MotoS3:
    """moto's ThreadedMotoServer on 127.0.0.1 (or `ip_address`: a test network's, tests/netns.py),
    port chosen by the OS."""

    def __init__(self, ip_address: str = "127.0.0.1") -> None:
        self.ip_address = ip_address
        self._server: ThreadedMotoServer | None = None
        self._client: Any = None
        self.endpoint = ""

    def start(self) -> None:
        # Every request would otherwise be logged by werkzeug at INFO.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address=self.ip_address, port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        self._server = server
        self.endpoint = f"http://{host}:{port}"

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def client(self) -> Any:
        """A (cached) synchronous boto3 client, for set-up and checks."""
        if self._client is None:
            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint, region_name=TEST_ENV["AWS_DEFAULT_REGION"],
                aws_access_key_id="testing", aws_secret_access_key="testing",
            )
        return self._client

    def new_bucket(self) -> str:
        """Create a bucket with a fresh name (3-63 characters, as S3 requires)."""
        name = f"ds3-test-{next(_names)}-{uuid.uuid4().hex[:8]}"
        self.client().create_bucket(Bucket=name)
        return name

    def drop_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it (moto keeps objects in memory)."""
        c = self.client()
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=name):
            if objs := [{"Key": o["Key"]} for o in page.get("Contents", [])]:
                c.delete_objects(Bucket=name, Delete={"Objects": objs, "Quiet": True})
        c.delete_bucket(Bucket=name)

    def reset(self) -> None:
        """Forget every bucket and object (moto keeps them in memory)."""
        import urllib.request

        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass
