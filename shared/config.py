"""Configuration: frozen dataclasses built from the CLI / environment, validated at start
with errors that name the setting."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

MiB = 1024 * 1024
GiB = 1024 * MiB
LMDB_MAX_KEY = 480  # LMDB keys are at most 511 bytes; stream paths are keys


class ConfigError(ValueError):
    """A setting is invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class IngesterConfig:
    host: str = "127.0.0.1"
    port: int = 4437
    data_dir: Path = Path(".ds3")
    long_poll_timeout: float = 30.0
    sse_max_seconds: float = 60.0
    max_body_bytes: int = 64 * MiB
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

    def __post_init__(self) -> None:
        def need(ok: bool, setting: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"{setting}: {why}")

        need(bool(self.host), "host (DS3_HOST)", "must not be empty")
        need(0 <= self.port <= 65535, "port (DS3_PORT)", f"{self.port} is not a TCP port")
        need(0.1 <= self.long_poll_timeout <= 3600, "long-poll-timeout (DS3_LONG_POLL_TIMEOUT)",
             "must be between 0.1 and 3600 seconds")
        need(1 <= self.sse_max_seconds <= 3600, "sse-max-seconds (DS3_SSE_MAX_SECONDS)",
             "must be between 1 and 3600 seconds")
        need(1 <= self.max_body_bytes <= 1024 * MiB, "max-body-bytes (DS3_MAX_BODY_BYTES)",
             "must be between 1 byte and 1 GiB")
        need(1024 <= self.max_read_bytes <= 256 * MiB, "max-read-bytes (DS3_MAX_READ_BYTES)",
             "must be between 1 KiB and 256 MiB")
        need(1 <= self.max_path_bytes <= LMDB_MAX_KEY, "max-path-bytes (DS3_MAX_PATH_BYTES)",
             f"must be between 1 and {LMDB_MAX_KEY}")
        need(self.wal_map_size >= 16 * MiB, "wal-map-size (DS3_WAL_MAP_SIZE)", "must be at least 16 MiB")
        need(0.05 <= self.sweep_interval <= 3600, "sweep-interval (DS3_SWEEP_INTERVAL)",
             "must be between 0.05 and 3600 seconds")
        need(1 <= self.read_threads <= 64, "read-threads (DS3_READ_THREADS)", "must be between 1 and 64")
        need(self.store is None or self.store.startswith(("s3://", "file://")), "store (DS3_STORE)",
             "must be an s3://bucket/prefix or file:///path URL")
        need(1024 <= self.seal_bytes <= 1024 * MiB, "seal-bytes (DS3_SEAL_BYTES)", "must be between 1 KiB and 1 GiB")
        need(0.05 <= self.seal_age <= 86400, "seal-age (DS3_SEAL_AGE)", "must be between 0.05 s and a day")
        need(self.wal_max_bytes >= 2 * self.seal_bytes, "wal-max-bytes (DS3_WAL_MAX_BYTES)",
             "must be at least twice seal-bytes")
        need(1 <= self.uploads <= 64, "uploads (DS3_UPLOADS)", "must be between 1 and 64")

    @property
    def wal_dir(self) -> Path:
        return self.data_dir / "wal"

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True, slots=True)
class ReaderConfig:
    ingester: str  # base URL of the ingester, e.g. http://127.0.0.1:4438
    store: str  # s3://bucket/prefix or file:///path
    host: str = "127.0.0.1"
    port: int = 4437
    s3_endpoint: str | None = None
    long_poll_timeout: float = 30.0  # how long the ingester holds a long-poll (upstream timeouts)
    max_read_bytes: int = 8 * MiB  # a sealed response covers at most this much of a chunk
    max_body_bytes: int = 64 * MiB
    max_path_bytes: int = LMDB_MAX_KEY
    descriptor_ttl: float = 1.0  # seconds a stream descriptor is trusted before re-reading it
    sse_max_seconds: float = 60.0  # SSE client connections are closed after this long

    def __post_init__(self) -> None:
        def need(ok: bool, setting: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"{setting}: {why}")

        need(self.ingester.startswith(("http://", "https://")), "ingester (DS3_INGESTER)",
             "must be an http(s):// URL")
        need(self.store.startswith(("s3://", "file://")), "store (DS3_STORE)",
             "must be an s3://bucket/prefix or file:///path URL")
        need(0 <= self.port <= 65535, "port (DS3_PORT)", f"{self.port} is not a TCP port")
        need(0.1 <= self.long_poll_timeout <= 3600, "long-poll-timeout (DS3_LONG_POLL_TIMEOUT)",
             "must be between 0.1 and 3600 seconds")
        need(1024 <= self.max_read_bytes <= 1024 * MiB, "max-read-bytes (DS3_MAX_READ_BYTES)",
             "must be between 1 KiB and 1 GiB")
        need(1 <= self.max_body_bytes <= 1024 * MiB, "max-body-bytes (DS3_MAX_BODY_BYTES)",
             "must be between 1 byte and 1 GiB")
        need(0 <= self.descriptor_ttl <= 3600, "descriptor-ttl (DS3_DESCRIPTOR_TTL)",
             "must be between 0 and 3600 seconds")
