"""shared.localfile.write_durably: the new content whole, the old one replaced, nothing left
behind, also when the write fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.localfile import write_durably


@pytest.mark.parametrize("before", [None, b"old content, longer than the new one\n"])
def test_the_file_holds_the_new_bytes_and_no_temp_file_is_left(tmp_path: Path, before: bytes | None) -> None:
    path = tmp_path / "sub" / "owner-id"
    if before is not None:
        path.parent.mkdir()
        path.write_bytes(before)
    write_durably(path, b"new\n")
    assert path.read_bytes() == b"new\n"
    assert os.listdir(path.parent) == ["owner-id"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_durably(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["cluster.json"]
