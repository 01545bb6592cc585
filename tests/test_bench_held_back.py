"""bench.held_back: a real cluster whose held-back follower is stopped and continued in turns,
every acknowledged row on every replica afterwards, and the pieces of its call split."""

from __future__ import annotations

import re

import pytest

from bench import held_back


def test_batches_are_the_messages_of_two_or_more_new_entries() -> None:
    # One entry per message (the eager follower's), a heartbeat (no new index), a batch
    # of three, an old index seen again (a resend), a batch of two.
    received = [(5, 1.0), (6, 2.0), (6, 2.5), (9, 3.0), (8, 3.5), (11, 4.0)]
    assert held_back.batch_times(received) == [3.0, 4.0]
    assert held_back.batch_times([]) == []


def test_calls_are_split_by_a_batch_received_while_they_ran() -> None:
    calls = [(0.0, 0.002), (0.010, 0.011), (0.020, 0.024)]
    split = held_back.split_calls(calls, received=[0.001, 0.0235, 0.030])
    assert (split.overlapping, split.others) == (2, 1)
    assert split.overlapping_mean_ms == pytest.approx(3.0)
    assert split.others_mean_ms == pytest.approx(1.0)
    # Two of three calls took 2 ms more than the others: 4/3 ms more per call on average.
    assert split.added_ms_per_call == pytest.approx(4 / 3)
    assert held_back.split_calls([], received=[1.0]).added_ms_per_call == 0.0


def test_a_window_longer_than_the_leaders_patience_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        held_back.main(["--seconds", "5"])
    assert "--seconds must be in (0, 2.5]" in capsys.readouterr().err


@pytest.mark.cluster
def test_both_modes_are_measured_and_every_replica_holds_every_row(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # main() itself fails if a replica lacks an acknowledged row or differs from the
    # leader's after the stopped follower is continued (check_replicas).
    assert held_back.main(["--rounds", "2", "--seconds", "0.5", "--trace"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^leader node\d, held-back follower node\d$", out, re.MULTILINE), out
    windows = re.findall(r"^round (\d) (running|stopped) *: ([0-9,]+) appends/s", out, re.MULTILINE)
    assert sorted((number, mode) for number, mode, _ in windows) == [
        ("0", "running"),
        ("0", "stopped"),
        ("1", "running"),
        ("1", "stopped"),
    ], out
    # The order alternates from round to round.
    assert [mode for _, mode, _ in windows] == ["running", "stopped", "stopped", "running"]
    assert all(int(rate.replace(",", "")) > 0 for _, _, rate in windows), out
    assert re.search(r"^stopped / running: rows/s x[0-9.]+ \(medians\)", out, re.MULTILINE), out
    # Every 10 ms the held-back follower gets a batch: a second of running windows sees some.
    found = re.search(r"received a batch: ([0-9,]+), mean", out)
    assert found is not None, out
    assert int(found.group(1).replace(",", "")) > 0, out
