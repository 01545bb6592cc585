"""`python -m bench.cold_code` prints one row per workload with a cost for each pause, with
and without busy loops beside it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cold_code

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("spinners", [0, 1])
def test_each_workload_gets_a_cost_per_pause(spinners: int) -> None:
    command = [sys.executable, "-m", "bench.cold_code", "--seconds", "0.05"]
    done = subprocess.run(
        [*command, "--spinners", str(spinners)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| workload | tight | after 0.2 ms sleep | after 3 ms sleep |")
    assert len(rows) == 1 + len(cold_code.WORKLOADS)
    for row, name in zip(rows[1:], cold_code.WORKLOADS, strict=True):
        costs = re.findall(r"([\d,.]+) us", row)
        assert row.startswith(f"| {name} |"), row
        assert len(costs) == len(cold_code.PAUSES_S), row
        assert all(float(cost.replace(",", "")) > 0 for cost in costs), row
