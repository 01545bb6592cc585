"""The shared package: its durable file writes, value types and version."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import hastream
from hastream import files
from hastream.model import NodeAddress, topic_name

pytestmark = pytest.mark.storage


def test_write_atomic_replaces_the_file_and_leaves_no_staging_file(tmp_path: Path) -> None:
    path = tmp_path / "meta"
    files.write_atomic(path, b"first")
    files.write_atomic(path, b"second, longer")
    assert path.read_bytes() == b"second, longer"
    assert sorted(os.listdir(tmp_path)) == ["meta"]


def test_a_failed_write_atomic_keeps_the_old_file_and_removes_its_staging(
    tmp_path: Path,
) -> None:
    path = tmp_path / "meta"
    path.mkdir()  # The rename over it fails: a directory is not replaced by a file.
    (path / "kept").write_bytes(b"old")
    with pytest.raises(IsADirectoryError):
        files.write_atomic(path, b"new")
    assert (path / "kept").read_bytes() == b"old"
    assert not files.tmp_path(path).exists()


def test_fsync_dir_takes_a_directory_only(tmp_path: Path) -> None:
    files.fsync_dir(tmp_path)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        files.fsync_dir(tmp_path / "f")


@pytest.mark.unit
def test_value_types_and_version() -> None:
    address = NodeAddress.parse("db1.example.com:8901:node1")
    assert (address.host, address.port, str(address)) == (
        "db1.example.com",
        8901,
        "db1.example.com:8901:node1",
    )
    assert topic_name("ticks", "agg") == "ticks/agg"
    assert hastream.__version__
