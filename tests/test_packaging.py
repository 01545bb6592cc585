"""The pip package: the client alone needs only its own dependencies, the extras bring the
rest, requirements.txt is their union with the same pins, and the wheel built from the
checkout holds the packages, the extras and the `hastream` command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ("server", "spark", "docker", "dev")
# Imported only by the node, the deployments, Spark and the tests: never by the client.
NOT_FOR_THE_CLIENT = (
    "pysyncobj",
    "pyspark",
    "cryptography",
    "prometheus_client",
    "click",
    "docker",
    "yaml",
    "raftstore",
)


_NOT_SOURCES = (
    ".git",
    ".run",
    "data",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
)


def _project() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project


def _requirements() -> set[str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return {line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()}


@pytest.mark.unit
def test_requirements_are_the_union_of_the_package_and_its_extras() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    assert isinstance(extras, dict)
    assert extras["all"] == [f"hastream[{','.join(EXTRAS)}]"]
    declared = set(project["dependencies"])  # type: ignore[call-overload]
    for extra in EXTRAS:
        declared |= set(extras[extra])
    assert declared == _requirements()


@pytest.mark.unit
def test_the_client_imports_without_the_server_spark_or_test_dependencies() -> None:
    """A pip user who installs only the client can connect, publish, subscribe and read:
    the client's modules never import what the extras bring."""
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        BLOCKED = {NOT_FOR_THE_CLIENT!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is not a client dependency")
                return None

        sys.meta_path.insert(0, Block())
        import api_clients, api_clients.aio, api_clients.times
        from api_clients import Publisher, Session, connect
        print("client ok", api_clients.__version__)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("client ok")


@pytest.mark.cluster  # slow-ish: builds the wheel
def test_the_wheel_holds_the_packages_the_extras_and_the_command(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("hastream-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
        entry_points = archive.read(metadata.replace("METADATA", "entry_points.txt")).decode()
    for package in ("api_clients", "hastream", "raftstore", "spark_publisher", "proto"):
        assert f"{package}/__init__.py" in names, package
    assert not any(name.startswith("tests/") for name in names)
    for extra in (*EXTRAS, "all"):
        assert f"Provides-Extra: {extra}" in text, extra
    assert re.search(r"^Requires-Dist: pyarrow>=18$", text, re.MULTILINE)
    assert re.search(r'^Requires-Dist: pysyncobj==0\.3\.17; extra == "server"$', text, re.M)
    assert "hastream = hastream_cli.main:main" in entry_points
    _installs_and_runs(wheel, tmp_path / "venv")


def _installs_and_runs(wheel: Path, venv: Path) -> None:
    """The wheel in a fresh virtualenv (its dependencies from this interpreter's packages:
    the test does not download): the command runs, the client imports from the venv, and a
    cluster started from the installed copy takes a publish and answers a read."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
        check=True,
        timeout=120,
    )
    python = venv / "bin" / "python"
    # Without PYTHONPATH: the Spark tests put the checkout on it for this process's children.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    where = subprocess.run(
        [str(python), "-c", "import api_clients; print(api_clients.__file__)"],
        cwd=venv,  # not the checkout: the installed copy answers
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv)
    command = subprocess.run(
        [str(venv / "bin" / "hastream"), "--help"],
        cwd=venv,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert command.returncode == 0, command.stderr
    assert "tail" in command.stdout
    used = subprocess.run(
        [str(python), "-c", ROUND_TRIP],
        cwd=venv,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert used.returncode == 0, used.stderr
    where_nodes, ids = used.stdout.strip().splitlines()
    assert Path(where_nodes).is_relative_to(venv), "the nodes ran the installed copy"
    assert ids == "[1, 2, 3]"


# From the installed copy, outside the checkout: a three-node cluster, a publish, a read.
ROUND_TRIP = """
import pathlib, tempfile
import pyarrow as pa
import raftstore
from api_clients import Publisher, Session
from deploy.local_cluster import LocalCluster

cluster = LocalCluster(pathlib.Path(tempfile.mkdtemp()) / "cluster").start()
try:
    session = Session([f"127.0.0.1:{node.port}" for node in cluster.nodes.values()])
    schema = pa.schema([("id", pa.int64())])
    session.haStreamTable(2, schema, "t", 100)
    Publisher(session, "t").append(pa.table({"id": [1, 2, 3]}, schema))
    print(pathlib.Path(raftstore.__file__).parent)
    print(session.read("t", 0).column("id").to_pylist())
    session.close()
finally:
    cluster.stop()
"""
