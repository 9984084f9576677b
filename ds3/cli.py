"""The `ds3` command line: one binary, one subcommand per process kind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ds3 import process
from ds3.options import FC, apply_options, option
from shared.config import (
    PRIVATE_NETWORKS,
    AuthConfig,
    ConfigError,
    GiB,
    IngesterConfig,
    LimitsConfig,
    MiB,
    ReaderConfig,
)

if TYPE_CHECKING:  # aiohttp is imported by the commands that serve (~0.3 s): not for --help, cluster, pipeline
    from aiohttp import web

log = logging.getLogger("ds3")


def _setup_logging(kw: dict[str, Any], service: str) -> None:
    from shared import logs

    access = kw["access_log"]
    if access is None:  # the ingester's callers are readers, which log the same request ids
        access = service != "ingester"
    logs.setup(kw["log_level"], kw["log_format"], access_log=access, service=service,
               ingester_id=kw.get("ingester_id"))
    from ds3.settings import known_settings, unknown_settings

    root = click.get_current_context().find_root().command
    for name, warning in unknown_settings(os.environ, known_settings(root)).items():
        logging.getLogger("ds3").warning("%s", warning)
        if service == "dev":  # said once: its ingesters and reader do not repeat it
            os.environ.pop(name, None)


def _log_options(f: FC) -> FC:
    return apply_options(f, [
        option("--log-format", env="DS3_LOG_FORMAT", default="text", type=click.Choice(["text", "json"]),
               help="text: one readable line per record; json: one JSON object per line (ts, level, logger, msg, "
                    "request_id, and the access log's fields), for log pipelines."),
        option("--access-log/--no-access-log", env="DS3_ACCESS_LOG", default=None,
               help="Log every request at info level (logger ds3.access; a line costs about 3 µs, written in batches). "
                    "Default: on for readers, off for the ingester (its callers are readers, which log "
                    "the same request ids; it would cost every append)."),
    ])


def _server_options(f: FC) -> FC:
    return apply_options(f, [
        option("--host", env="DS3_HOST", default="127.0.0.1", help="Address to listen on."),
        option("--port", env="DS3_PORT", type=int, default=4437,
               help="TCP port (4437 is the protocol's default)."),
        option("--long-poll-timeout", env="DS3_LONG_POLL_TIMEOUT", type=float, default=30.0,
               help="Seconds a long-poll waits for data before answering 204."),
        option("--tail-max-age", env="DS3_TAIL_MAX_AGE", type=int, default=1,
               help="Seconds shared caches (a CDN, nginx) may keep an answer that says 'nothing more yet' "
                    "(an empty tail page, a long-poll 204), so a crowd at the tail costs one origin request "
                    "per that long; 0: never stored."),
        option("--max-body-bytes", env="DS3_MAX_BODY_BYTES", type=int, default=64 * MiB,
               help="Largest request body (413 above)."),
        option("--max-path-bytes", env="DS3_MAX_PATH_BYTES", type=int, default=480,
               help="Longest stream path in bytes (400 above)."),
        option("--max-snapshot-bytes", env="DS3_MAX_SNAPSHOT_BYTES", type=int, default=64 * MiB,
               help="Largest snapshot a PUT {stream}/snapshot/{offset} may publish (413 above)."),
        option("--s3-endpoint", env="DS3_S3_ENDPOINT", default=None,
               help="S3 endpoint URL (MinIO, moto). Default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS."),
        option("--log-level", env="DS3_LOG_LEVEL", default="info",
               type=click.Choice(["debug", "info", "warning", "error"])),
        _log_options,
    ])


def _ingester_options(f: FC) -> FC:
    return apply_options(f, [
        option("--data-dir", env="DS3_DATA_DIR", type=click.Path(path_type=Path), default=Path(".ds3"),
               help="Directory for the LMDB write-ahead log (created if missing)."),
        option("--store", env="DS3_STORE", default=None,
               help="Object store for sealed chunks: s3://bucket/prefix or file:///path. "
                    "Without it the WAL keeps everything and nothing is sealed."),
        option("--seal-bytes", env="DS3_SEAL_BYTES", type=int, default=8 * MiB,
               help="Seal a stream's open chunk when it reaches this size."),
        option("--seal-age", env="DS3_SEAL_AGE", type=float, default=60.0,
               help="Seal a stream's open chunk when it is this many seconds old."),
        option("--wal-max-bytes", env="DS3_WAL_MAX_BYTES", type=int, default=4 * GiB,
               help="Unsealed data the WAL may hold while the store is down; past it appends get 503."),
        option("--uploads", env="DS3_UPLOADS", type=int, default=4, help="Concurrent chunk uploads."),
        option("--ingester-id", env="DS3_INGESTER_ID", default=None,
               help="This ingester's id in the cluster description (several ingesters sharing one store; "
                    "docs/architecture.md \"Placement\"): it serves only the streams placed on it and answers "
                    "421 naming the owner for the others. Without it: no cluster, it owns every stream."),
        option("--cluster", env="DS3_CLUSTER", type=click.Path(path_type=Path), default=None,
               help="Read the cluster description from this JSON file instead of the store's _ds3/cluster.json "
                    "(ds3 dev, tests). Needs --ingester-id."),
        option("--cluster-refresh", env="DS3_CLUSTER_REFRESH", type=float, default=5.0,
               help="Seconds between reads of the cluster description."),
        option("--durability", env="DS3_DURABILITY", default="local", type=click.Choice(["local", "store"]),
               help="With --store, every commit is also logged to the store. local: an append is "
                    "acknowledged after the local fsync and the log follows within --ship-interval; "
                    "store: only once its log segment is in the object store (nothing acknowledged is "
                    "lost with the machine)."),
        option("--ship-interval", env="DS3_SHIP_INTERVAL", type=float, default=1.0,
               help="local durability: the log in the store follows the WAL within about this many seconds "
                    "(0.01-3600; --durability store ships each commit at once)."),
        option("--max-ship-lag", env="DS3_MAX_SHIP_LAG", type=float, default=None,
               help="local durability: once the log in the store is this many seconds behind (the store "
                    "failing), appends answer 503 until it catches up, so a lost disk loses at most this "
                    "much; 0: no bound (keep acknowledging). Default: 5, or 3 x --ship-interval if larger."),
        option("--log-uploads", env="DS3_LOG_UPLOADS", type=int, default=4,
               help="store durability: log segment uploads in flight at once (1-4) once a PUT takes 20 ms or "
                    "more (a nearer store gets one at a time: fewer, larger segments); appends are still "
                    "acknowledged in commit order."),
        option("--checkpoint-interval", env="DS3_CHECKPOINT_INTERVAL", type=float, default=300.0,
               help="Seconds between checkpoints of the WAL into the store (they bound recovery; 1 s to a week)."),
        option("--advertise-url", env="DS3_ADVERTISE_URL", default=None,
               help="URL of this ingester named in the store's ownership record. Default: http://HOST:PORT."),
        option("--owner-id", env="DS3_OWNER_ID", default=None,
               help="This ingester's name in the ownership record. Default: a random id kept in the data dir "
                    "(a restart on the same disk takes its prefix back at once)."),
        option("--lease-seconds", env="DS3_LEASE_SECONDS", type=float, default=10.0,
               help="Lease on the store prefix in seconds (1-3600); renewed every third of it. Another ingester "
                    "may take the prefix over once it lapses."),
        option("--standby", env="DS3_STANDBY", is_flag=True, default=False,
               help="Start as a standby for the ingester owning --store's prefix: acknowledge no writes (stream "
                    "requests answer 503 naming the owner's URL), watch its lease, and when it lapses take the "
                    "prefix over, restore the WAL from the store's log (this data dir's WAL is discarded) and "
                    "serve."),
        option("--sse-max-seconds", env="DS3_SSE_MAX_SECONDS", type=float, default=60.0,
               help="SSE connections are closed after this long so CDNs can collapse them."),
        option("--max-read-bytes", env="DS3_MAX_READ_BYTES", type=int, default=1 * MiB,
               help="Largest catch-up response from the WAL; longer reads page by Stream-Next-Offset."),
        option("--wal-map-size", env="DS3_WAL_MAP_SIZE", type=int, default=256 * GiB,
               help="LMDB map size in bytes (address space reserved, not disk used)."),
    ])


def _access_options(f: FC) -> FC:
    """Access control and per-client limits (README "Deploying with auth"), both processes."""
    secret = " Prefer the environment variable: command lines are visible to other local users."
    return apply_options(f, [
        option("--tokens-file", env="DS3_TOKENS_FILE", type=click.Path(path_type=Path), default=None,
               help='Static bearer tokens: a JSON list of {"token", "sub", "read": [grants], "write": [grants]}.'),
        option("--tokens", env="DS3_TOKENS", default=None, help="The same JSON list, inline." + secret),
        option("--jwt-secret", env="DS3_JWT_SECRET", default=None,
               help="Accept HS256 JWTs signed with this secret (at least 32 bytes)." + secret),
        option("--jwks-file", env="DS3_JWKS_FILE", type=click.Path(path_type=Path), default=None,
               help="Accept RS256/ES256 JWTs signed by a key in this JWK Set file."),
        option("--jwks-url", env="DS3_JWKS_URL", default=None,
               help="Accept RS256/ES256 JWTs signed by a key from this JWKS URL (cached)."),
        option("--jwt-issuer", env="DS3_JWT_ISSUER", default=None, help="Required `iss` of JWTs."),
        option("--jwt-audience", env="DS3_JWT_AUDIENCE", default=None, help="Required `aud` of JWTs."),
        option("--jwt-leeway", env="DS3_JWT_LEEWAY", type=float, default=30.0,
               help="Seconds of clock skew allowed on exp/nbf."),
        option("--jwks-cache-seconds", env="DS3_JWKS_CACHE_SECONDS", type=float, default=300.0,
               help="How long keys fetched from --jwks-url are used before they are fetched again."),
        option("--private", env="DS3_PRIVATE", multiple=True,
               help="Reads of these need a token with read scope: stream:<prefix>, bucket:<id>[/<prefix>] or *. "
                    "Repeat it (the variable: separated by spaces)."),
        option("--internal-token", env="DS3_INTERNAL_TOKEN", default=None,
               help="Shared by the ingester and its readers: readers send it to read private streams, call "
                    "/_ds3/ and be exempt from the ingester's per-client limits." + secret),
        option("--write-rate", env="DS3_WRITE_RATE", type=float, default=500.0,
               help="Writes (PUT/POST/DELETE) per second per client; 0: unlimited."),
        option("--write-burst", env="DS3_WRITE_BURST", type=int, default=2000, help="Writes a client may burst."),
        option("--create-rate", env="DS3_CREATE_RATE", type=float, default=50.0,
               help="Creates (PUT of a stream or bucket) per second per client; 0: unlimited."),
        option("--create-burst", env="DS3_CREATE_BURST", type=int, default=500, help="Creates a client may burst."),
        option("--max-live-per-client", env="DS3_MAX_LIVE_PER_CLIENT", type=int, default=100,
               help="Long-polls + SSE connections one client may hold at once (429 beyond); 0: no cap."),
        option("--body-timeout", env="DS3_BODY_TIMEOUT", type=float, default=60.0,
               help="Seconds a request body may take to arrive (408 and the connection closes after)."),
        option("--send-timeout", env="DS3_SEND_TIMEOUT", type=float, default=30.0,
               help="A client that takes none of the data we send for this long is disconnected."),
        option("--keepalive-timeout", env="DS3_KEEPALIVE_TIMEOUT", type=float, default=75.0,
               help="Idle connections close after this long; it also bounds sending a request head."),
        option("--trusted-proxies", env="DS3_TRUSTED_PROXIES", multiple=True, default=PRIVATE_NETWORKS,
               help="Addresses/CIDRs of proxies (readers, load balancers) whose X-Forwarded-For names the client; "
                    "their own requests are not limited. `none`: trust no one."),
    ])


def _access_configs(kw: dict[str, Any]) -> dict[str, Any]:
    auth = {k: v for k, v in kw.items() if k in set(AuthConfig.names())}
    limits = {k: v for k, v in kw.items() if k in set(LimitsConfig.names())}
    auth["private"] = tuple(auth.get("private") or ())
    proxies = tuple(limits.get("trusted_proxies") or ())
    limits["trusted_proxies"] = () if proxies == ("none",) else proxies
    try:
        return {"auth": AuthConfig(**auth), "limits": LimitsConfig(**limits)}
    except ConfigError as e:
        raise click.UsageError(str(e)) from e


def _ingester_config(kw: dict[str, Any]) -> IngesterConfig:
    names = set(IngesterConfig.names()) - {"auth", "limits"}
    try:
        config = IngesterConfig(**{k: v for k, v in kw.items() if k in names}, **_access_configs(kw))
    except ConfigError as e:
        raise click.UsageError(str(e)) from e
    mode = config.durability if config.store is not None else None
    for name, env, applies in (("ship_interval", "DS3_SHIP_INTERVAL", "local"),
                               ("log_uploads", "DS3_LOG_UPLOADS", "store")):
        given = click.get_current_context().get_parameter_source(name)
        if given not in (None, click.core.ParameterSource.DEFAULT) and mode != applies:
            # (a setting given that cannot apply is likely a misunderstanding: say so, once)
            log.warning("--%s (%s) is ignored: it applies only to --durability %s with a --store (here: %s)",
                        name.replace("_", "-"), env, applies, f"--durability {mode}" if mode else "no --store")
    return config


def _reader_config(kw: dict[str, Any]) -> ReaderConfig:
    names = set(ReaderConfig.__dataclass_fields__) - {"auth", "limits"}
    try:
        return ReaderConfig(**{k: v for k, v in kw.items() if k in names}, **_access_configs(kw))
    except ConfigError as e:
        raise click.UsageError(str(e)) from e


def _build(create: Callable[[Any], web.Application], config: Any) -> web.Application:
    try:  # credential files and keys are loaded here
        return create(config)
    except ConfigError as e:
        raise click.UsageError(str(e)) from e


def _run(app: web.Application, host: str, port: int, banner: str, config: IngesterConfig | ReaderConfig,
         runner_class: type[web.AppRunner] | None = None, *, unix_path: str | None = None,
         reuse_port: bool = False) -> None:
    """Serve `app` until SIGINT/SIGTERM (web.run_app's behaviour, with a runner of our choice:
    the ingester's adds the fast lane for appends). A reader worker (`reuse_port`) serves the
    listening sockets its parent made for every worker (reader/workers.py; SO_REUSEPORT if it
    has none) and also listens on a private unix socket (`unix_path`)."""
    from aiohttp import web
    from aiohttp.web_runner import GracefulExit

    from shared.http.auth import describe

    process.install_uvloop()
    process.raise_fd_limit()
    runner_class = runner_class or web.AppRunner
    refused = False

    async def serve() -> None:
        nonlocal refused
        # handler_cancellation: a client that goes away cancels its handler (an SSE or long-poll
        # client that disconnects must not keep upstream connections and wake-ups alive).
        # keepalive_timeout also bounds a request head sent slowly: aiohttp's timer runs until a
        # whole head has arrived (bodies have --body-timeout).
        runner = runner_class(app, handle_signals=True, access_log=None, shutdown_timeout=5,
                              handler_cancellation=True, keepalive_timeout=config.limits.keepalive_timeout)
        await runner.setup()
        try:
            from reader.workers import LISTEN_BACKLOG, WORKER_ENV, inherited_sockets

            # (aiohttp's sites listen again with a backlog of 128 unless told: a burst of
            # connections beyond it waits for SYN retries, a second or more)
            shared = inherited_sockets() if reuse_port else None
            if shared is not None:  # a reader worker: its parent's listening sockets
                for sock in shared:
                    await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()
            else:
                try:
                    await web.TCPSite(runner, host, port, reuse_port=reuse_port or None,
                                      backlog=LISTEN_BACKLOG).start()
                except OSError as e:  # a port in use is a setting's problem: one line, as dev and the reader say it
                    log.error("%s: cannot listen on %s port %d: %s", banner.split(" (")[0], host, port, _why(e))
                    refused = True
                    return  # (the runner's cleanup below still stops the service: it releases its lease)
            if unix_path is not None:
                await web.UnixSite(runner, unix_path).start()
            log.info("%s listening on http://%s", banner, _host_port(host, port))
            # (the auth line once per reader: its first worker's; the others' say the same)
            first = shared is None or os.environ.get(WORKER_ENV, "0") == "0"
            log.log(logging.INFO if first else logging.DEBUG, "%s", describe(config.auth))
            log.debug("gc settled: %d objects frozen", process.settle_gc())
            await _wait_while_parent_lives()
        finally:
            await runner.cleanup()

    with contextlib.suppress(GracefulExit, KeyboardInterrupt):
        asyncio.run(serve())
    if refused:
        sys.exit(1)


def _why(e: OSError) -> str:
    """The reason of a failed listen, without uvloop's "error while attempting to bind" wording."""
    import socket

    if isinstance(e, socket.gaierror):  # (it read "Unknown error -2": found by QA)
        return f"the host name does not resolve ({e.strerror}; --host, DS3_HOST)"
    return os.strerror(e.errno) if e.errno else str(e)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _wait_while_parent_lives() -> None:
    """Forever, for a process of its own; a reader worker leaves when its parent is gone (a
    SIGKILLed parent cannot pass on SIGTERM, and orphans would keep the port)."""
    from reader.workers import identity

    me = identity()
    if me is None:
        await asyncio.Event().wait()
        return
    import signal

    while os.getppid() == me.parent:
        await asyncio.sleep(1.0)
    log.warning("reader worker %d: the parent process is gone; stopping", me.index)
    import shutil

    shutil.rmtree(me.run_dir, ignore_errors=True)  # its TemporaryDirectory will not be cleaned up
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.Event().wait()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ds3")
@click.pass_context
def main(ctx: click.Context) -> None:
    """ds3: a Durable Streams server whose history lives in S3-compatible object storage."""
    from ds3.process import die_with_parent

    die_with_parent()
    if ctx.invoked_subcommand in ("pipeline", "cluster"):  # (the servers say it in their logs)
        from ds3.settings import known_settings, unknown_settings

        for warning in unknown_settings(os.environ, known_settings(ctx.command)).values():
            click.echo(f"warning: {warning}", err=True)


@main.command()
@_server_options
@_ingester_options
@_access_options
def ingester(**kw: Any) -> None:
    """Run the ingester: writes and the live tail over an LMDB write-ahead log; seals chunks
    into the object store when --store is given."""
    _setup_logging(kw, "ingester")
    config = _ingester_config(kw)
    from ingester.app import create_app
    from ingester.fastlane import FastLaneRunner
    from ingester.logstore import StartRefused
    from shared.config import make_data_dir
    from shared.localfile import Locked, hold_lock

    try:
        make_data_dir(config.data_dir)
    except ConfigError as e:
        raise click.UsageError(str(e)) from e
    try:
        # One process per data dir: a second one with the same --data-dir (and so the same
        # owner id) would take the ownership over from the running one and open its WAL too.
        hold_lock(config.data_dir / "lock")
    except Locked as e:
        log.error("not starting: another ds3 ingester (process %s) is running with --data-dir %s; each ingester "
                  "needs a data dir of its own", e.holder, config.data_dir.resolve())
        sys.exit(1)  # (said once, by the log line: click's "Error:" repeated it below)
    try:
        _run(_build(create_app, config), config.host, config.port,
             f"ds3 ingester (data in {config.data_dir.resolve()})", config, FastLaneRunner)
    except StartRefused as e:
        log.error("%s", e)
        sys.exit(1)


@main.command()
@_server_options
@option("--ingester", env="DS3_INGESTER", default=None,
        help="Base URL of the ingester: where every request goes while there is no cluster description "
             "(none in the store's _ds3/cluster.json and no --cluster). Omit it to follow the store prefix's "
             "owner, the URL its ownership record advertises: a standby's takeover then needs no reader restart.")
@option("--cluster", env="DS3_CLUSTER", type=click.Path(path_type=Path), default=None,
        help="Route by the cluster description in this JSON file instead of the store's _ds3/cluster.json "
             "(ds3 dev, tests): every request goes to its stream's owner (docs/architecture.md \"Routing\").")
@option("--cluster-refresh", env="DS3_CLUSTER_REFRESH", type=float, default=5.0,
        help="Seconds between reads of the cluster description.")
@option("--store", env="DS3_STORE", required=True, help="Object store: s3://bucket/prefix or file:///path.")
@option("--max-read-bytes", env="DS3_MAX_READ_BYTES", type=int, default=16 * MiB,
        help="Most bytes of a sealed chunk one response carries.")
@option("--descriptor-ttl", env="DS3_DESCRIPTOR_TTL", type=float, default=1.0,
        help="Seconds the reader trusts what it read from the store about a stream: its descriptor, "
             "and that a chunk was not sealed yet (reads there go to the ingester meanwhile).")
@option("--sse-max-seconds", env="DS3_SSE_MAX_SECONDS", type=float, default=60.0,
        help="SSE connections are closed after this long so CDNs can collapse them.")
@option("--workers", env="DS3_WORKERS", type=int, default=None,
        help="Reader processes sharing the port (SO_REUSEPORT), supervised by this one. Default: the "
             "number of CPUs.")
@_access_options
def reader(**kw: Any) -> None:
    """Run a stateless reader: sealed history straight from the object store, the rest
    (tail, long-poll, SSE, writes) through the ingester."""
    from reader.workers import identity, supervise

    me = identity()
    _setup_logging(kw, "reader" if me is None else f"reader-{me.index}")
    if kw["workers"] is None:
        kw["workers"] = os.cpu_count() or 1
    config = _reader_config(kw)
    if me is None and config.workers > 1:
        process.raise_fd_limit()
        sys.exit(supervise(sys.argv[sys.argv.index("reader") + 1:], config.workers, config.host, config.port))
    from reader.app import create_app
    from reader.forwardlane import ForwardLaneRunner

    app = _build(create_app, config)
    if me is None:
        _run(app, config.host, config.port, "ds3 reader", config, ForwardLaneRunner)
    else:
        _run(app, config.host, config.port, f"ds3 reader worker {me.index}", config, ForwardLaneRunner,
             reuse_port=True, unix_path=str(me.socket_path(me.index)))


@main.command()
@option("--host", env="DS3_HOST", default="127.0.0.1", help="Address the reader listens on.")
@option("--port", env="DS3_PORT", type=int, default=4437, help="Public port (the reader's).")
@option("--data-dir", env="DS3_DATA_DIR", type=click.Path(path_type=Path), default=Path(".ds3"),
        help="WAL in DIR/wal, sealed chunks in DIR/objects.")
@option("--long-poll-timeout", env="DS3_LONG_POLL_TIMEOUT", type=float, default=30.0,
        help="Seconds a long-poll waits for data.")
@option("--seal-bytes", env="DS3_SEAL_BYTES", type=int, default=8 * MiB, help="Chunk size that triggers a seal.")
@option("--seal-age", env="DS3_SEAL_AGE", type=float, default=60.0, help="Chunk age that triggers a seal.")
@option("--log-level", env="DS3_LOG_LEVEL", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@option("--workers", env="DS3_WORKERS", type=int, default=None,
        help="Reader processes sharing the public port. Default: the number of CPUs.")
@option("--ingesters", env="DS3_INGESTERS", type=int, default=1,
        help="Ingesters sharing the store (ids i1..iN, WALs in DIR/iK, the cluster description in "
             "DIR/cluster.json); the reader routes each stream to its owner. 1: one ingester, no cluster.")
@option("--ingester-port", env="DS3_INGESTER_PORT", type=int, default=0,
        help="The ingester's port on 127.0.0.1 (with --ingesters N: N consecutive ports from this one). "
             "Default: a free port.")
@_log_options
def dev(**kw: Any) -> None:
    """Run an ingester and a reader on this machine with a local-directory object store
    (no S3 needed). The reader is public; the ingester listens on a private port.

    Every other DS3_* variable (limits, auth, timeouts: see `ds3 ingester --help` and `ds3 reader
    --help`) reaches both processes; DS3_STORE, DS3_S3_ENDPOINT and DS3_INGESTER cannot apply
    and are refused."""
    _setup_logging(kw, "dev")
    from ds3.supervise import DevSettingError, child_environment, run_dev
    from shared.config import check_shared, make_data_dir

    def refuse(message: str) -> NoReturn:
        raise click.UsageError(_naming_the_variable(message, dict(os.environ)))

    try:
        check_shared(port=kw["port"], long_poll_timeout=kw["long_poll_timeout"], seal_bytes=kw["seal_bytes"],
                     seal_age=kw["seal_age"])
    except ConfigError as e:
        refuse(str(e))
    if not 1 <= kw["ingesters"] <= 64:
        refuse(f"ingesters (DS3_INGESTERS): {kw['ingesters']} is not between 1 and 64")
    first, last = kw["ingester_port"], kw["ingester_port"] + kw["ingesters"] - 1
    if first and (first < 1 or last > 65535):
        refuse(f"ingester_port (DS3_INGESTER_PORT): {first} is not a port from 1 to {65536 - kw['ingesters']}")
    if first and first <= kw["port"] <= last:
        refuse(f"ingester_port (DS3_INGESTER_PORT): {first} is the public port's (--port {kw['port']})")
    if kw["workers"] is not None and not 1 <= kw["workers"] <= 256:
        refuse(f"workers (DS3_WORKERS): {kw['workers']} is not between 1 and 256")
    try:
        env = child_environment(dict(os.environ))
    except DevSettingError as e:
        raise click.UsageError(str(e)) from e
    _check_dev_children(env, kw)
    try:  # (last: nothing is created for a run refused for another setting)
        make_data_dir(kw["data_dir"])
    except ConfigError as e:
        raise click.UsageError(str(e)) from e
    sys.exit(run_dev(**kw))


def _check_dev_children(env: dict[str, str], kw: dict[str, Any]) -> None:
    """The DS3_* settings `ds3 dev` hands on, checked as its ingester and reader will check them
    (click's parsing, then their configs) before anything starts: a bad one is refused once,
    naming its variable, not by every child with the internal command line in its usage text."""
    objects = (kw["data_dir"] / "objects").resolve().as_uri()
    own = ["--host", "127.0.0.1", "--port", str(kw["port"]), "--long-poll-timeout", str(kw["long_poll_timeout"])]
    children: list[tuple[str, list[str], Callable[[dict[str, Any]], Any]]] = [
        ("ingester", [*own, "--data-dir", str(kw["data_dir"]), "--store", objects, "--seal-bytes",
                      str(kw["seal_bytes"]), "--seal-age", str(kw["seal_age"])], _ingester_config),
        ("reader", [*own, "--store", objects, "--workers", "1"], _reader_config),
    ]
    from shared.auth.authenticate import Authenticator

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # click reads the options' variables from os.environ
    try:
        for name, argv, config in children:
            command = main.commands[name]
            made = config(command.make_context(f"ds3 {name}", argv).params)
            Authenticator(made.auth)  # the credentials (DS3_TOKENS' JSON, key files), loaded as its app will
    except ConfigError as e:
        raise click.UsageError(_naming_the_variable(str(e), env)) from None
    except click.UsageError as e:
        raise click.UsageError(_naming_the_variable(e.format_message(), env)) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _naming_the_variable(message: str, env: dict[str, str]) -> str:
    """`message` led by the variable it is about and its value (`DS3_WRITE_RATE=-5: ...`)."""
    import re

    named = re.search(r"DS3_[A-Z0-9_]+", message)
    if named is None or named.group() not in env:
        return message
    name = named.group()
    secret = re.search(r"TOKEN|SECRET|PASSWORD", name) and not name.endswith(("_FILE", "_URL"))
    return f"{name}={'(secret: not shown)' if secret else env[name]}: {message}"


from ds3.cluster_cli import cluster  # noqa: E402 - `ds3 cluster ...`
from pipeline.cli import pipeline_group  # noqa: E402 - the Spark jobs (docs/pipeline.md)

main.add_command(cluster)
main.add_command(pipeline_group)

if __name__ == "__main__":  # pragma: no cover
    main()
