"""requirements.txt allows no version of grpcio or protobuf that the generated code in
proto/ refuses at import (it checks both; an older one fails with VersionError); the node
image's requirements cover every distribution the node imports."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
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


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_node_image_installs_every_distribution_the_node_imports() -> None:
    """The Docker image holds only deploy/docker/requirements-node.txt's distributions and
    what they require: a module the node imports from anywhere else is missing there, and
    the node dies at import in its container (numpy, which pyarrow does not require, was
    one)."""
    listed = set()
    for line in (REPO / "deploy" / "docker" / "requirements-node.txt").read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
        if match:
            listed.add(_canonical(match.group(1)))
    imported: set[str] = set()
    for package in ("raftstore", "hastream", "proto"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    imported.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"raftstore", "hastream", "proto"}
    distributions = importlib.metadata.packages_distributions()
    missing = {
        module: distributions.get(module, [])
        for module in sorted(third_party)
        if not {_canonical(name) for name in distributions.get(module, [])} & listed
    }
    assert not missing, f"imported by the node, not in requirements-node.txt: {missing}"
