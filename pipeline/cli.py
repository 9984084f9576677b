"""`ds3 pipeline ...`: the Spark jobs on the command line (registered into ds3/cli.py).

    ds3 pipeline export  --store s3://b/ds3 --prefix orders/ --output /data/orders-parquet
    ds3 pipeline compact --store s3://b/ds3 --stream cart --url http://reader:4437
    ... --master spark://spark-master:7077     (default: local[*], every core of this machine)

Like every ds3 option, each one can be set as DS3_<NAME>. pyspark is imported only when a
job runs, so `ds3 ingester` and `ds3 reader` start without it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ds3.options import FC, apply_options, option, store_options


def _source_options(f: FC, *, one_stream: bool = False) -> FC:
    """What to read: streams, or (`one_stream`: compact) one stream."""
    selection = [
        option("--stream", env="DS3_STREAM", default=None, help="A plain stream path (/v1/stream/{path})."),
        option("--bucket", env="DS3_BUCKET", default=None,
               help="The bucket of --stream-id." if one_stream else "A bucket: all its streams, or --stream-id / --prefix."),
        option("--stream-id", env="DS3_STREAM_ID", default=None, help="A stream id in --bucket."),
    ]
    if not one_stream:  # (compact's --help listed --prefix, which it refuses: found by QA)
        selection.append(option("--prefix", env="DS3_PREFIX", default=None,
                                help="Every stream whose path (or id in --bucket) starts so."))
    return store_options(apply_options(f, [
        *selection,
        option("--token", env="DS3_TOKEN", default=None,
               help="Bearer token for the reader / ingester (prefer the environment variable)."),
        option("--master", env="DS3_MASTER", default="local[*]", help="Spark master: local[*], spark://host:7077, ..."),
    ]))


def _read_options(kw: dict[str, Any]) -> dict[str, str]:
    names = {"store": "store", "s3_endpoint": "endpoint_url", "stream": "stream", "bucket": "bucket",
             "stream_id": "stream_id", "prefix": "prefix", "token": "token"}
    return {opt: str(kw[k]) for k, opt in names.items() if kw.get(k) is not None}


# the last line of an executor's traceback that Spark's exception carries
_STORE_ERROR = re.compile(r"^shared\.errors\.ObjectStore(?:Error|Unavailable): (.+)$", re.MULTILINE)


def _run(master: str, app: str, job: Callable[[Any], Any]) -> Any:
    """Run `job(spark)` on an active session if there is one (stopping nothing), else on a
    new session for `master` that is stopped afterwards."""
    from pyspark.sql import SparkSession

    from pipeline.catalog import HistoryUnavailable, StreamNotFound
    from pipeline.http import HTTPError, Unreachable
    from pipeline.jobs import CompactRefused
    from pipeline.options import OptionError
    from pipeline.session import spark_session
    from shared.errors import ObjectStoreError

    active = SparkSession.getActiveSession()
    spark = active or spark_session(master, app)
    if active is not None:
        from pipeline.source import register

        register(spark)
    try:
        return job(spark)
    except OptionError as e:
        raise click.UsageError(str(e).replace("ds3 data source option", "option")) from None
    except (StreamNotFound, HistoryUnavailable, HTTPError, CompactRefused) as e:  # not there, or refused
        raise click.ClickException(str(e)) from None
    except Unreachable as e:  # a wrong --url, or the server is down: say so, not a traceback
        raise click.ClickException(f"{e}; check --url") from None
    except ObjectStoreError as e:  # no such S3 bucket, bad credentials, the endpoint unreachable
        raise click.ClickException(f"{e.message}; check --store, --s3-endpoint and the AWS settings") from None
    except Exception as e:  # the same on an executor, inside Spark's error (its Python traceback)
        found = _STORE_ERROR.findall(str(e))
        if not found:
            raise
        raise click.ClickException(f"{found[-1].strip()}; check the store settings of the executors") from None
    finally:
        if active is None:
            spark.stop()


@click.group("pipeline")
def pipeline_group() -> None:
    """Spark jobs over the sealed history in the object store (see docs/pipeline.md)."""


@pipeline_group.command()
@_source_options
@option("--output", env="DS3_OUTPUT", required=True, type=click.Path(path_type=Path),
        help="Parquet directory (partitioned by stream and date).")
@option("--state", env="DS3_STATE", default=None, type=click.Path(path_type=Path),
        help="Offsets exported so far. Default: OUTPUT/_ds3_export_state.json.")
def export(**kw: Any) -> None:
    """Append every sealed message after the last export to Parquet, incrementally."""
    from pipeline.jobs import export as run_export

    result = _run(kw["master"], "ds3-export",
                  lambda spark: run_export(spark, _read_options(kw), kw["output"], kw["state"]))
    click.echo(json.dumps({"exported_up_to": result.streams, "state": str(result.state_path)}))


@pipeline_group.command()
@functools.partial(_source_options, one_stream=True)
@option("--url", env="DS3_URL", required=True, help="Base URL of a ds3 reader or ingester (tail, publishing).")
@option("--offset", env="DS3_OFFSET", default=None, help="Fold up to this offset. Default: the tail now.")
@option("--dry-run", env="DS3_DRY_RUN", is_flag=True, default=False, help="Fold and print; publish nothing.")
def compact(**kw: Any) -> None:
    """Fold a JSON stream of state events into a snapshot and publish it."""
    from pipeline.jobs import compact as run_compact

    result = _run(kw["master"], "ds3-compact", lambda spark: run_compact(
        spark, _read_options(kw), kw["url"], kw["offset"], publish=not kw["dry_run"]))
    report = {"snapshot_offset": result.offset, "entities": result.entities, "events": result.events,
              "controls": result.controls, "invalid": result.invalid, "bytes": len(result.snapshot),
              "from_snapshot": result.base, "published": not kw["dry_run"]}
    if result.first_invalid is not None:
        report["first_invalid"] = result.first_invalid
    click.echo(json.dumps(report))
