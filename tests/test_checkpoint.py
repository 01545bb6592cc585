"""storage/checkpoint.py: atomic checksummed small files on real disk."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from hastream.errors import CorruptionError
from raftstore.storage import checkpoint
from raftstore.storage.format import FRAME_HEADER_SIZE, encode_frame

pytestmark = pytest.mark.storage

KIND = b"CKPT"


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    body = pa.record_batch({"x": [1, 2, 3]}).serialize().to_pybytes()
    path = tmp_path / "checkpoint.bin"
    checkpoint.write_atomic(path, KIND, body)
    assert checkpoint.read_checked(path, KIND) == body
    assert not checkpoint.tmp_path(path).exists()


def test_a_body_written_in_parts_reads_back_joined(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.bin"
    parts: list[bytes | memoryview] = [b"head", memoryview(b"xx-middle-xx")[3:-3], b"", b"tail"]
    checkpoint.write_atomic(path, KIND, parts)
    assert checkpoint.read_checked(path, KIND) == b"head" + b"middle" + b"tail"
    assert not checkpoint.tmp_path(path).exists()


def test_write_replaces_previous_content(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.bin"
    checkpoint.write_atomic(path, KIND, b"first")
    checkpoint.write_atomic(path, KIND, b"second, longer")
    assert checkpoint.read_checked(path, KIND) == b"second, longer"


def test_empty_body_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "empty.bin"
    checkpoint.write_atomic(path, KIND, b"")
    assert checkpoint.read_checked(path, KIND) == b""


@pytest.mark.parametrize("position", [0, 4, 8, 12, 20, FRAME_HEADER_SIZE, FRAME_HEADER_SIZE + 9])
def test_flipped_byte_raises_corruption_error(tmp_path: Path, position: int) -> None:
    path = tmp_path / "checkpoint.bin"
    checkpoint.write_atomic(path, KIND, b"0123456789abcdef")
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError) as caught:
        checkpoint.read_checked(path, KIND)
    assert (caught.value.path, caught.value.position) == (str(path), 0)


def test_truncated_file_raises_corruption_error(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.bin"
    checkpoint.write_atomic(path, KIND, b"0123456789abcdef")
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(CorruptionError):
        checkpoint.read_checked(path, KIND)


def test_other_kind_raises_corruption_error(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.bin"
    checkpoint.write_atomic(path, b"META", b"body")
    with pytest.raises(CorruptionError, match="kind"):
        checkpoint.read_checked(path, KIND)


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        checkpoint.read_checked(tmp_path / "absent.bin", KIND)


def test_leftover_tmp_file_from_crash_before_rename_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.bin"
    checkpoint.write_atomic(path, KIND, b"old")
    # A crash after writing the new image but before os.replace: a full, and a half, tmp.
    for leftover in (encode_frame(KIND, b"new"), encode_frame(KIND, b"new")[:10]):
        checkpoint.tmp_path(path).write_bytes(leftover)
        assert checkpoint.read_checked(path, KIND) == b"old"
    checkpoint.write_atomic(path, KIND, b"newer")  # The next write overwrites the leftover.
    assert checkpoint.read_checked(path, KIND) == b"newer"
    assert not checkpoint.tmp_path(path).exists()


def test_fsync_dir_accepts_a_directory(tmp_path: Path) -> None:
    checkpoint.fsync_dir(tmp_path)
    with pytest.raises(NotADirectoryError):
        checkpoint.fsync_dir(Path(__file__))
