"""bench/sched_wakeups.py: pairing the kernel's wake-up and switch trace points, and a real
recording of a real cluster where perf and the scheduler's trace points are usable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import sched_wakeups
from bench.sched_wakeups import Wake, by_placement, by_thread, parse_wakes


def _switch(at: float, cpu: int, prev: int, state: str, following: int) -> str:
    return (
        f"  python  100/{prev}  [{cpu:03d}]  {at:.6f}: sched:sched_switch: prev_comm=python "
        f"prev_pid={prev} prev_prio=120 prev_state={state} ==> next_comm=python "
        f"next_pid={following} next_prio=120"
    )


def _wake(at: float, cpu: int, waker: int, tid: int, target_cpu: int) -> str:
    return (
        f"  python  200/{waker}  [{cpu:03d}]  {at:.6f}: sched:sched_wakeup: comm=python "
        f"pid={tid} prio=120 target_cpu={target_cpu:03d}"
    )


DESCRIBE = {11: "leader node1/_autoTickThread", 22: "follower node2/_autoTickThread"}


def test_a_sleeping_thread_waits_from_its_wake_up_to_its_switch_in() -> None:
    lines = [
        _switch(1.000000, 0, 11, "S", 0),  # the tick sleeps in its poll; CPU 0 idles
        _switch(1.000010, 1, 0, "R", 22),  # the follower runs on CPU 1
        _wake(1.000100, 1, 22, 11, 1),  # ... acknowledges, and the tick is queued behind it
        _switch(1.000325, 1, 22, "S", 11),  # the follower sleeps: the tick runs 225 us later
        "garbage that is not a trace line",
    ]
    (wake,) = parse_wakes(lines, DESCRIBE)
    assert wake == Wake(
        tid=11,
        at=1.0001,
        wait_s=pytest.approx(225e-6),
        target="follower node2/_autoTickThread",
        other="idle",
        same_cpu=True,
    )


def test_a_wake_up_of_a_thread_that_is_not_asleep_is_no_wait() -> None:
    lines = [
        _switch(1.0, 0, 0, "R", 11),  # the tick runs
        _wake(1.1, 1, 22, 11, 0),  # woken while running: the kernel traces it anyway
        _switch(1.2, 0, 11, "R", 0),  # preempted, not asleep
        _wake(1.3, 1, 22, 11, 0),  # so this is no wake-up from sleep either
        _switch(1.4, 0, 0, "R", 11),
    ]
    assert parse_wakes(lines, DESCRIBE) == []


def test_a_second_wake_up_before_the_switch_does_not_restart_the_wait() -> None:
    lines = [
        _switch(2.0, 0, 11, "S", 0),
        _wake(2.1, 1, 22, 11, 0),  # onto the idle CPU 0, from CPU 1
        _wake(2.2, 1, 22, 11, 0),
        _switch(2.4, 0, 0, "R", 11),
    ]
    (wake,) = parse_wakes(lines, DESCRIBE)
    assert (wake.wait_s, wake.target, wake.same_cpu) == (pytest.approx(0.3), "idle", False)


def test_waits_are_summed_by_thread_and_by_placement() -> None:
    wakes = [
        Wake(11, 1.0, 200e-6, "follower node2/_autoTickThread", "idle", True),
        Wake(11, 2.0, 10e-6, "idle", "idle", True),
        Wake(11, 3.0, 300e-6, "follower node2/_autoTickThread", "idle", True),
        Wake(22, 4.0, 5e-6, "idle", "other", False),
        Wake(99, 5.0, 1.0, "idle", "idle", False),  # not one of ours: left out
    ]
    threads = by_thread(wakes, DESCRIBE)
    assert [(s.label, s.count) for s in threads] == [
        ("leader node1/_autoTickThread", 3),
        ("follower node2/_autoTickThread", 1),
    ]
    assert threads[0].total_s == pytest.approx(510e-6)
    assert threads[0].p50_us == pytest.approx(200)
    placements = by_placement(wakes, 11)
    assert [(s.label, s.count) for s in placements] == [
        ("follower node2/_autoTickThread / idle / woken from that CPU", 2),
        ("idle / idle / woken from that CPU", 1),
    ]
    assert placements[0].mean_us == pytest.approx(250)


def test_a_bad_knob_is_a_usage_error_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        sched_wakeups.main(["--tuning", "yield_after_ack=maybe"])
    assert exited.value.code == 2
    assert "yield_after_ack" in capsys.readouterr().err


@pytest.mark.cluster
def test_a_real_recording_names_the_leaders_tick_and_its_waits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("perf's machine-wide scheduler trace points need root")
    out = tmp_path / "sched.md"
    status = sched_wakeups.main(["--shape", "wait:1", "--seconds", "2", "--markdown", str(out)])
    if status == 2:  # no perf, no tracefs, or a kernel that lets perf record nothing
        pytest.skip(capsys.readouterr().err.strip())
    assert status == 0
    text = out.read_text()
    assert text.startswith("`python -m bench.sched_wakeups --shape wait:1")
    assert "| leader node" in text
    assert "/_autoTickThread |" in text
    assert "| follower node" in text
    assert "The leader's Raft tick thread, by placement" in text
