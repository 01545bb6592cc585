"""bench.checkouts_ab end to end with tiny settings: one cluster per checkout (here the same
checkout twice), a cell on each in turn, and the medians and their ratio printed."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

from bench import checkouts_ab, common

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.cluster
@pytest.mark.parametrize("columns", ["11", "211"])
def test_both_arms_publish_and_the_ratio_is_printed(
    capsys: pytest.CaptureFixture[str],
    columns: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = ["--a", str(REPO), "--b", str(REPO), "--shape", "async:100", "--columns", columns]
    assert checkouts_ab.main([*argv, "--rounds", "1", "--seconds", "0.3"]) == 0
    assert list(tmp_path.iterdir()) == []  # both clusters' directories are gone
    out = capsys.readouterr().out
    assert "round 0 A:" in out
    assert "round 0 B:" in out
    assert "B/A: rows/s x" in out
    assert "node CPU per row x" in out
    assert "context switches per append x" in out
    assert re.search(r"B/A round by round \(median of the 1 pairs\): rows/s x[0-9.]+", out)
    assert re.search(r"steal \d+%-\d+% of the machine's CPU", out), out
    switches = re.findall(r"([0-9.]+) node context switches per append", out)
    assert len(switches) == 4, out  # the round's two lines and the two medians
    assert all(float(count) > 0 for count in switches), out


def test_a_directory_that_is_not_a_checkout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        checkouts_ab.main(["--a", str(REPO), "--b", str(tmp_path)])


@pytest.mark.parametrize("text", ["wait", "sync:10", "async:0", "async:x"])
def test_a_bad_shape_is_refused(text: str) -> None:
    with pytest.raises(SystemExit):
        checkouts_ab.main(["--a", str(REPO), "--b", str(REPO), "--shape", text])


def test_paired_ratios_take_each_round_against_its_own_pair() -> None:
    # Round 1 ran in a slow minute for both arms: B is 10% faster in every round, which the
    # pairs show; the medians of each arm (2,000 and 1,100) would not.
    a = [checkouts_ab.Cell(1000, None, 1, node_cpu_ms_per_10k=10, steal=0.0)]
    a += [checkouts_ab.Cell(2000, None, 1, node_cpu_ms_per_10k=20, steal=0.3)]
    a += [checkouts_ab.Cell(3000, None, 1, node_cpu_ms_per_10k=30, steal=0.05)]
    b = [checkouts_ab.Cell(cell.rows_per_s * 1.1, None, 1, node_cpu_ms_per_10k=9) for cell in a]
    text = checkouts_ab.paired_summary(a, b)
    assert "median of the 3 pairs): rows/s x1.10, node CPU per row x0.45" in text
    assert "steal 0%-30%" in text


def test_steal_is_read_from_the_first_line_of_proc_stat() -> None:
    before = common.CpuTimes.parse("cpu  100 0 50 800 10 0 5 35 0 0")
    after = common.CpuTimes.parse("cpu  150 0 60 850 10 0 5 60 0 0")
    assert (before.total, before.steal) == (1000, 35)
    assert after.steal_share_since(before) == pytest.approx(25 / 135)
    assert after.steal_share_since(after) == 0.0
    # busy: 135 ticks, less 50 idle and iowait, less 25 stolen
    ticks = os.sysconf("SC_CLK_TCK")
    assert after.busy_seconds_since(before) == pytest.approx(60 / ticks)
    assert common.CpuTimes.now().total > 0
