"""bench.cold_code prints one row per workload with a cost for each pause, with and without
busy loops beside it."""

from __future__ import annotations

import re

import pytest

from bench import cold_code


@pytest.mark.parametrize("spinners", [0, 1])
def test_each_workload_gets_a_cost_per_pause(
    spinners: int, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cold_code.main(["--seconds", "0.05", "--spinners", str(spinners)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| workload | tight | after 0.2 ms sleep | after 3 ms sleep |")
    assert len(rows) == 1 + len(cold_code.WORKLOADS)
    for row, name in zip(rows[1:], cold_code.WORKLOADS, strict=True):
        costs = re.findall(r"([\d,.]+) us", row)
        assert row.startswith(f"| {name} |"), row
        assert len(costs) == len(cold_code.PAUSES_S), row
        assert all(float(cost.replace(",", "")) > 0 for cost in costs), row
