"""Click options as every `ds3` command declares them: each also read from a DS3_* environment
variable, shown in --help with its default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

FC = TypeVar("FC", bound=Callable[..., Any])


def option(*names: str, env: str, **kw: Any) -> Callable[[FC], FC]:
    return click.option(*names, envvar=env, show_envvar=True, show_default="default" in kw, **kw)


def apply_options(f: FC, opts: list[Callable[[FC], FC]]) -> FC:
    for opt in reversed(opts):
        f = opt(f)
    return f


def store_options(f: FC) -> FC:
    """--store and --s3-endpoint, for the commands that open the store themselves."""
    return apply_options(f, [
        option("--store", env="DS3_STORE", required=True, help="Object store: s3://bucket/prefix or file:///path."),
        option("--s3-endpoint", env="DS3_S3_ENDPOINT", default=None,
               help="S3 endpoint URL (MinIO, moto). Default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS."),
    ])
