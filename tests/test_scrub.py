"""The online scrub (raftstore/scrub.py) on a real group's files (tests/shell.py): it finds
a flipped byte and the table is repaired from a peer, and it stays under its share of a
core however small the records are."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raftstore.scrub import Pace, Scrubber
from tests.chaos.faults import flip_segment_payload
from tests.harness import wait_until
from tests.shell import Shell, fetch_from
from tests.test_shell import PEER, SCHEMA, keys, rows, table_dir

pytestmark = pytest.mark.storage


@contextmanager
def scrubbing(scrubber: Scrubber) -> Iterator[Scrubber]:
    stopping = threading.Event()
    thread = threading.Thread(target=scrubber.run, args=(stopping,), name="scrub")
    thread.start()
    try:
        yield scrubber
    finally:
        stopping.set()
        thread.join(10)
        assert not thread.is_alive()


def test_the_scrub_finds_a_flipped_byte_and_the_table_is_repaired_from_a_peer(
    tmp_path: Path,
) -> None:
    healthy = Shell(tmp_path / "healthy").start()
    healthy.create("t", SCHEMA)
    damaged = Shell(tmp_path / "damaged", fetch=fetch_from({PEER: healthy}), peers=[PEER])
    damaged.start()
    damaged.create("t", SCHEMA)
    for first in range(0, 300, 100):
        healthy.publish("t", rows(first, 100))
        damaged.publish("t", rows(first, 100))
    flip = flip_segment_payload(random.Random(7), sorted(table_dir(damaged, "t").glob("seg-*.dat")))
    assert flip is not None
    scrubber = Scrubber(lambda: [damaged.g], rate_mb_s=100, pause_s=0.01)
    with scrubbing(scrubber):
        wait_until(lambda: scrubber.status()["findings"], timeout_s=20, message="scrub finding")
        wait_until(
            lambda: damaged.g.status()["repairs_completed"] == 1,
            timeout_s=20,
            message="repaired from the peer",
        )
    # Passes this close together may find it again before the apply thread moves it aside.
    findings = scrubber.status()["findings"]
    assert findings
    assert all(f["table"] == "t" and flip.path.name in f["detail"] for f in findings)
    assert keys(damaged, "t") == list(range(300))
    healthy.stop()
    damaged.stop()


def test_a_table_of_small_records_is_scrubbed_within_its_share_of_a_core(tmp_path: Path) -> None:
    # One-row records cost the scrub Python work per record, not per byte: at 8 MB/s alone
    # it would read ~50,000 of them per second, most of a core.
    shell = Shell(tmp_path).start()
    shell.create("t", SCHEMA)
    records = 1500
    for key in range(records):
        shell.publish("t", rows(key, 1))
    share = 0.05
    scrubber = Scrubber(lambda: [shell.g], rate_mb_s=10_000, pause_s=0, cpu_share=share)
    with scrubbing(scrubber):
        wait_until(lambda: scrubber.passes >= 1, timeout_s=60, message="first pass")
        first_passes, first_cpu_s, started = scrubber.passes, scrubber.cpu_s, time.monotonic()
        wait_until(
            lambda: scrubber.passes >= first_passes + 2, timeout_s=60, message="two more passes"
        )
        passes, cpu_s, wall_s = scrubber.passes, scrubber.cpu_s, time.monotonic() - started
    assert scrubber.records_verified >= records * passes
    assert cpu_s > first_cpu_s
    # Each pass ends with fewer than one look's records unpaced: a little over the share.
    assert (cpu_s - first_cpu_s) / wall_s <= share * 1.5, (cpu_s - first_cpu_s, wall_s)
    shell.stop()


@given(
    rate=st.floats(1e3, 1e10),
    share=st.floats(0.001, 1.0),
    read=st.integers(0, 1 << 40),
    cpu_s=st.floats(0, 1e4),
    elapsed_s=st.floats(0, 1e5),
)
def test_the_pace_waits_just_long_enough_for_both_bounds(
    rate: float, share: float, read: int, cpu_s: float, elapsed_s: float
) -> None:
    pace = Pace(rate, share)
    wait_s = pace.wait_s(read, cpu_s, elapsed_s)
    assert wait_s >= 0
    total_s = elapsed_s + wait_s
    tolerance = 1e-9 * max(1.0, total_s)
    assert read / rate <= total_s + tolerance
    assert cpu_s / share <= total_s + tolerance
    if wait_s > 0:  # not a moment longer than the tighter bound needs
        assert max(read / rate, cpu_s / share) == pytest.approx(total_s)
