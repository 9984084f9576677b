"""The `ds3` command line: one binary, one subcommand per process kind."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import click
from aiohttp import web

from shared.config import ConfigError, GiB, IngesterConfig, MiB


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _ingester_options(f: Any) -> Any:
    opts = [
        click.option("--host", envvar="DS3_HOST", default="127.0.0.1", show_default=True,
                     show_envvar=True, help="Address to listen on."),
        click.option("--port", envvar="DS3_PORT", type=int, default=4437, show_default=True,
                     show_envvar=True, help="TCP port (4437 is the protocol's default)."),
        click.option("--data-dir", envvar="DS3_DATA_DIR", type=click.Path(path_type=Path),
                     default=Path(".ds3"), show_default=True, show_envvar=True,
                     help="Directory for the LMDB write-ahead log (created if missing)."),
        click.option("--long-poll-timeout", envvar="DS3_LONG_POLL_TIMEOUT", type=float, default=30.0,
                     show_default=True, show_envvar=True,
                     help="Seconds a long-poll waits for data before answering 204."),
        click.option("--sse-max-seconds", envvar="DS3_SSE_MAX_SECONDS", type=float, default=60.0,
                     show_default=True, show_envvar=True,
                     help="SSE connections are closed after this long so CDNs can collapse them."),
        click.option("--max-body-bytes", envvar="DS3_MAX_BODY_BYTES", type=int, default=64 * MiB,
                     show_default=True, show_envvar=True, help="Largest request body (413 above)."),
        click.option("--max-read-bytes", envvar="DS3_MAX_READ_BYTES", type=int, default=1 * MiB,
                     show_default=True, show_envvar=True,
                     help="Largest catch-up response; longer reads are paged by Stream-Next-Offset."),
        click.option("--max-path-bytes", envvar="DS3_MAX_PATH_BYTES", type=int, default=480,
                     show_default=True, show_envvar=True, help="Longest stream path in bytes (400 above)."),
        click.option("--wal-map-size", envvar="DS3_WAL_MAP_SIZE", type=int, default=256 * GiB,
                     show_default=True, show_envvar=True,
                     help="LMDB map size in bytes (address space reserved, not disk used)."),
        click.option("--log-level", envvar="DS3_LOG_LEVEL", default="info", show_default=True,
                     show_envvar=True, type=click.Choice(["debug", "info", "warning", "error"])),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _config(**kw: Any) -> IngesterConfig:
    kw.pop("log_level", None)
    try:
        return IngesterConfig(**kw)
    except ConfigError as e:
        raise click.UsageError(str(e)) from e


def _serve_ingester(config: IngesterConfig, banner: str) -> None:
    from ingester.app import create_app

    _install_uvloop()
    log = logging.getLogger("ds3")

    async def on_startup(app: web.Application) -> None:
        log.info("%s listening on http://%s:%d (data in %s)", banner, config.host, config.port,
                 config.data_dir.resolve())

    app = create_app(config)
    app.on_startup.append(on_startup)
    web.run_app(app, host=config.host, port=config.port, print=None, access_log=None,
                handle_signals=True, shutdown_timeout=5)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ds3")
def main() -> None:
    """ds3: a Durable Streams server whose history lives in S3-compatible object storage."""


@main.command()
@_ingester_options
def ingester(**kw: Any) -> None:
    """Run the ingester: the write path and live tail over an LMDB write-ahead log."""
    _setup_logging(kw["log_level"])
    _serve_ingester(_config(**kw), "ds3 ingester")


@main.command()
@_ingester_options
def dev(**kw: Any) -> None:
    """Run everything on one machine with local storage (today: the ingester alone)."""
    _setup_logging(kw["log_level"])
    _serve_ingester(_config(**kw), "ds3 dev")


if __name__ == "__main__":  # pragma: no cover
    main()
