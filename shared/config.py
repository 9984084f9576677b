"""Configuration: frozen dataclasses built from the CLI / environment, validated at start
with errors that name the setting."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from ipaddress import ip_network
from pathlib import Path
from urllib.parse import urlparse

MiB = 1024 * 1024
GiB = 1024 * MiB
LMDB_MAX_KEY = 480  # LMDB keys are at most 511 bytes; stream paths are keys
# Peers trusted by default to name the client in X-Forwarded-For: loopback and private
# networks, where readers and load balancers live (README "Deploying with auth").
PRIVATE_NETWORKS = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")


class ConfigError(ValueError):
    """A setting is invalid; the message names it."""


def _check_store_url(url: str) -> None:
    """The store URL means a store (shared.objectstore.parse_store_url, the one parser), so a
    bad one stops the process at start with the setting named, not at first use."""
    from shared.objectstore.url import FileStoreURL, StoreURLError, parse_store_url  # it imports this module

    try:
        parsed = parse_store_url(url)
    except StoreURLError as e:
        raise ConfigError(f"store (DS3_STORE): {e}") from None
    if isinstance(parsed, FileStoreURL) and parsed.root.exists() and not parsed.root.is_dir():
        # (a traceback from the store's mkdir at the first write: found by QA)
        raise ConfigError(f"store (DS3_STORE): {parsed.root} is a file, not a directory")


def check_s3_endpoint(url: str | None) -> None:
    """An S3 endpoint is an http(s):// URL with a host (botocore took "127.0.0.1:9000" for
    one and failed at the first request with a traceback: found by QA)."""
    if url is None:
        return
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:  # a port that is not a number, or out of range
        ok = False
    _need(ok, "s3-endpoint (DS3_S3_ENDPOINT)",
          f"must be an http:// or https:// URL with a host, such as http://127.0.0.1:9000 (got {url!r})")


def check_shared(*, port: int, long_poll_timeout: float, seal_bytes: int, seal_age: float) -> None:
    """The settings `ds3 dev` takes and hands to its ingester, checked before it starts anything
    (the ingester's config checks them the same way)."""
    _need(0 <= port <= 65535, "port (DS3_PORT)", f"{port} is not a TCP port")
    _need(0.1 <= long_poll_timeout <= 3600, "long-poll-timeout (DS3_LONG_POLL_TIMEOUT)",
          "must be between 0.1 and 3600 seconds")
    _need(1024 <= seal_bytes <= 1024 * MiB, "seal-bytes (DS3_SEAL_BYTES)", "must be between 1 KiB and 1 GiB")
    _need(0.05 <= seal_age <= 86400, "seal-age (DS3_SEAL_AGE)", "must be between 0.05 s and a day")


def make_data_dir(path: Path) -> None:
    """Create the data dir (and its parents) if missing. One that cannot be a directory this
    process writes in (a file, a file on the way, no permission) is a ConfigError naming the
    setting: found at start, not as an OSError traceback from the first use."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"data-dir (DS3_DATA_DIR): {path} exists and is not a directory") from None
    except OSError as e:
        raise ConfigError(f"data-dir (DS3_DATA_DIR): cannot create {path}: {e.strerror or e}") from None
    _need(os.access(path, os.W_OK | os.X_OK), "data-dir (DS3_DATA_DIR)", f"{path} is not writable")


def _check_body_limits(*, max_snapshot_bytes: int, max_body_bytes: int) -> None:
    """The largest snapshot and request body: the ingester and the reader check them the same way."""
    _need(1 <= max_snapshot_bytes <= 4096 * MiB, "max-snapshot-bytes (DS3_MAX_SNAPSHOT_BYTES)",
          "must be between 1 byte and 4 GiB")
    _need(1 <= max_body_bytes <= 1024 * MiB, "max-body-bytes (DS3_MAX_BODY_BYTES)",
          "must be between 1 byte and 1 GiB")


def _need(ok: bool, setting: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{setting}: {why}")


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Access control (shared/auth/policy.py; README "Deploying with auth"). Auth is on when any
    credential source is set: then writes need a bearer token with write scope, and reads
    of `private` prefixes/buckets need one with read scope. The files and keys are loaded
    (and checked) by shared.auth.policy.Authenticator at start."""

    tokens_file: Path | None = None  # JSON list of static tokens with their scopes
    tokens: str | None = None  # the same JSON, inline (DS3_TOKENS)
    jwt_secret: str | None = None  # HS256 shared secret
    jwks_file: Path | None = None  # RS256/ES256 public keys (a JWK Set)
    jwks_url: str | None = None  # ... fetched from an http(s) URL and cached
    jwt_issuer: str | None = None  # `iss` must equal this when set
    jwt_audience: str | None = None  # `aud` must contain this when set
    jwt_leeway: float = 30.0  # clock skew allowed on exp / nbf / iat
    jwks_cache_seconds: float = 300.0  # how long keys fetched from jwks_url are trusted
    private: tuple[str, ...] = ()  # grants (stream:<prefix>, bucket:<id>[/<prefix>], *) whose reads need a token
    internal_token: str | None = None  # shared by the ingester and its readers (/_ds3/, reader identity)

    def __post_init__(self) -> None:
        _need(self.jwt_secret is None or len(self.jwt_secret.encode()) >= 32, "jwt-secret (DS3_JWT_SECRET)",
              "must be at least 32 bytes (HS256 keys shorter than the hash are guessable)")
        _need(self.jwks_url is None or urlparse(self.jwks_url).scheme in ("http", "https"),
              "jwks-url (DS3_JWKS_URL)", "must be an http(s):// URL")
        _need(self.jwks_file is None or self.jwks_file.is_file(), "jwks-file (DS3_JWKS_FILE)",
              f"{self.jwks_file} is not a readable file")
        _need(self.tokens_file is None or self.tokens_file.is_file(), "tokens-file (DS3_TOKENS_FILE)",
              f"{self.tokens_file} is not a readable file")
        _need(0 <= self.jwt_leeway <= 3600, "jwt-leeway (DS3_JWT_LEEWAY)", "must be between 0 and 3600 seconds")
        _need(1 <= self.jwks_cache_seconds <= 86400, "jwks-cache-seconds (DS3_JWKS_CACHE_SECONDS)",
              "must be between 1 second and a day")
        _need(self.internal_token is None or len(self.internal_token) >= 16,
              "internal-token (DS3_INTERNAL_TOKEN)", "must be at least 16 characters")
        _need(not self.private or self.enabled, "private (DS3_PRIVATE)",
              "private reads need a credential source: set tokens-file, tokens, jwt-secret, jwks-file or jwks-url")

    @property
    def enabled(self) -> bool:
        """Some credential source is configured, so writes need a token."""
        return self.tokens_file is not None or self.tokens is not None or self.accepts_jwt

    @property
    def accepts_jwt(self) -> bool:
        """A JWT key source is configured (a secret, a JWK Set file or URL)."""
        return any(x is not None for x in (self.jwt_secret, self.jwks_file, self.jwks_url))

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Per-client limits (shared/limits.py). A client is its token's subject, else its IP
    address (from X-Forwarded-For when the peer is one of `trusted_proxies`). A trusted
    proxy's own requests (no X-Forwarded-For) and those a reader makes with the internal
    token are not limited: the proxy or reader limits its own clients. A rate of 0 turns
    that limit off."""

    write_rate: float = 500.0  # PUT/POST/DELETE per second per client (token bucket refill)
    write_burst: int = 2000  # ... and how many may come at once
    create_rate: float = 50.0  # PUT (stream and bucket creation) per second per client
    create_burst: int = 500
    max_live_per_client: int = 100  # concurrent long-polls + SSE connections per client (0: no cap)
    body_timeout: float = 60.0  # a request body must arrive within this many seconds (else 408)
    send_timeout: float = 30.0  # a client that takes nothing we send for this long is dropped
    keepalive_timeout: float = 75.0  # idle connections close; also bounds sending the request head
    trusted_proxies: tuple[str, ...] = PRIVATE_NETWORKS  # CIDRs whose X-Forwarded-For names the client

    def __post_init__(self) -> None:
        _need(0 <= self.write_rate <= 1e6, "write-rate (DS3_WRITE_RATE)", "must be between 0 (off) and 1000000")
        _need(1 <= self.write_burst <= 1_000_000, "write-burst (DS3_WRITE_BURST)", "must be between 1 and 1000000")
        _need(0 <= self.create_rate <= 1e6, "create-rate (DS3_CREATE_RATE)", "must be between 0 (off) and 1000000")
        _need(1 <= self.create_burst <= 1_000_000, "create-burst (DS3_CREATE_BURST)",
              "must be between 1 and 1000000")
        _need(0 <= self.max_live_per_client <= 1_000_000, "max-live-per-client (DS3_MAX_LIVE_PER_CLIENT)",
              "must be between 0 (no cap) and 1000000")
        _need(0.1 <= self.body_timeout <= 3600, "body-timeout (DS3_BODY_TIMEOUT)",
              "must be between 0.1 and 3600 seconds")
        _need(0.1 <= self.send_timeout <= 3600, "send-timeout (DS3_SEND_TIMEOUT)",
              "must be between 0.1 and 3600 seconds")
        _need(1 <= self.keepalive_timeout <= 3600, "keepalive-timeout (DS3_KEEPALIVE_TIMEOUT)",
              "must be between 1 and 3600 seconds")
        for cidr in self.trusted_proxies:
            try:
                ip_network(cidr, strict=False)
            except ValueError:
                raise ConfigError(f"trusted-proxies (DS3_TRUSTED_PROXIES): {cidr!r} is not an IP address or CIDR") from None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True, slots=True)
class IngesterConfig:
    host: str = "127.0.0.1"
    port: int = 4437
    data_dir: Path = Path(".ds3")
    long_poll_timeout: float = 30.0
    tail_max_age: int = 1  # seconds shared caches may keep an empty tail page or a long-poll 204
    sse_max_seconds: float = 60.0
    max_body_bytes: int = 64 * MiB
    max_snapshot_bytes: int = 64 * MiB
    max_read_bytes: int = 1 * MiB
    max_path_bytes: int = LMDB_MAX_KEY
    wal_map_size: int = 256 * GiB
    sweep_interval: float = 1.0
    read_threads: int = 4
    store: str | None = None  # s3://bucket/prefix or file:///path; None: the WAL keeps all
    s3_endpoint: str | None = None
    seal_bytes: int = 8 * MiB
    seal_age: float = 60.0
    wal_max_bytes: int = 4 * GiB
    uploads: int = 4
    # Placement (issue 15; shared.placement): this ingester's id in the cluster description,
    # read from the store (_ds3/cluster.json) or from a file. None: no cluster, it owns every stream.
    ingester_id: str | None = None
    cluster: Path | None = None  # a description file instead of the store's (ds3 dev, tests)
    cluster_refresh: float = 5.0  # seconds between reads of the description
    # The commit log in the store (issue 14; only with a store): when an append is acknowledged
    # (after the local fsync, or after its log segment is in the store), how far behind the log
    # may lag in `local` mode, how often the whole WAL is checkpointed into the store.
    durability: str = "local"
    ship_interval: float = 1.0
    # local durability: past this many seconds of log not in the store (a store outage, a
    # partition), appends answer 503 instead of being acknowledged: what a lost disk, or a
    # standby's takeover, can lose stays bounded (0: no bound; None: 5 s, or three intervals).
    max_ship_lag: float | None = None
    checkpoint_interval: float = 300.0
    log_uploads: int = 4  # store durability: log segment PUTs in flight at once (1-4)
    # Ownership of the store prefix (shared/ownership.py; only with a store).
    advertise_url: str | None = None  # None: http://{host}:{port}
    owner_id: str | None = None  # None: a random id kept in <data-dir>/owner-id
    lease_seconds: float = 10.0
    # --standby: wait for the owner's lease to lapse, then take the prefix over (restoring the
    # WAL from the store's log); until then, stream requests answer 503 naming the owner.
    standby: bool = False
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    @property
    def ship_lag_bound(self) -> float:
        """--max-ship-lag as it applies (0: no bound)."""
        if self.max_ship_lag is not None:
            return self.max_ship_lag
        return max(5.0, 3 * self.ship_interval)

    def __post_init__(self) -> None:
        _need(bool(self.host), "host (DS3_HOST)", "must not be empty")
        self._check_cluster()
        _need(self.durability in ("local", "store"), "durability (DS3_DURABILITY)",
             f"{self.durability!r} is not one of: local, store")
        _need(self.durability == "local" or self.store is not None, "durability (DS3_DURABILITY)",
             "store needs an object store (--store / DS3_STORE)")
        _need(0.01 <= self.ship_interval <= 3600, "ship-interval (DS3_SHIP_INTERVAL)",
             "must be between 0.01 and 3600 seconds")
        _need(self.max_ship_lag is None or (self.durability == "local" and self.store is not None),
              "max-ship-lag (DS3_MAX_SHIP_LAG)", "applies only to --durability local with a --store (in store "
              "mode nothing is acknowledged before its segment is in the store)")
        _need(self.max_ship_lag is None or self.max_ship_lag == 0
              or self.ship_interval <= self.max_ship_lag <= 86400,
              "max-ship-lag (DS3_MAX_SHIP_LAG)",
              f"must be 0 (no bound) or between --ship-interval ({self.ship_interval:g} s) and 86400 seconds")
        _need(1 <= self.log_uploads <= 4, "log-uploads (DS3_LOG_UPLOADS)", "must be between 1 and 4")
        _need(1 <= self.checkpoint_interval <= 7 * 86400, "checkpoint-interval (DS3_CHECKPOINT_INTERVAL)",
             "must be between 1 second and a week")
        _need(self.advertise_url is None or self.advertise_url.startswith(("http://", "https://")),
             "advertise-url (DS3_ADVERTISE_URL)", "must be an http(s):// URL")
        _need(self.owner_id is None or 0 < len(self.owner_id) <= 200, "owner-id (DS3_OWNER_ID)",
             "must be 1 to 200 characters")
        _need(not self.standby or self.store is not None, "standby (DS3_STANDBY)",
             "needs an object store (--store / DS3_STORE): the standby restores from its log")
        _need(1 <= self.lease_seconds <= 3600, "lease-seconds (DS3_LEASE_SECONDS)",
             "must be between 1 and 3600 seconds")
        check_shared(port=self.port, long_poll_timeout=self.long_poll_timeout, seal_bytes=self.seal_bytes,
                     seal_age=self.seal_age)
        _need(0 <= self.tail_max_age <= 60, "tail-max-age (DS3_TAIL_MAX_AGE)", "must be between 0 and 60 seconds")
        _need(1 <= self.sse_max_seconds <= 3600, "sse-max-seconds (DS3_SSE_MAX_SECONDS)",
             "must be between 1 and 3600 seconds")
        _check_body_limits(max_snapshot_bytes=self.max_snapshot_bytes, max_body_bytes=self.max_body_bytes)
        _need(1024 <= self.max_read_bytes <= 256 * MiB, "max-read-bytes (DS3_MAX_READ_BYTES)",
             "must be between 1 KiB and 256 MiB")
        _need(1 <= self.max_path_bytes <= LMDB_MAX_KEY, "max-path-bytes (DS3_MAX_PATH_BYTES)",
             f"must be between 1 and {LMDB_MAX_KEY}")
        _need(self.wal_map_size >= 16 * MiB, "wal-map-size (DS3_WAL_MAP_SIZE)", "must be at least 16 MiB")
        _need(0.05 <= self.sweep_interval <= 3600, "sweep-interval (DS3_SWEEP_INTERVAL)",
             "must be between 0.05 and 3600 seconds")
        _need(1 <= self.read_threads <= 64, "read-threads (DS3_READ_THREADS)", "must be between 1 and 64")
        if self.store is not None:
            _check_store_url(self.store)
        check_s3_endpoint(self.s3_endpoint)
        _need(self.wal_max_bytes >= 2 * self.seal_bytes, "wal-max-bytes (DS3_WAL_MAX_BYTES)",
             "must be at least twice seal-bytes")
        _need(1 <= self.uploads <= 64, "uploads (DS3_UPLOADS)", "must be between 1 and 64")

    def _check_cluster(self) -> None:
        from shared.cluster import load_cluster_file
        from shared.placement import PlacementError, validate_id

        _need(0.1 <= self.cluster_refresh <= 3600, "cluster-refresh (DS3_CLUSTER_REFRESH)",
             "must be between 0.1 and 3600 seconds")
        if self.ingester_id is None:
            _need(self.cluster is None, "cluster (DS3_CLUSTER)",
                 "needs ingester-id (DS3_INGESTER_ID): this ingester's id in the description")
            return
        try:
            validate_id(self.ingester_id)
        except PlacementError as e:
            raise ConfigError(f"ingester-id (DS3_INGESTER_ID): {e}") from None
        if self.cluster is None:
            _need(self.store is not None, "ingester-id (DS3_INGESTER_ID)",
                 "the cluster description is read from the store (--store, its _ds3/cluster.json) or from a "
                 "file (--cluster FILE): give one of them")
            return
        try:
            cluster = load_cluster_file(self.cluster)
        except PlacementError as e:
            raise ConfigError(f"cluster (DS3_CLUSTER): {e}") from None
        # A member of the previous description may run too: a removed ingester handing its
        # streams over (it retires once it holds nothing: ingester/moves.py, ds3/retiring.py).
        leaving = cluster.previous is not None and cluster.previous.get(self.ingester_id) is not None
        _need(cluster.get(self.ingester_id) is not None or leaving, "ingester-id (DS3_INGESTER_ID)",
             f"{self.ingester_id!r} is not in the cluster file {self.cluster} (its ingesters: "
             f"{', '.join(cluster.ids)})")

    @property
    def wal_dir(self) -> Path:
        return self.data_dir / "wal"

    @property
    def advertised(self) -> str:
        """The URL this ingester names in the ownership record."""
        if self.advertise_url is not None:
            return self.advertise_url
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True, slots=True)
class ReaderConfig:
    ingester: str | None  # base URL of the ingester, e.g. http://127.0.0.1:4438 (without a cluster description)
    store: str  # s3://bucket/prefix or file:///path
    host: str = "127.0.0.1"
    port: int = 4437
    s3_endpoint: str | None = None
    long_poll_timeout: float = 30.0  # how long the ingester holds a long-poll (upstream timeouts)
    tail_max_age: int = 1  # seconds shared caches may keep a long-poll 204 the reader answers itself
    max_read_bytes: int = 16 * MiB  # a sealed response covers at most this much of a chunk (a chunk sealed at 8 MiB overshoots by its last append: one response carries it whole)
    max_body_bytes: int = 64 * MiB
    max_snapshot_bytes: int = 64 * MiB
    max_path_bytes: int = LMDB_MAX_KEY
    descriptor_ttl: float = 1.0  # seconds a stream descriptor, or a chunk found missing, is trusted before asking again
    sse_max_seconds: float = 60.0  # SSE client connections are closed after this long
    workers: int = 1  # processes sharing the port (reader/workers.py)
    # Routing (issue 15; reader/routing.py): the cluster description from this file instead of
    # the store's _ds3/cluster.json; with neither, every request goes to `ingester`, or without
    # one, to the ingester the store's ownership record names (shared/owner_watch.py).
    cluster: Path | None = None
    cluster_refresh: float = 5.0  # seconds between reads of the description
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    def __post_init__(self) -> None:
        _need(1 <= self.workers <= 256, "workers (DS3_WORKERS)", f"{self.workers} is not between 1 and 256")
        # neither: the reader follows the store prefix's owner (its ownership record's URL)
        _need(self.ingester is None or self.ingester.startswith(("http://", "https://")), "ingester (DS3_INGESTER)",
             "must be an http(s):// URL")
        _need(0.1 <= self.cluster_refresh <= 3600, "cluster-refresh (DS3_CLUSTER_REFRESH)",
             "must be between 0.1 and 3600 seconds")
        if self.cluster is not None:
            from shared.cluster import load_cluster_file
            from shared.placement import PlacementError

            try:
                load_cluster_file(self.cluster)
            except PlacementError as e:
                raise ConfigError(f"cluster (DS3_CLUSTER): {e}") from None
        _check_store_url(self.store)
        check_s3_endpoint(self.s3_endpoint)
        _need(0 <= self.port <= 65535, "port (DS3_PORT)", f"{self.port} is not a TCP port")
        _need(0 <= self.tail_max_age <= 60, "tail-max-age (DS3_TAIL_MAX_AGE)", "must be between 0 and 60 seconds")
        _need(0.1 <= self.long_poll_timeout <= 3600, "long-poll-timeout (DS3_LONG_POLL_TIMEOUT)",
             "must be between 0.1 and 3600 seconds")
        _need(1024 <= self.max_read_bytes <= 1024 * MiB, "max-read-bytes (DS3_MAX_READ_BYTES)",
             "must be between 1 KiB and 1 GiB")
        _check_body_limits(max_snapshot_bytes=self.max_snapshot_bytes, max_body_bytes=self.max_body_bytes)
        _need(0 <= self.descriptor_ttl <= 3600, "descriptor-ttl (DS3_DESCRIPTOR_TTL)",
             "must be between 0 and 3600 seconds")
        # The reader reads private streams and renews TTLs on the ingester on its own behalf.
        _need(not self.auth.enabled or self.auth.internal_token is not None, "internal-token (DS3_INTERNAL_TOKEN)",
             "a reader with auth on needs the internal token its ingester was given")
