"""The pipeline's blocking store readers (pipeline/store.py): byte ranges read the same from
a local directory and from S3, and a range that is no range is refused, not read to the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.store import LocalSyncStore, S3SyncStore, open_sync_store
from tests.s3server import MotoS3

DATA = bytes(range(100))


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, aws_env: None) -> Iterator[LocalSyncStore | S3SyncStore]:
    if request.param == "file":
        (tmp_path / "o").mkdir()
        (tmp_path / "o" / "k").write_bytes(DATA)
        yield open_sync_store((tmp_path / "o").as_uri())
        return
    s3: MotoS3 = request.getfixturevalue("s3_server")
    bucket = s3.new_bucket()
    s3.client().put_object(Bucket=bucket, Key="p/k", Body=DATA)
    yield open_sync_store(f"s3://{bucket}/p", endpoint_url=s3.endpoint)
    s3.drop_bucket(bucket)


def test_byte_ranges(store: LocalSyncStore | S3SyncStore) -> None:
    assert store.get("k") == DATA
    assert store.get("k", 10) == DATA[10:]
    assert store.get("k", 10, 20) == DATA[10:20]
    assert store.get("k", None, 5) == DATA[:5]
    assert store.get("k", 7, 7) == b""
    assert store.get("k", 90, 200) == DATA[90:]


@pytest.mark.parametrize(("start", "end"), [(20, 10), (-1, 5), (0, -1)])
def test_a_range_that_is_no_range_is_refused(store: LocalSyncStore | S3SyncStore, start: int, end: int) -> None:
    """Before: start > end read from start to the end of the file (S3: the whole object)."""
    with pytest.raises(ValueError, match="invalid byte range"):
        store.get("k", start, end)
