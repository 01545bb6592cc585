"""raftstore/tuning.py: the measurement knobs a node reads from HASTREAM_TUNING at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hastream.errors import ConfigError
from raftstore import limits, tuning


def test_unset_is_the_products_defaults() -> None:
    assert tuning.from_environment({}, "node1") == tuning.DEFAULT
    assert tuning.DEFAULT.proposals_in_flight == limits.PROPOSALS_IN_FLIGHT_MAX
    assert tuning.DEFAULT.switch_interval_ms is None
    assert tuning.DEFAULT.trace_file is None
    assert tuning.DEFAULT.yield_after_ack is None  # chosen from the machine at start
    assert tuning.DEFAULT.kernel_syncs is True
    assert tuning.DEFAULT.journal_segment_bytes is None
    assert tuning.DEFAULT.hold_followers_ms is None  # replication.HOLD_FOLLOWERS_S
    assert tuning.DEFAULT.journal_resident_bytes is None  # limits.RAFT_LOG_RESIDENT_BYTES


def test_every_knob_is_read_and_the_alias_substituted() -> None:
    text = (
        " proposals_in_flight=2, switch_interval_ms=0.5 ,trace_file=/tmp/<ALIAS>-trace.json,"
        "yield_after_ack=off, kernel_syncs=off, journal_segment_bytes=262144, hold_followers_ms=0,"
        "journal_resident_bytes=1048576"
    )
    assert tuning.from_environment({"HASTREAM_TUNING": text}, "node7") == tuning.Tuning(
        proposals_in_flight=2,
        switch_interval_ms=0.5,
        trace_file=Path("/tmp/node7-trace.json"),
        yield_after_ack=False,
        kernel_syncs=False,
        journal_segment_bytes=262144,
        hold_followers_ms=0.0,
        journal_resident_bytes=1048576,
    )
    assert tuning.parse("kernel_syncs=on", "n") == tuning.DEFAULT
    assert tuning.parse("yield_after_ack=on", "n").yield_after_ack is True


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("proposals_in_flight=0", "proposals_in_flight", "must be 1..8"),
        ("proposals_in_flight=9", "proposals_in_flight", "must be 1..8"),
        ("proposals_in_flight=two", "proposals_in_flight", "not an integer"),
        ("switch_interval_ms=0", "switch_interval_ms", "must be 0.05..100.0"),
        ("switch_interval_ms=fast", "switch_interval_ms", "not a number"),
        ("yield_after_ack=no", "yield_after_ack", "must be on or off"),
        ("yield_after_ack=", "yield_after_ack", "must be on or off"),
        ("kernel_syncs=aio", "kernel_syncs", "must be on or off"),
        ("journal_segment_bytes=1000", "journal_segment_bytes", "must be 65536..67108864"),
        ("journal_segment_bytes=67108865", "journal_segment_bytes", "must be 65536.."),
        ("journal_segment_bytes=1MiB", "journal_segment_bytes", "not an integer"),
        ("hold_followers_ms=-1", "hold_followers_ms", "must be 0.0..50.0"),
        ("hold_followers_ms=51", "hold_followers_ms", "must be 0.0..50.0"),
        ("hold_followers_ms=soon", "hold_followers_ms", "not a number"),
        ("journal_resident_bytes=1000", "journal_resident_bytes", "must be 65536..100663296"),
        ("journal_resident_bytes=100663297", "journal_resident_bytes", "must be 65536.."),
        ("peer_auth=off", "peer_auth", "unknown knob"),
        ("proposals_in_flight", "proposals_in_flight", "expected key=value"),
        ("proposals_in_flight=1,proposals_in_flight=2", "proposals_in_flight", "given twice"),
    ],
)
def test_a_bad_knob_is_refused_by_name(text: str, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as raised:
        tuning.parse(text, "node1")
    assert raised.value.path == "environment HASTREAM_TUNING"
    assert raised.value.key == key
    assert reason in raised.value.reason


def test_no_knob_raises_a_bound_limits_py_sized_memory_by() -> None:
    # The Raft send buffer cap is computed from PROPOSALS_IN_FLIGHT_MAX: more in flight
    # than that would let a slow follower's queue grow past it.
    with pytest.raises(ConfigError):
        tuning.parse(f"proposals_in_flight={limits.PROPOSALS_IN_FLIGHT_MAX + 1}", "n")


@given(
    in_flight=st.integers(1, limits.PROPOSALS_IN_FLIGHT_MAX),
    switch=st.none() | st.sampled_from([0.05, 0.5, 1.0, 2.5, 100.0]),
    trace=st.none() | st.sampled_from(["/tmp/a.json", "/var/tmp/x/trace.json"]),
    yield_after_ack=st.none() | st.booleans(),
    kernel_syncs=st.booleans(),
    segment_bytes=st.none() | st.integers(64 * 1024, limits.RAFT_JOURNAL_SEGMENT_BYTES),
    hold_ms=st.none() | st.sampled_from([0.0, 0.5, 2.0, 50.0]),
    resident_bytes=st.none() | st.integers(64 * 1024, limits.RAFT_LOG_RESIDENT_BYTES),
)
def test_render_reads_back(
    in_flight: int,
    switch: float | None,
    trace: str | None,
    yield_after_ack: bool | None,
    kernel_syncs: bool,
    segment_bytes: int | None,
    hold_ms: float | None,
    resident_bytes: int | None,
) -> None:
    knobs = tuning.Tuning(
        proposals_in_flight=in_flight,
        switch_interval_ms=switch,
        trace_file=None if trace is None else Path(trace),
        yield_after_ack=yield_after_ack,
        kernel_syncs=kernel_syncs,
        journal_segment_bytes=segment_bytes,
        hold_followers_ms=hold_ms,
        journal_resident_bytes=resident_bytes,
    )
    assert tuning.parse(tuning.render(knobs), "n") == knobs


@pytest.mark.parametrize(
    ("content", "halts"),
    [("none\n", True), ("", True), ("haltpoll\n", False), ("intel_idle\n", False), (None, True)],
    ids=["none", "empty", "haltpoll", "intel_idle", "no-cpuidle"],
)
def test_the_followers_yield_follows_whether_idle_cpus_halt(
    tmp_path: Path, content: str | None, halts: bool
) -> None:
    """Unset, the yield is on where idle CPUs halt outright (no cpuidle driver: waking one
    is slow, and the leader's thread is queued behind the follower that woke it), off
    where a driver makes the wake-up cheap; a knob decides it either way."""
    driver = tmp_path / "current_driver"
    if content is not None:
        driver.write_text(content, encoding="ascii")
    assert tuning.idle_cpus_halt(driver) is halts
    assert tuning.yields_after_ack(tuning.DEFAULT, driver) is halts
    assert tuning.yields_after_ack(tuning.parse("yield_after_ack=on", "n"), driver) is True
    assert tuning.yields_after_ack(tuning.parse("yield_after_ack=off", "n"), driver) is False
