"""Store URLs (shared/objectstore/url.py): the one parser behind `open_store` (servers) and
`open_sync_store` (Spark). Table-driven: what each URL means, and that both openers agree
on it, for valid and invalid URLs alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.store import LocalSyncStore, S3SyncStore, open_sync_store
from pipeline.store import StoreURLError as PipelineStoreURLError
from shared.config import ConfigError, IngesterConfig, ReaderConfig
from shared.objectstore import (
    FileStoreURL,
    LocalStore,
    S3StoreURL,
    StoreURLError,
    open_store,
    parse_store_url,
)
from shared.objectstore.s3 import S3Store

# ---------------------------------------------------------------- valid
S3_URLS: list[tuple[str, str, str]] = [  # url, bucket, prefix
    ("s3://my-bucket", "my-bucket", ""),
    ("s3://my-bucket/", "my-bucket", ""),
    ("s3://my-bucket///", "my-bucket", ""),
    ("s3://abc/p", "abc", "p/"),
    ("s3://abc/p/", "abc", "p/"),
    ("s3://my.bucket-1/some/prefix", "my.bucket-1", "some/prefix/"),
    ("s3://my.bucket-1/some/prefix/", "my.bucket-1", "some/prefix/"),
    ("s3://abc//leading", "abc", "leading/"),  # leading and trailing slashes are trimmed
    ("s3://abc/a%20b/c%2Fd", "abc", "a b/c/d/"),  # percent-escapes are decoded
    ("S3://abc/p", "abc", "p/"),  # the scheme is case-insensitive (RFC 3986)
    ("s3://abc/p?", "abc", "p/"),  # an empty query is no query
    ("s3://" + "a" * 63, "a" * 63, ""),
]

FILE_URLS: list[tuple[str, str]] = [  # url, root
    ("file:///srv/ds3", "/srv/ds3"),
    ("file:///srv/ds3/", "/srv/ds3"),
    ("file://localhost/srv/ds3", "/srv/ds3"),
    ("file:/srv/ds3", "/srv/ds3"),
    ("file:///srv/ds3%20objects", "/srv/ds3 objects"),
    ("FILE:///srv/ds3", "/srv/ds3"),
]


@pytest.mark.parametrize(("url", "bucket", "prefix"), S3_URLS)
def test_s3_urls(url: str, bucket: str, prefix: str) -> None:
    parsed = parse_store_url(url)
    assert parsed == S3StoreURL(url, bucket, prefix) and parsed.scheme == "s3"


@pytest.mark.parametrize(("url", "root"), FILE_URLS)
def test_file_urls(url: str, root: str) -> None:
    parsed = parse_store_url(url)
    assert parsed == FileStoreURL(url, Path(root)) and parsed.scheme == "file"


@pytest.mark.parametrize(("url", "bucket", "prefix"), S3_URLS)
def test_both_openers_agree_on_s3_urls(url: str, bucket: str, prefix: str) -> None:
    server = open_store(url)
    spark = open_sync_store(url)
    assert isinstance(server, S3Store) and isinstance(spark, S3SyncStore)
    assert (server.url, server.bucket, server.prefix) == (spark.url, spark.bucket, spark.prefix) \
        == (url, bucket, prefix)


@pytest.mark.parametrize(("url", "root"), FILE_URLS)
def test_both_openers_agree_on_file_urls(url: str, root: str, tmp_path: Path) -> None:
    # Move the root under tmp_path: LocalStore makes its directory.
    url = url.replace("/srv/", f"{tmp_path}/")
    server = open_store(url)
    spark = open_sync_store(url)
    assert isinstance(server, LocalStore) and isinstance(spark, LocalSyncStore)
    assert (server.url, server.root) == (spark.url, spark.root) == (url, Path(root.replace("/srv/", f"{tmp_path}/")))


# ---------------------------------------------------------------- invalid
BAD_URLS: list[tuple[str, str]] = [  # url, the part of the message that names the problem
    ("", "scheme must be s3:// or file:// (it has none)"),
    ("/just/a/path", "scheme must be s3:// or file:// (it has none)"),
    ("bucket/prefix", "scheme must be s3:// or file:// (it has none)"),
    ("http://bucket/x", "scheme must be s3:// or file:// (got 'http://')"),
    ("gs://bucket/x", "scheme must be s3:// or file:// (got 'gs://')"),
    ("s3://", "bucket name is missing"),
    ("s3:///prefix", "bucket name is missing"),
    ("s3:bucket", "bucket name is missing"),
    ("s3://Upper", "'Upper' is not a valid bucket name"),
    ("s3://ab", "'ab' is not a valid bucket name"),
    ("s3://" + "a" * 64, "is not a valid bucket name"),
    ("s3://b_ad/x", "'b_ad' is not a valid bucket name"),
    ("s3://-bad", "'-bad' is not a valid bucket name"),
    ("s3://bad-", "'bad-' is not a valid bucket name"),
    ("s3://bucket:9000/x", "'bucket:9000' is not a valid bucket name"),
    ("s3://user@bucket/x", "'user@bucket' is not a valid bucket name"),
    ("s3://bucket/a/../b", "key prefix 'a/../b' is invalid"),
    ("s3://bucket/a/./b", "key prefix 'a/./b' is invalid"),
    ("s3://bucket/a//b", "key prefix 'a//b' is invalid"),
    ("s3://bucket/%2e%2e/b", "key prefix '../b' is invalid"),
    ("s3://bucket/a\\b", "key prefix 'a\\\\b' is invalid"),
    ("s3://bucket/.ds3tmp-x", "key prefix '.ds3tmp-x' is invalid"),
    ("s3://bucket/p?x=1", "a query ('?x=1') is not allowed"),
    ("s3://bucket/p#frag", "a fragment ('#frag') is not allowed"),
    ("file:///srv/ds3?mode=ro", "a query ('?mode=ro') is not allowed"),
    ("file:///srv/ds3#x", "a fragment ('#x') is not allowed"),
    ("file://host/path", "not a host ('host')"),
    ("file:relative", "must be an absolute path (file:///abs/path), not 'relative'"),
    ("file:relative/dir", "must be an absolute path (file:///abs/path), not 'relative/dir'"),
    ("file:///", "must not be / itself"),
    ("file:////", "must not be / itself"),
]


@pytest.mark.parametrize(("url", "problem"), BAD_URLS)
def test_bad_urls_name_the_problem(url: str, problem: str) -> None:
    with pytest.raises(StoreURLError) as caught:
        parse_store_url(url)
    assert str(caught.value).startswith(f"object store URL {url!r}: ")
    assert problem in str(caught.value)
    assert caught.value.url == url


@pytest.mark.parametrize(("url", "problem"), BAD_URLS)
def test_both_openers_refuse_bad_urls_alike(url: str, problem: str) -> None:
    with pytest.raises(StoreURLError) as server:
        open_store(url)
    with pytest.raises(StoreURLError) as spark:
        open_sync_store(url)
    assert str(server.value) == str(spark.value)
    assert problem in str(server.value)


def test_one_error_class() -> None:
    # pipeline.options catches pipeline.store.StoreURLError; ds3 cli catches ConfigError.
    assert PipelineStoreURLError is StoreURLError
    assert issubclass(StoreURLError, ConfigError) and issubclass(StoreURLError, ValueError)


@pytest.mark.parametrize(("url", "problem"), BAD_URLS)
def test_the_configs_refuse_bad_urls_at_start_naming_the_setting(url: str, problem: str, tmp_path: Path) -> None:
    """`ds3 ingester/reader --store BAD` stops before serving, with the setting and the
    problem in the message (the CLI prints ConfigErrors as usage errors)."""
    for make in (lambda: IngesterConfig(data_dir=tmp_path, store=url),
                 lambda: ReaderConfig(ingester="http://127.0.0.1:1", store=url)):
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value).startswith("store (DS3_STORE): ")
        assert problem in str(e.value)


def test_a_local_store_that_is_a_file_is_refused_at_start(tmp_path: Path) -> None:
    """Found by QA: a traceback (FileExistsError) from the ingester, the reader and `cluster show`."""
    (tmp_path / "f").write_bytes(b"")
    for make in (lambda: IngesterConfig(data_dir=tmp_path / "d", store=(tmp_path / "f").as_uri()),
                 lambda: ReaderConfig(ingester="http://127.0.0.1:1", store=(tmp_path / "f").as_uri())):
        with pytest.raises(ConfigError, match=f"store \\(DS3_STORE\\): {tmp_path / 'f'} is a file, not a directory"):
            make()


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "localhost:9000", "http://", "https:///x", "ftp://minio:9000",
                                      "http://minio:99999", "http://minio:port"])
def test_the_configs_refuse_a_bad_s3_endpoint_naming_the_setting(endpoint: str, tmp_path: Path) -> None:
    """botocore took "127.0.0.1:9000" for an endpoint and failed at the first request with a
    traceback (found by QA)."""
    for make in (lambda: IngesterConfig(data_dir=tmp_path, store="s3://bkt/x", s3_endpoint=endpoint),
                 lambda: ReaderConfig(ingester="http://127.0.0.1:1", store="s3://bkt/x", s3_endpoint=endpoint)):
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value) == (f"s3-endpoint (DS3_S3_ENDPOINT): must be an http:// or https:// URL with a host, "
                                f"such as http://127.0.0.1:9000 (got {endpoint!r})")


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9000", "https://s3.eu-west-1.amazonaws.com", "http://minio:9000/"])
def test_good_s3_endpoints_are_taken(endpoint: str, tmp_path: Path) -> None:
    assert IngesterConfig(data_dir=tmp_path, store="s3://bkt/x", s3_endpoint=endpoint).s3_endpoint == endpoint
    assert ReaderConfig(ingester="http://127.0.0.1:1", store="s3://bkt/x", s3_endpoint=endpoint).s3_endpoint == endpoint
