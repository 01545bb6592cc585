"""requirements.txt allows no version of grpcio or protobuf that the generated code in
proto/ refuses at import (it checks both; an older one fails with VersionError)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def _lower_bound(package: str) -> tuple[int, ...]:
    for line in (REPO / "requirements.txt").read_text().splitlines():
        match = re.fullmatch(rf"{re.escape(package)}>=([0-9.]+)\s*", line)
        if match:
            return tuple(int(part) for part in match.group(1).split("."))
    raise AssertionError(f"requirements.txt has no {package}>=...")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_lower_bounds_cover_what_the_generated_code_needs() -> None:
    grpc_code = (REPO / "proto" / "hastream_pb2_grpc.py").read_text()
    generated_grpc = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_code)
    assert generated_grpc is not None
    assert _lower_bound("grpcio") >= _version(generated_grpc.group(1))
    assert _lower_bound("grpcio-health-checking") >= _version(generated_grpc.group(1))
    pb_code = (REPO / "proto" / "hastream_pb2.py").read_text()
    generated_pb = re.search(r"# Protobuf Python Version: ([0-9.]+)", pb_code)
    assert generated_pb is not None
    assert _lower_bound("protobuf") >= _version(generated_pb.group(1))
