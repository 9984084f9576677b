"""Domain errors. One function maps them to HTTP statuses for both services:
shared.http.handlers.error_response (the status each class names below)."""

from __future__ import annotations

from datetime import UTC, datetime


class DS3Error(Exception):
    """Base class; `message` is safe to show to the client."""

    # Set on a 503 that replaced a write's success when its commit did not reach the object
    # store (ingester/wal.py): the write is in the WAL and may yet take effect (shipped later),
    # so what it refers to (a snapshot's blob) must stay.
    in_wal = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(DS3Error):
    """Malformed input: headers, offsets, paths, bodies (400)."""


class UnreadableBody(BadRequest):
    """The request body cannot be read to its end, e.g. it stops short of its Content-Length
    or its chunked framing is broken (400; the connection is closed: where the next request
    would start is unknown, and aiohttp would otherwise read on into the broken body and log
    its error as unhandled). A body read whole that does not decode with its Content-Encoding
    is a plain BadRequest (shared.http.codings)."""


class NotFound(DS3Error):
    """No such stream (or it expired) (404)."""


class Gone(DS3Error):
    """The stream was deleted but forks still read its data (410)."""


class Retained(Gone):
    """The offset is older than the stream's earliest retained offset (its latest snapshot):
    410 with a JSON body naming that offset, so the client can bootstrap (extensions §2.2)."""

    def __init__(self, earliest_offset: str, message: str | None = None) -> None:
        super().__init__(message or "offset is before the earliest retained offset: bootstrap from the snapshot")
        self.earliest_offset = earliest_offset


class Conflict(DS3Error):
    """The request conflicts with the stream's state or configuration (409)."""


class StreamClosed(Conflict):
    """Append to a closed stream (409 with Stream-Closed and the final offset)."""

    def __init__(self, final_offset: str) -> None:
        super().__init__("stream is closed")
        self.final_offset = final_offset


class PayloadTooLarge(DS3Error):
    """Request body over the configured limit (413)."""


class UnsupportedMediaType(DS3Error):
    """The request body's Content-Encoding names a coding the server does not decode (415,
    with Accept-Encoding naming the ones it does: RFC 9110 §15.5.16, §12.5.3)."""


class StaleProducerEpoch(DS3Error):
    """Zombie fencing: the producer's epoch is older than the server's (403)."""

    def __init__(self, current_epoch: int) -> None:
        super().__init__(f"stale producer epoch; current epoch is {current_epoch}")
        self.current_epoch = current_epoch


class ProducerSeqGap(Conflict):
    """Producer-Seq skipped ahead (409 with expected/received)."""

    def __init__(self, expected: int, received: int) -> None:
        super().__init__(f"producer sequence gap: expected {expected}, received {received}")
        self.expected = expected
        self.received = received


class Unavailable(DS3Error):
    """The server cannot take this request now; retry later (503)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class IngesterUnreachable(Unavailable):
    """A reader could not reach (or lost the connection to) the ingester it forwarded to."""


# ---------------------------------------------------------------- object store
# Each ObjectStore implementation converts its own client errors into these (shared.objectstore),
# so callers never see botocore or OSError details.


class ObjectStoreError(DS3Error):
    """The object store refused a request for a reason that retrying will not fix (502: the
    gateway's upstream failed, not this server)."""


class ObjectNotFound(ObjectStoreError):
    """No object under that key (S3 NoSuchKey / 404, or no such file)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"object not found: {key}")
        self.key = key


class PreconditionFailed(ObjectStoreError):
    """A conditional write lost (S3 412): put(if_absent=True) found the key already there, or
    put(if_match=etag) found it missing or holding another version. Callers catch it: it is
    an answer about the store's state, never sent to a client as such."""

    def __init__(self, key: str, why: str = "object already exists") -> None:
        super().__init__(f"{why}: {key}")
        self.key = key


class ObjectStoreUnavailable(Unavailable, ObjectStoreError):
    """The store cannot be reached or answered 5xx / throttled: retry later (503)."""


# ---------------------------------------------------------------- ownership of a store prefix
# shared.ownership: exactly one ingester writes a store prefix at a time.


class OwnedElsewhere(Unavailable):
    """acquire() refused: another ingester holds a live lease on the store prefix (503; a
    standby retries once the lease has lapsed)."""

    def __init__(self, owner_id: str, advertise_url: str, epoch: int, lease_expires_at: float,
                 retry_after: int = 1) -> None:
        until = datetime.fromtimestamp(lease_expires_at, UTC).isoformat(timespec="milliseconds")
        super().__init__(f"store prefix is owned by {owner_id} ({advertise_url or 'no URL'}, epoch {epoch}) "
                         f"until at least {until}", retry_after)
        self.owner_id = owner_id
        self.advertise_url = advertise_url
        self.epoch = epoch
        self.lease_expires_at = lease_expires_at


class Superseded(Unavailable):
    """This process no longer owns the store prefix (503): another ingester took it over, its
    lease lapsed before it could be renewed, or it released it. It is fenced: it must write and
    acknowledge nothing more under that ownership."""

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch


# ---------------------------------------------------------------- placement (issue 15)
# shared.placement / shared.cluster: every stream belongs to one ingester of the cluster.


class Misdirected(DS3Error):
    """This ingester does not own the stream (or bucket): 421 Misdirected Request, naming the
    owner (in the message and in the DS3-Owner / DS3-Owner-Id headers) so a router can follow
    it. Nothing was read or written."""

    def __init__(self, owner_id: str, owner_url: str, generation: int, me: str) -> None:
        super().__init__(f"misdirected: this stream belongs to ingester {owner_id} at {owner_url}, not to "
                         f"{me} (cluster generation {generation}); send the request to {owner_url}")
        self.owner_id = owner_id
        self.owner_url = owner_url
        self.generation = generation


class ClusterChanged(Conflict):
    """A conditional write of the cluster description lost: someone else changed it since it
    was read (409 for an API; `ds3 cluster set` says so and changes nothing)."""

    def __init__(self, message: str, current_generation: int) -> None:
        super().__init__(message)
        self.current_generation = current_generation


# ---------------------------------------------------------------- access control and limits


class Unauthorized(DS3Error):
    """No credentials, or bad ones (401 with WWW-Authenticate). `error` is the RFC 6750 error
    code ("invalid_token", "invalid_request") or None when no credentials were sent."""

    def __init__(self, message: str, error: str | None = None) -> None:
        super().__init__(message)
        self.error = error


class Forbidden(DS3Error):
    """Valid credentials without the scope this request needs (403)."""


class RequestTimeout(DS3Error):
    """The request body did not arrive in time (408; the connection is closed)."""


class TooManyRequests(DS3Error):
    """A per-client rate or connection limit was reached (429 with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
