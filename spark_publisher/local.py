"""A quiet local SparkSession for the main job, the tests and the benchmark.

Python workers get their environment when the JVM starts, so `PYSPARK_PYTHON` (this
interpreter, not whatever `python3` is on PATH) and `PYTHONPATH` (the repository, so
workers import `spark_publisher` and `api_clients`) are set before the session exists.
Settings follow docs/spark.md (settings and gotchas). On a real cluster, build the session yourself
and ship the packages to the executors (docs/spark.md).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]

_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def prepare_environment() -> None:
    """Sets what Python workers need; must run before the first SparkSession."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))


def _quiet_accumulator_disconnects() -> None:
    """A Python worker that Spark stops mid-task (a streaming query stopped during a
    micro-batch) closes its accumulator connection without a word; PySpark's accumulator
    server reads that as EOFError and socketserver prints the whole traceback to stderr in
    the middle of a healthy run. Log that one case at DEBUG; anything else is printed."""
    from pyspark import accumulators

    servers: list[Any] = [accumulators.AccumulatorTCPServer]
    unix_server = getattr(accumulators, "AccumulatorUnixServer", None)
    if unix_server is not None:
        servers.append(unix_server)
    for server in servers:
        if getattr(server, "_hastream_quiet", False):
            continue
        original = server.handle_error

        def handle_error(self: Any, request: Any, address: Any, original: Any = original) -> None:
            if isinstance(sys.exc_info()[1], EOFError):
                log.debug("a Python worker closed its accumulator connection early %s", address)
                return
            original(self, request, address)

        server.handle_error = handle_error
        server._hastream_quiet = True


def local_spark(
    app_name: str, *, cores: int = 2, memory: str = "1g", conf: Mapping[str, str] | None = None
) -> Any:
    """A local[cores] SparkSession with UTC session time, no UI, error-level logs and the
    `hastream` source registered; `conf` adds or overrides settings (full `spark.*` keys)."""
    prepare_environment()
    from pyspark.sql import SparkSession

    log_config = Path(tempfile.gettempdir()) / "hastream-log4j2.properties"
    if not log_config.exists() or log_config.read_text() != _LOG4J2:
        log_config.write_text(_LOG4J2)
    builder = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName(app_name)
        .config("spark.driver.memory", memory)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.streaming.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", str(cores))
        .config("spark.default.parallelism", str(cores))
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log_config}")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    _quiet_accumulator_disconnects()
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    import spark_publisher

    spark_publisher.register(spark)
    return spark
