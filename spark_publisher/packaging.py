"""Ship this project to the executors of a real Spark cluster as a wheel.

On `local[*]` the Python workers import `spark_publisher`, `api_clients` and `proto` from
the repository (`spark_publisher.local.prepare_environment`). On a standalone, YARN or
Kubernetes cluster the data source's `read()` and `write()` run in the executors' Python
workers, which import them from what the application ships:

    python -m spark_publisher.packaging dist/     # prints dist/hastream-0.1.0-py3-none-any.zip
    spark-submit --master spark://host:7077 --py-files dist/hastream-0.1.0-py3-none-any.zip job.py

Spark puts a `--py-files` / `spark.submit.pyFiles` entry on the executors' `sys.path` only
if its name ends in `.zip`, `.egg` or `.jar` (`SparkContext.PACKAGE_EXTENSIONS`): a `.whl`
reaches the driver's path but not the executors' (`ModuleNotFoundError: No module named
'spark_publisher'` in the first task). A pure-Python wheel is a zip archive that `zipimport`
reads, so `py_file` gives the same bytes a `.zip` name. The binary dependencies (`pyarrow`,
`grpcio`, `protobuf`) cannot be imported from a zip: they must be installed on the workers
(or shipped in a packed virtualenv through `spark.archives`, docs/spark.md).
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")


def build_wheel(out_dir: Path, *, repo: Path = REPO) -> Path:
    """Builds the project's wheel into `out_dir` and returns its path.

    Offline (`pip wheel --no-index --no-build-isolation`: the build backend, setuptools,
    comes from this interpreter) and without touching `repo`: setuptools writes `build/`
    and `*.egg-info` into the tree it builds, so the files `pyproject.toml` names
    (packages, modules, dependency files) are first copied to a scratch directory.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hastream-wheel-") as scratch:
        source = Path(scratch) / "source"
        _copy_sources(Path(repo).resolve(), source)
        wheelhouse = Path(scratch) / "wheelhouse"
        command = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--quiet",
            "-w",
            str(wheelhouse),
            str(source),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wheels = sorted(wheelhouse.glob("*.whl")) if wheelhouse.is_dir() else []
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"wheel build failed (exit {done.returncode}, wheels {wheels}): "
                f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
            )
        target = out_dir / wheels[0].name
        shutil.move(wheels[0], target)
    return target


def _copy_sources(repo: Path, source: Path) -> None:
    """Copies what `pyproject.toml` builds from: itself, the top-level packages matching
    `[tool.setuptools.packages.find] include`, `py-modules`, dynamic-metadata files."""
    pyproject = repo / "pyproject.toml"
    if not pyproject.is_file():
        raise FileNotFoundError(f"no pyproject.toml in {repo}: build the wheel from a checkout")
    config = tomllib.loads(pyproject.read_text())
    tools = config.get("tool", {}).get("setuptools", {})
    source.mkdir(parents=True)
    shutil.copy2(pyproject, source / "pyproject.toml")
    patterns = tools.get("packages", {}).get("find", {}).get("include", ["*"])
    for entry in sorted(repo.iterdir()):
        is_package = entry.is_dir() and (entry / "__init__.py").is_file()
        if is_package and any(fnmatch.fnmatchcase(entry.name, p) for p in patterns):
            shutil.copytree(entry, source / entry.name, ignore=_SKIP)
    files = [f"{module}.py" for module in tools.get("py-modules", [])]
    for spec in tools.get("dynamic", {}).values():
        listed = spec.get("file", []) if isinstance(spec, dict) else []
        files += [listed] if isinstance(listed, str) else list(listed)
    readme = config.get("project", {}).get("readme")
    if isinstance(readme, str):
        files.append(readme)
    for name in files:
        shutil.copy2(repo / name, source / name)


def py_file(wheel: Path) -> Path:
    """The wheel as a `.zip` beside it, for `--py-files` / `spark.submit.pyFiles` (see the
    module docstring: Spark ignores a `.whl` name on the executors)."""
    wheel = Path(wheel)
    if not wheel.name.endswith("-none-any.whl"):
        raise ValueError(f"{wheel.name} is not a pure-Python wheel: zipimport cannot load it")
    target = wheel.with_suffix(".zip")
    shutil.copyfile(wheel, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spark_publisher.packaging",
        description="Build the project's wheel and its --py-files copy (.zip) into OUT_DIR.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to build")
    args = parser.parse_args(argv)
    print(py_file(build_wheel(args.out_dir, repo=args.repo)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
