"""The `hastream` data source on a real Spark standalone cluster, the packages shipped as a
wheel: a master and a separate worker started with pyspark's own `bin/spark-class`, an
application submitted with `bin/spark-submit --py-files <wheel as .zip>` in its own driver
process (this process's JVM, if any, already hosts the session-scoped local SparkContext),
and a real three-node cluster.

Nothing imports this project from the repository but the test itself: the worker, the
driver and their Python processes get an environment without `PYTHONPATH` and run in the
test's tmp dir, so `spark_publisher`, `api_clients` and `proto` can only come from the
shipped wheel, which the application checks on the driver and on the executor.

Run as a script (`spark-submit ... test_spark_standalone.py --sites ... --table ...`), this
module is that application: it writes ROWS rows with `df.write.format("hastream")`, reads
them back with `spark.read.format("hastream")`, compares, and prints one result line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

ROWS = 100_000
RESULT_PREFIX = "HASTREAM_STANDALONE_RESULT "
CHECKED_MODULES = ("spark_publisher", "api_clients", "proto")
TABLE_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("sym", pa.string()),
        ("qty", pa.int32()),
        ("price", pa.float64()),
        ("ts", pa.timestamp("ms")),
    ]
)
# Variables that would put the repository on a child's sys.path.
_PYTHON_DROPPED = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")


# --- the application (the driver process) ---


def _where_imported(_: object) -> dict[str, Any]:
    """Runs in a Python worker: where this process imports the project's packages from."""
    import importlib
    import os
    import sys

    return {
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "sys_path": [os.path.abspath(entry) for entry in sys.path],
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "modules": {
            name: os.path.abspath(importlib.import_module(name).__file__ or "")
            for name in CHECKED_MODULES
        },
    }


def _app_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sites", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--rows", type=int, default=ROWS)
    args = parser.parse_args(argv)
    seconds: dict[str, float] = {}
    mark = time.monotonic()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        seconds[name] = round(now - mark, 2)
        mark = now

    from pyspark.sql import SparkSession

    spark = SparkSession.builder.appName("hastream-standalone").getOrCreate()
    lap("session")
    try:
        import spark_publisher

        spark_publisher.register(spark)
        driver = _where_imported(None)
        context = spark.sparkContext
        executors = context.parallelize(range(2), 2).map(_where_imported).collect()
        lap("probe")

        frame = spark.range(args.rows, numPartitions=2).selectExpr(
            "id",
            "concat('SYM', cast(id % 500 AS string)) AS sym",
            "cast(id % 1000 AS int) AS qty",
            "id * 0.01D AS price",
            "timestamp_millis(1700000000000 + id) AS ts",
        )
        expected = frame.toArrow().sort_by("id")
        lap("expected")
        frame.write.format("hastream").option("sites", args.sites).option("table", args.table).mode(
            "append"
        ).save()
        lap("write")
        read = (
            spark.read.format("hastream")
            .option("sites", args.sites)
            .option("table", args.table)
            .load()
        )
        got = read.toArrow().sort_by("id")
        lap("read")
        differing = [
            name
            for name in expected.column_names
            if name not in got.column_names or not got.column(name).equals(expected.column(name))
        ]
        result = {
            "master": context.master,
            "py_files": spark.conf.get("spark.submit.pyFiles", ""),
            "rows_written": args.rows,
            "rows_read": got.num_rows,
            "columns": got.column_names,
            "differing_columns": differing,
            "equal": got.num_rows == args.rows
            and got.column_names == expected.column_names
            and not differing,
            "driver": driver,
            "executors": executors,
            "seconds": seconds,
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    finally:
        spark.stop()
    return 0


# --- the test ---


def _clean_env(tmp: Path, spark_home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without PYTHONPATH and without Spark's own variables (a
    SparkSession in this process may have set them), plus loopback-only Spark settings."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _PYTHON_DROPPED and not key.startswith(("SPARK_", "PYSPARK_"))
    }
    env.update(
        SPARK_HOME=str(spark_home),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_CONF_DIR=str(tmp / "conf"),
    )
    env.update(extra)
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(process: subprocess.Popen[bytes], grace_s: float = 20) -> None:
    """SIGTERM to a process group this test started (a JVM with its executors and Python
    workers), SIGKILL to what is left of it after `grace_s`."""
    from deploy.local_cluster import wait_until  # test side only: not in the application

    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        wait_until(
            lambda: process.poll() is not None and not _group_alive(process.pid),
            timeout_s=grace_s,
            interval_s=0.1,
            message=f"process group {process.pid} to exit",
        )
    except AssertionError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def _poll(
    predicate: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    watch: Sequence[tuple[str, subprocess.Popen[bytes], Path]] = (),
) -> None:
    """Polls `predicate` until it is true; fails at the deadline or as soon as a watched
    process exits (with its log's tail). OSError (the UI not listening yet) is retried."""
    from deploy.local_cluster import wait_until  # test side only: not in the application

    def ready() -> bool:
        for name, process, log in watch:
            if process.poll() is not None:  # pytest.fail is not retried by wait_until
                pytest.fail(
                    f"{name} exited {process.returncode} before {what}:\n{_tail(log)}",
                    pytrace=False,
                )
        return bool(predicate())

    wait_until(ready, timeout_s=timeout_s, interval_s=0.2, message=what)


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"({path} missing)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class _Standalone:
    """A Spark standalone master and one worker (1 core, 1 GiB) on loopback, both started
    with pyspark's `bin/spark-class` in their own process groups, ports picked free."""

    def __init__(self, tmp: Path, spark_home: Path) -> None:
        from deploy.local_cluster import free_ports

        self.tmp = tmp
        self.spark_home = spark_home
        self.port, self.ui_port, self.worker_ui_port = free_ports(3)
        self.url = f"spark://127.0.0.1:{self.port}"
        self.named: list[tuple[str, subprocess.Popen[bytes]]] = []
        (tmp / "conf").mkdir(parents=True, exist_ok=True)
        # Read by the daemons as their defaults: no REST submission server (port 6066).
        (tmp / "conf" / "spark-defaults.conf").write_text("spark.master.rest.enabled false\n")
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _spawn(self, name: str, arguments: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        with log.open("ab") as log_file:
            process = subprocess.Popen(
                [str(self.spark_home / "bin" / "spark-class"), *arguments],
                cwd=self.tmp,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=_clean_env(self.tmp, self.spark_home, **env),
                start_new_session=True,
            )
        self.named.append((name, process))
        return process

    def start_master(self) -> None:
        self._spawn(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
            ],
        )

    def start_worker(self) -> None:
        work = self.tmp / "work"
        work.mkdir(exist_ok=True)
        self._spawn(
            "worker",
            [
                "org.apache.spark.deploy.worker.Worker",
                self.url,
                "--host",
                "127.0.0.1",
                "--cores",
                "1",
                "--memory",
                "1g",
                "--webui-port",
                str(self.worker_ui_port),
                "--work-dir",
                str(work),
            ],
            SPARK_LOCAL_DIRS=str(self.tmp / "worker-local"),
        )

    def state(self) -> dict[str, Any]:
        """The master's UI JSON (`/json/`): status, workers, apps."""
        address = f"http://127.0.0.1:{self.ui_port}/json/"
        with self._opener.open(address, timeout=2) as response:
            document: dict[str, Any] = json.load(response)
        return document

    def watched(self) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
        return [(name, process, self.tmp / f"{name}.log") for name, process in self.named]

    def stop(self) -> None:
        for _, process in reversed(self.named):  # The worker (and its executors) first.
            _stop_group(process)


@contextlib.contextmanager
def _standalone(tmp: Path, spark_home: Path) -> Iterator[_Standalone]:
    standalone = _Standalone(tmp, spark_home)
    try:
        yield standalone
    finally:
        standalone.stop()


def test_standalone_cluster_writes_and_reads_back_with_the_wheel_shipped(tmp_path: Path) -> None:
    if shutil.which("java") is None:
        pytest.skip("java is not installed: a Spark standalone master needs it")
    import pyspark

    from deploy.local_cluster import REPO, LocalCluster
    from spark_publisher.packaging import build_wheel, py_file

    spark_home = Path(pyspark.__file__).resolve().parent
    if not (spark_home / "bin" / "spark-class").exists():
        pytest.skip(f"pyspark at {spark_home} has no bin/spark-class")
    seconds: dict[str, float] = {}
    started = mark = time.monotonic()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        seconds[name] = round(now - mark, 2)
        mark = now

    table = "standalone"
    with contextlib.ExitStack() as stack:
        spark = stack.enter_context(_standalone(tmp_path / "spark", spark_home))
        spark.start_master()
        shipped = py_file(build_wheel(tmp_path / "dist"))  # While the master starts.
        lap("wheel")
        _poll(
            lambda: spark.state().get("status") == "ALIVE",
            timeout_s=90,
            what="the master is alive",
            watch=spark.watched(),
        )
        lap("master")
        spark.start_worker()
        cluster = LocalCluster(tmp_path / "cluster")  # While the worker starts.
        stack.callback(cluster.stop)
        cluster.start()
        cluster.create_table(table, TABLE_SCHEMA)  # No key column: duplicates would show.
        lap("cluster")
        _poll(
            lambda: any(
                worker["state"] == "ALIVE" and worker["cores"] == 1
                for worker in spark.state()["workers"]
            ),
            timeout_s=90,
            what="the worker registered with the master",
            watch=spark.watched(),
        )
        lap("worker")

        app = tmp_path / "app" / "standalone_app.py"  # Outside the repository: sys.path[0].
        app.parent.mkdir()
        shutil.copyfile(__file__, app)
        sites = ",".join(f"127.0.0.1:{node.port}:{alias}" for alias, node in cluster.nodes.items())
        stdout, stderr = tmp_path / "app" / "stdout.txt", tmp_path / "app" / "stderr.txt"
        command = [
            str(spark_home / "bin" / "spark-submit"),
            "--master",
            spark.url,
            "--driver-memory",
            "512m",
            "--executor-memory",
            "512m",
            "--conf",
            "spark.cores.max=1",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.ui.showConsoleProgress=false",
            "--conf",
            "spark.sql.session.timeZone=UTC",
            "--py-files",
            str(shipped),
            str(app),
            "--sites",
            sites,
            "--table",
            table,
            "--rows",
            str(ROWS),
        ]
        with stdout.open("wb") as out, stderr.open("wb") as err:
            driver = subprocess.Popen(
                command,
                cwd=app.parent,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=_clean_env(
                    spark.tmp, spark_home, SPARK_LOCAL_DIRS=str(tmp_path / "driver-local")
                ),
                start_new_session=True,
            )
        stack.callback(_stop_group, driver)
        try:
            code = driver.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"driver still running after 300s, stderr:\n{_tail(stderr)}")
        lap("application")
        assert code == 0, f"driver exited {code}, stderr:\n{_tail(stderr, 80)}"
        lines = [
            line[len(RESULT_PREFIX) :]
            for line in stdout.read_text().splitlines()
            if line.startswith(RESULT_PREFIX)
        ]
        assert len(lines) == 1, f"no result line; stdout:\n{_tail(stdout)}\n{_tail(stderr)}"
        result = json.loads(lines[0])

        assert result["master"] == spark.url
        assert result["rows_read"] == ROWS, result
        assert result["differing_columns"] == [], result["differing_columns"]
        assert result["equal"] is True
        # The plain client agrees: every row stored once (the table has no key column).
        assert cluster.row_count(cluster.leader(), table) == ROWS
        # Every process imported the packages from the shipped zip, none from the repo.
        work = (spark.tmp / "work").resolve()
        for where, probe in [("driver", result["driver"])] + [
            ("executor", probe) for probe in result["executors"]
        ]:
            for name, path in probe["modules"].items():
                assert f"{shipped.name}/{name}/" in path, (where, name, path)
                assert not path.startswith(str(REPO)), (where, name, path)
            assert not any(
                entry == str(REPO) or entry.startswith(f"{REPO}/") for entry in probe["sys_path"]
            ), (where, probe["sys_path"])
            assert str(REPO) not in probe["pythonpath"], (where, probe["pythonpath"])
            if where == "executor":
                assert probe["cwd"].startswith(f"{work}/app-"), probe["cwd"]
                assert probe["modules"]["spark_publisher"].startswith(f"{work}/app-")
        apps = spark.state()["completedapps"] + spark.state()["activeapps"]
        assert any(app_info["name"] == "hastream-standalone" for app_info in apps), apps
    seconds["teardown"] = round(time.monotonic() - mark, 2)
    seconds["total"] = round(time.monotonic() - started, 2)
    print(f"standalone timings (s): test {seconds}, application {result['seconds']}")


if __name__ == "__main__":
    sys.exit(_app_main(sys.argv[1:]))
