"""bench.wakeups: each operation is really timed (a poll sleeps its timeout, the ping-pongs
make their round trips) and the table names every one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench import wakeups


def test_a_poll_sleeps_until_its_timeout() -> None:
    cost = wakeups.poll_timeout(10, 5)
    assert cost.wall_us >= 9_000  # poll's timeout is a lower bound, give or take rounding
    assert cost.cpu_us >= 0


@pytest.mark.parametrize("measure", [wakeups.thread_ping_pong, wakeups.process_ping_pong])
def test_the_ping_pongs_make_their_round_trips(measure: Callable[[int], wakeups.Cost]) -> None:
    cost = measure(50)
    assert cost.wall_us > 0
    assert cost.cpu_us > 0


def test_main_prints_every_operation(capsys: pytest.CaptureFixture[str]) -> None:
    assert wakeups.main(["--rounds", "20"]) == 0
    out = capsys.readouterr().out
    names = ("poll timeout 10 ms", "poll timeout 1 ms", "thread ping-pong", "process ping-pong")
    for name in names:
        assert f"| {name} |" in out


def test_rounds_below_one_are_refused() -> None:
    with pytest.raises(SystemExit):
        wakeups.main(["--rounds", "0"])
