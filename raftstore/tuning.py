"""Measurement knobs of one node process, for A/B runs (bench.experiment); off by default.

A benchmark tries a candidate change on an unmodified node by setting the environment
variable HASTREAM_TUNING before the node starts, e.g.

    HASTREAM_TUNING=proposals_in_flight=1,switch_interval_ms=0.5,trace_file=/tmp/<ALIAS>.json
    HASTREAM_TUNING=yield_after_ack=off
    HASTREAM_TUNING=kernel_syncs=off
    HASTREAM_TUNING=journal_segment_bytes=262144
    HASTREAM_TUNING=hold_followers_ms=0
    HASTREAM_TUNING=journal_resident_bytes=1048576

Operators have no reason to set it: every default is the product's choice (one, the
follower's yield, is chosen from the machine: `yields_after_ack`). A knob may only
lower a bound the node was sized for (fewer entries in flight, never more), so no setting
here can take memory or queues past limits.py. Parsed once, at start, by `python -m
raftstore`; a bad value refuses the start with a ConfigError naming the variable and key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn, TypeVar

from hastream.errors import ConfigError
from raftstore import limits

ENVIRONMENT_VARIABLE: Final = "HASTREAM_TUNING"
_SWITCH_INTERVAL_MS_RANGE: Final = (0.05, 100.0)
_SWITCHES: Final = {"on": True, "off": False}
_HOLD_FOLLOWERS_MS_RANGE: Final = (0.0, 50.0)
_JOURNAL_SEGMENT_BYTES_RANGE: Final = (64 * 1024, limits.RAFT_JOURNAL_SEGMENT_BYTES)
_JOURNAL_RESIDENT_BYTES_RANGE: Final = (64 * 1024, limits.RAFT_LOG_RESIDENT_BYTES)
_Number = TypeVar("_Number", int, float)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tuning:
    # Raft entries proposed and not yet applied, per group (batcher.py). Fewer make
    # concurrent publishes share an entry (group commit) instead of each taking one.
    proposals_in_flight: int = limits.PROPOSALS_IN_FLIGHT_MAX
    # sys.setswitchinterval in ms; None keeps Python's 5 ms. Shorter hands the GIL sooner
    # from the tick thread to a thread woken by a commit.
    switch_interval_ms: float | None = None
    # Where the write path's per-stage timings (trace.py) are written at exit; None records
    # nothing. `<ALIAS>` is replaced by the node's alias.
    trace_file: Path | None = None
    # A follower gives up its CPU (sched_yield) right after sending its acknowledgements,
    # before it applies (replication.py). None: where idle CPUs halt (`idle_cpus_halt`);
    # "on" or "off" decides it for an A/B.
    yield_after_ack: bool | None = None
    # The leader's own fdatasyncs run by the kernel (Linux AIO, storage/kernel_sync.py)
    # where it can. "off" measures the journal's helper thread instead.
    kernel_syncs: bool = True
    # Raft journal segments of this many bytes instead of RAFT_JOURNAL_SEGMENT_BYTES (never
    # more; the room spares need free scales with them): a test's cluster fills, frees and
    # reuses segments within seconds.
    journal_segment_bytes: int | None = None
    # How long the leader holds entries back from a follower a commit does not need
    # (raftstore/pacing.py), in ms; 0 sends every follower every entry at once, as
    # pysyncobj does. None keeps the product's choice.
    hold_followers_ms: float | None = None
    # The Raft journal holds at most this many command bytes in memory instead of
    # RAFT_LOG_RESIDENT_BYTES (never more): a test's cluster reads its older entries back
    # from the journal files (replays, lagging followers) after a few MB, not 96 MiB.
    journal_resident_bytes: int | None = None


DEFAULT: Final = Tuning()
CPUIDLE_DRIVER: Final = Path("/sys/devices/system/cpu/cpuidle/current_driver")


def idle_cpus_halt(driver_file: Path = CPUIDLE_DRIVER) -> bool:
    """Whether this machine's idle CPUs halt outright: no cpuidle driver (or none readable),
    as on some VMs. Waking a halted vCPU from the other one costs hundreds of microseconds
    there, so Linux queues the leader's thread, woken by a follower's acknowledgement,
    behind that follower on its busy CPU, and the follower's yield lets it run first (+5%
    rows/s at one-row waited appends, docs/benchmark.md). Where a driver (haltpoll, a
    C-state one) makes the wake-up cheap, the yield only costs: x0.86-0.93 rows/s at
    waited appends on an AMD EPYC VM with haltpoll."""
    try:
        driver = driver_file.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return True
    return driver in ("", "none")


def yields_after_ack(tuning: Tuning, driver_file: Path = CPUIDLE_DRIVER) -> bool:
    """The follower's yield after its acknowledgements: the knob if set, else the machine's
    answer (`idle_cpus_halt`)."""
    if tuning.yield_after_ack is not None:
        return tuning.yield_after_ack
    return idle_cpus_halt(driver_file)


def from_environment(environ: Mapping[str, str], alias: str) -> Tuning:
    """The Tuning HASTREAM_TUNING asks for (DEFAULT when unset). Raises ConfigError."""
    return parse(environ.get(ENVIRONMENT_VARIABLE, ""), alias)


def parse(text: str, alias: str) -> Tuning:
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, separator, value = item.partition("=")
        key = key.strip()
        if not separator:
            _refuse(key, "", "expected key=value")
        if key in values:
            _refuse(key, value, "given twice")
        values[key] = value.strip()
    unknown = sorted(set(values) - set(Tuning.__dataclass_fields__))
    if unknown:
        known = ", ".join(Tuning.__dataclass_fields__)
        _refuse(unknown[0], values[unknown[0]], f"unknown knob (known: {known})")
    in_flight = DEFAULT.proposals_in_flight
    if "proposals_in_flight" in values:
        in_flight = _number("proposals_in_flight", values["proposals_in_flight"], int)
        if not 1 <= in_flight <= limits.PROPOSALS_IN_FLIGHT_MAX:
            reason = f"must be 1..{limits.PROPOSALS_IN_FLIGHT_MAX} (limits.py sizes buffers by it)"
            _refuse("proposals_in_flight", values["proposals_in_flight"], reason)
    switch_ms = _ranged(values, "switch_interval_ms", float, _SWITCH_INTERVAL_MS_RANGE)
    trace_file = None
    if values.get("trace_file"):
        trace_file = Path(values["trace_file"].replace("<ALIAS>", alias))
    yield_after_ack: bool | None = DEFAULT.yield_after_ack
    if "yield_after_ack" in values:
        yield_after_ack = _switch("yield_after_ack", values["yield_after_ack"])
    kernel_syncs = DEFAULT.kernel_syncs
    if "kernel_syncs" in values:
        kernel_syncs = _switch("kernel_syncs", values["kernel_syncs"])
    segment_bytes = _ranged(values, "journal_segment_bytes", int, _JOURNAL_SEGMENT_BYTES_RANGE)
    hold_ms = _ranged(values, "hold_followers_ms", float, _HOLD_FOLLOWERS_MS_RANGE)
    resident_bytes = _ranged(values, "journal_resident_bytes", int, _JOURNAL_RESIDENT_BYTES_RANGE)
    return Tuning(
        proposals_in_flight=in_flight,
        switch_interval_ms=switch_ms,
        trace_file=trace_file,
        yield_after_ack=yield_after_ack,
        kernel_syncs=kernel_syncs,
        journal_segment_bytes=segment_bytes,
        hold_followers_ms=hold_ms,
        journal_resident_bytes=resident_bytes,
    )


def render(tuning: Tuning) -> str:
    """The HASTREAM_TUNING value that parses back to `tuning` (for launchers)."""
    parts = []
    if tuning.proposals_in_flight != DEFAULT.proposals_in_flight:
        parts.append(f"proposals_in_flight={tuning.proposals_in_flight}")
    if tuning.switch_interval_ms is not None:
        parts.append(f"switch_interval_ms={tuning.switch_interval_ms:g}")
    if tuning.trace_file is not None:
        parts.append(f"trace_file={tuning.trace_file}")
    if tuning.yield_after_ack is not None:
        parts.append(f"yield_after_ack={'on' if tuning.yield_after_ack else 'off'}")
    if tuning.kernel_syncs != DEFAULT.kernel_syncs:
        parts.append(f"kernel_syncs={'on' if tuning.kernel_syncs else 'off'}")
    if tuning.journal_segment_bytes is not None:
        parts.append(f"journal_segment_bytes={tuning.journal_segment_bytes}")
    if tuning.hold_followers_ms is not None:
        parts.append(f"hold_followers_ms={tuning.hold_followers_ms:g}")
    if tuning.journal_resident_bytes is not None:
        parts.append(f"journal_resident_bytes={tuning.journal_resident_bytes}")
    return ",".join(parts)


def _number(key: str, value: str, kind: type[_Number]) -> _Number:
    try:
        return kind(value)
    except ValueError:
        _refuse(key, value, f"not {'an integer' if kind is int else 'a number'}")


def _ranged(
    values: Mapping[str, str], key: str, kind: type[_Number], bounds: tuple[_Number, _Number]
) -> _Number | None:
    """The knob `key` as a number within `bounds` (inclusive), or None when not given."""
    if key not in values:
        return None
    number = _number(key, values[key], kind)
    low, high = bounds
    if not low <= number <= high:
        _refuse(key, values[key], f"must be {low}..{high}")
    return number


def _switch(key: str, value: str) -> bool:
    if value not in _SWITCHES:
        _refuse(key, value, "must be on or off")
    return _SWITCHES[value]


def _refuse(key: str, value: str, reason: str) -> NoReturn:
    raise ConfigError(f"environment {ENVIRONMENT_VARIABLE}", key, value, reason)
