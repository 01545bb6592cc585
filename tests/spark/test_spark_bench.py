"""bench.spark_bench end to end with a few thousand rows, in its own process (it starts and
stops its own SparkSession and cluster): every path measured, the table printed and written
with the date, the command and the machine, and every run's seconds in the JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.spark
@pytest.mark.cluster
def test_the_spark_benchmark_writes_its_table_and_every_run(tmp_path: Path) -> None:
    if shutil.which("java") is None:
        pytest.skip("java is not installed")
    markdown, record = tmp_path / "spark-bench.md", tmp_path / "spark-bench.json"
    argv = ["--rows", "4000", "--repeat", "1", "--markdown", str(markdown), "--json", str(record)]
    done = subprocess.run(
        [sys.executable, "-m", "bench.spark_bench", *argv],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    text = markdown.read_text()
    assert text in done.stdout
    assert f"- command: `python -m bench.spark_bench {' '.join(argv)}`" in text
    results = json.loads(record.read_text())["results"]
    assert len(results) == 11
    by_name = {row["name"]: row for row in results}
    assert by_name["df.write hastream, batchRows 10000"]["share"].endswith("%")
    assert all(len(row["runs"]) == 1 and row["seconds"] > 0 for row in results)
    writes = [row for row in results if "write" in row["name"] or "append" in row["name"]]
    assert len(writes) == 7
    floors = [row for row in writes if row["name"].startswith("Spark's floor")]
    assert len(floors) == 2
    assert all(row["share"].endswith("%") for row in floors)
    assert all(len(row["warmup_runs"]) == 1 for row in writes)
    assert "- warm-up: 1 untimed round(s) of every write first" in text
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("spark-bench-")] == []
