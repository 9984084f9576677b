"""`ds3 cluster ...`: read and write the cluster description in the store (registered into
ds3/cli.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ds3.options import apply_options, option, store_options
from shared.config import ConfigError

if TYPE_CHECKING:
    from shared.placement import Cluster

FC = TypeVar("FC", bound=Callable[..., Any])


@click.group()
def cluster() -> None:
    """The cluster description: which ingesters share the store and own which streams
    (docs/architecture.md "Placement"). Kept in the store at _ds3/cluster.json; every ingester
    started with --ingester-id re-reads it every --cluster-refresh seconds. A file given to the
    servers with --cluster instead (`ds3 dev --ingesters N` keeps its description in
    DATA_DIR/cluster.json) is read by `show --file` and `owner --file`."""


def _cluster_run(store_url: str, s3_endpoint: str | None, action: Callable[[Any], Any], *,
                 creates: bool = False) -> Any:
    """`action(store)` on the store at `store_url`. A local store that does not exist is refused
    (a typo would read as "no description"), or, for a command that writes (`creates`), made
    with a warning (a new deployment writes its description before any ingester runs)."""
    from shared.config import _check_store_url, check_s3_endpoint
    from shared.errors import DS3Error
    from shared.objectstore import open_store
    from shared.objectstore.url import FileStoreURL, parse_store_url

    try:
        _check_store_url(store_url)
        check_s3_endpoint(s3_endpoint)
    except ConfigError as e:
        raise click.UsageError(str(e)) from e
    parsed = parse_store_url(store_url)
    if isinstance(parsed, FileStoreURL) and not parsed.root.exists():
        if not creates:
            raise click.ClickException(f"the local store {parsed.root} does not exist (check --store)")
        click.echo(f"warning: the local store {parsed.root} does not exist: creating it (check --store if your "
                   "ingesters already use one)", err=True)

    async def run() -> Any:
        async with open_store(store_url, s3_endpoint=s3_endpoint) as store:
            return await action(store)

    try:
        return asyncio.run(run())
    except DS3Error as e:
        raise click.ClickException(e.message) from e


def _read_options(f: FC) -> FC:
    """--store / --s3-endpoint, or --file: where `show` and `owner` read the description."""
    return apply_options(f, [
        option("--store", env="DS3_STORE", default=None, help="Object store: s3://bucket/prefix or file:///path."),
        option("--s3-endpoint", env="DS3_S3_ENDPOINT", default=None,
               help="S3 endpoint URL (MinIO, moto). Default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS."),
        click.option("--file", "cluster_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Read the description from this file instead of the store (what the servers take "
                          "as --cluster; `ds3 dev --ingesters N` keeps its own in DATA_DIR/cluster.json)."),
    ])


def _description(store: str | None, s3_endpoint: str | None, cluster_file: Path | None) -> tuple[Cluster, str | None]:
    """The description and its ETag (None for a file), from --file or the store."""
    from shared.cluster import load_cluster_file, read_cluster
    from shared.placement import PlacementError

    if cluster_file is not None:
        if store is not None:
            raise click.UsageError("give --store or --file, not both")
        try:
            return load_cluster_file(cluster_file), None
        except PlacementError as e:
            raise click.ClickException(str(e)) from e
    if store is None:
        raise click.UsageError("Missing option '--store' (or DS3_STORE), or give --file")
    found = _cluster_run(store, s3_endpoint, read_cluster)
    if found is None:
        from shared.objectstore.url import FileStoreURL, parse_store_url

        parsed = parse_store_url(store)
        dev_file = parsed.root.parent / "cluster.json" if isinstance(parsed, FileStoreURL) else None
        if dev_file is not None and dev_file.is_file():  # (QA: the hint pointed away from dev's file)
            raise click.ClickException(f"no cluster description in {store}: `ds3 dev --ingesters N` keeps its own in "
                                       f"{dev_file}: give --file {dev_file}")
        raise click.ClickException(f"no cluster description in {store} yet: write one with `ds3 cluster set`")
    return found.cluster, found.etag


@cluster.command("show")
@_read_options
def cluster_show(store: str | None, s3_endpoint: str | None, cluster_file: Path | None) -> None:
    """Print the description (JSON, with its ETag when it is the store's); exit 1 when there is none."""
    import json

    found, etag = _description(store, s3_endpoint, cluster_file)
    click.echo(json.dumps({**found.to_json(), **({"etag": etag} if etag is not None else {})}, indent=2))


@cluster.command("set")
@store_options
@click.option("--ingester", "ingesters", multiple=True, required=True, metavar="ID=URL",
              help="An ingester: its id (what placement hashes; keep it when the machine changes) and the URL "
                   "readers reach it at. Repeat it for each; the list replaces the current one.")
@click.option("--if-generation", type=click.IntRange(min=0), default=None,
              help="Write only if the description is at this generation now (0: none yet).")
def cluster_set(store: str, s3_endpoint: str | None, ingesters: tuple[str, ...], if_generation: int | None) -> None:
    """Replace the ingester list: writes the next generation with If-Match on the version read,
    so two admins cannot overwrite each other (the loser changes nothing and is told). The same
    list again writes nothing (and says so).

    Placement moves about 1/N of the streams when an ingester is added: each moved stream goes
    to its new owner with its data, offsets and producer state, pulled on its first request
    there (docs/architecture.md "Moves")."""
    import json

    from shared.cluster import read_cluster, set_cluster
    from shared.placement import Cluster, PlacementError, parse_ingester_spec

    try:
        pairs = [parse_ingester_spec(spec) for spec in ingesters]
        Cluster.of(pairs)  # duplicates and the like, before the store is asked
    except PlacementError as e:
        raise click.UsageError(str(e)) from e
    async def write(objects: Any) -> tuple[Cluster, Any, Any]:
        from shared.adoption import read_adoption

        before = await read_cluster(objects)
        new = await set_cluster(objects, pairs, expected_generation=if_generation)
        return new, before, await read_adoption(objects) if before is None else None

    new, before, adoption = _cluster_run(store, s3_endpoint, write, creates=True)
    click.echo(json.dumps(new.to_json(), indent=2))
    if before is not None and before.cluster.generation == new.generation:
        # (found by QA: a silent no-op, where the help says each run writes the next generation)
        click.echo(f"unchanged: generation {new.generation} lists these ingesters already; nothing was written",
                   err=True)
        return
    if adoption is not None:
        click.echo(f"ingester {adoption.ingester} (listed first) adopts the streams of the single ingester that owned "
                   f"this prefix ({adoption.owner_id}): start it on that ingester's data dir with --ingester-id "
                   f"{adoption.ingester} (its disk lost: on an empty one, restored from the store's log); the streams "
                   "placed on the others move to them", err=True)
    for line in _cluster_set_advice(new):
        click.echo(line, err=True)


def _cluster_set_advice(new: Any) -> list[str]:
    """What an admin should know after `cluster set`: members that do not answer (a typo in a
    URL, or one not started yet: its streams answer 503 until it runs), and removed ingesters
    (keep each running until it has handed its streams over and retired)."""
    import json
    import urllib.error
    import urllib.request

    out = []
    for ing in new.ingesters:
        try:
            with urllib.request.urlopen(f"{ing.url}/readyz", timeout=2) as r:
                body = r.read()
        except urllib.error.HTTPError as e:  # it answers (not ready, or not a ds3 ingester)
            body = e.read()
        except (OSError, ValueError) as e:
            out.append(f"warning: ingester {ing.id} at {ing.url} does not answer ({getattr(e, 'reason', e)}): "
                       "the streams placed on it answer 503 until it runs there")
            continue
        try:
            there = json.loads(body)["cluster"]["ingester_id"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(there, str) and there != ing.id:
            out.append(f"warning: {ing.url} answers as ingester {there}, not {ing.id}: the URLs are swapped or "
                       f"mistyped, and {ing.id}'s streams will answer 503 until they are right")
    previous = new.previous
    for ing in previous.ingesters if previous is not None else ():
        if new.get(ing.id) is None:
            out.append(f"ingester {ing.id} ({ing.url}) is removed: keep it running until it has handed its streams "
                       f"over; its /readyz then shows cluster.moves.retired_at {new.generation} and its log says "
                       "it may be stopped")
    return out


@cluster.command("owner")
@_read_options
@click.argument("urls", nargs=-1, required=True, metavar="URL_PATH...")
def cluster_owner(store: str | None, s3_endpoint: str | None, cluster_file: Path | None, urls: tuple[str, ...]) -> None:
    """Which ingester owns each stream or bucket, by URL path (/v1/stream/{path},
    /v1/buckets/{bucket}[/{stream}]; percent-encoded as in a request), under the description
    in the store (or --file): one line each, `<url path> <id> <url>`."""
    from shared import buckets
    from shared.config import LMDB_MAX_KEY
    from shared.errors import DS3Error
    from shared.http.handlers import stream_path_of

    description, _ = _description(store, s3_endpoint, cluster_file)
    for url in urls:
        try:
            raw = url.split("?", 1)[0]
            if raw.startswith(buckets.BUCKETS_PREFIX) and buckets.parse_url(raw)[1] is None:
                owner = description.bucket_owner(buckets.parse_url(raw)[0])
            else:
                owner = description.owner(stream_path_of(raw, LMDB_MAX_KEY))
        except DS3Error as e:
            raise click.UsageError(f"{url}: {e.message}") from e
        click.echo(f"{url} {owner.id} {owner.url}")
