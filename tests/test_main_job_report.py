"""The main job's report says whether df.writeStream kept up with its offered rate."""

from __future__ import annotations

from deploy.main_job import _keeping_up


def test_kept_up_is_the_median_interval_rate_against_the_offered_rate() -> None:
    # One slow interval (the leader kill) does not decide it; the median does.
    line = _keeping_up([20_000, 19_800, 4_000, 20_100, 19_900], offered_per_s=20_000)
    assert line.split()[2] == "yes:", line
    assert "median 19,900 rows/s over 5 2 s intervals = 100%" in line


def test_falling_behind_is_said_plainly() -> None:
    line = _keeping_up([15_000, 16_000, 15_500], offered_per_s=20_000)
    assert line.split()[2] == "NO:", line
    assert "78% of the offered 20,000/s" in line


def test_no_full_interval_is_unknown_not_yes() -> None:
    assert "unknown" in _keeping_up([], offered_per_s=20_000)
