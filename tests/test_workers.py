"""Port bands (deploy/ports.py) and the suite's split over two xdist workers (tests/workers.py)."""

from __future__ import annotations

import fcntl
import socket
import threading
from pathlib import Path

import pytest

from deploy import ports
from tests import workers
from tests.harness import wait_until

REPO = Path(__file__).resolve().parents[1]


def _own_band(size: int) -> range:
    """`size` ports of this worker's own band (under xdist the other worker's clusters
    take ports from theirs), else of the first worker's."""
    band = ports.band_from_environment() or workers.port_band(0, 2)
    return range(band.start, band.start + size)


@pytest.mark.unit
def test_ports_come_from_the_band_the_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    band = _own_band(100)
    monkeypatch.setenv(ports.PORT_BAND_VARIABLE, f"{band.start}-{band.stop - 1}")
    assert ports.band_from_environment() == band
    for _ in range(20):
        picked = ports.free_ports(5)
        assert len(set(picked)) == 5
        assert all(port in band for port in picked)


@pytest.mark.unit
def test_without_a_band_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ports.PORT_BAND_VARIABLE, raising=False)
    assert ports.band_from_environment() is None
    picked = ports.free_ports(4)
    assert len(set(picked)) == 4


@pytest.mark.unit
@pytest.mark.parametrize("text", ["21000", "x-y", "21100-21000", "80-90", "60000-70000", "1-"])
def test_a_bad_band_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv(ports.PORT_BAND_VARIABLE, text)
    with pytest.raises(ValueError, match=ports.PORT_BAND_VARIABLE):
        ports.free_ports(1)


@pytest.mark.unit
def test_a_port_in_use_or_excluded_is_never_picked_and_a_full_band_is_an_error() -> None:
    (base,) = ports.free_ports(1, band=_own_band(500))
    band = range(base, base + 3)
    with socket.socket() as held:
        held.bind(("127.0.0.1", base))  # in use on the host
        for _ in range(20):
            assert sorted(ports.free_ports(1, band=band, exclude={base + 1})) == [base + 2]
        with pytest.raises(ports.PortsUnavailable) as raised:
            ports.free_ports(3, band=band)
    assert raised.value.count == 3
    assert raised.value.band == band
    assert f"{base}-{base + 2}" in str(raised.value)


@pytest.mark.unit
def test_a_port_handed_out_lately_is_not_handed_out_again_while_the_band_has_others() -> None:
    """Picked ports are bound seconds later: a pick meanwhile must not hand them out again
    (a cluster's cfg and the metrics ports added to it once named one port twice)."""
    whole = _own_band(3000)
    band = range(whole.start + 1000, whole.stop)  # more ports than the recent ones kept
    first = ports.free_ports(20, band=band)  # released: free on the host again
    second = ports.free_ports(20, band=band)
    assert not set(first) & set(second)
    small = range(whole.start + 500, whole.start + 503)
    assert sorted(ports.free_ports(3, band=small)) == list(small)
    assert sorted(ports.free_ports(3, band=small)) == list(small)  # all recent: reused


@pytest.mark.unit
def test_worker_bands_are_disjoint_and_below_the_ephemeral_range() -> None:
    first, second = workers.port_band(0, 2), workers.port_band(1, 2)
    assert first.stop <= second.start
    assert first.start >= 1024
    assert second.stop <= 32768  # Linux's default ip_local_port_range starts at 32768
    assert len(first) == len(second) > 6000


@pytest.mark.unit
def test_every_file_and_test_named_for_the_workers_exists() -> None:
    """A renamed file or test would silently lose its place in the plan."""
    for path in workers.HEAVY_FILES | workers.ALONE_FILES:
        assert (REPO / path).is_file(), path
    for name in workers.ALONE_TESTS:
        path, _, test = name.partition("::")
        assert f"def {test}(" in (REPO / path).read_text(), name


@pytest.mark.unit
def test_groups_and_tests_that_run_alone() -> None:
    assert workers.group_of("tests/chaos/test_campaign.py::test_class[kill]") == "heavy-chaos"
    assert workers.group_of("tests/test_bench_vs_nats.py::test_x") == "heavy-chaos"
    assert workers.group_of("tests/spark/test_spark.py::test_write") == "heavy-spark"
    assert workers.group_of("tests/test_docker.py::test_up") == "tests/test_docker.py"
    assert workers.group_of("tests/test_tls.py::TestX::test_y") == "tests/test_tls.py"
    assert workers.runs_alone("tests/test_ops_cluster.py", "test_anything[param]")
    name = next(iter(workers.ALONE_TESTS))
    path, _, test = name.partition("::")
    assert workers.runs_alone(path, test)
    assert workers.runs_alone(path, f"{test}[3]")
    assert not workers.runs_alone(path, "test_some_other")


@pytest.mark.unit
def test_the_heavy_groups_are_handed_out_first_then_xdists_order() -> None:
    queue = workers.HeavyFirst()
    for group in ("tests/test_config.py", "heavy-spark", "tests/test_tls.py", "heavy-chaos"):
        queue[group] = {f"{group}::test": False}
    taken = [queue.popitem(last=False)[0] for _ in range(len(queue))]
    assert taken == ["heavy-chaos", "heavy-spark", "tests/test_config.py", "tests/test_tls.py"]
    assert set(workers.HEAVY_GROUPS) == {
        workers.group_of("tests/chaos/test_campaign.py::t"),
        workers.group_of("tests/spark/test_spark.py::t"),
    }


@pytest.mark.unit
def test_a_test_that_runs_alone_waits_for_the_one_beside_it_and_holds_back_the_next(
    tmp_path: Path,
) -> None:
    events: list[str] = []
    beside_started, alone_waiting, release_beside = (threading.Event() for _ in range(3))

    def beside() -> None:
        with workers.alone_lock(tmp_path, alone=False):
            events.append("beside")
            beside_started.set()
            release_beside.wait(10)
            events.append("beside done")  # still holding the lock

    def alone() -> None:
        alone_waiting.set()
        with workers.alone_lock(tmp_path, alone=True):
            events.append("alone")

    def next_beside() -> None:
        with workers.alone_lock(tmp_path, alone=False):
            events.append("next")

    first = threading.Thread(target=beside)
    first.start()
    assert beside_started.wait(10)
    second = threading.Thread(target=alone)
    second.start()
    assert alone_waiting.wait(10)
    _wait_for_gate_held(tmp_path)  # the alone test is queued at the gate
    third = threading.Thread(target=next_beside)
    third.start()
    release_beside.set()
    for thread in (first, second, third):
        thread.join(10)
        assert not thread.is_alive()
    assert events.index("alone") > events.index("beside done")
    assert events.index("next") > events.index("alone")


def _wait_for_gate_held(directory: Path) -> None:
    """Until another holder has the gate (a non-blocking try fails)."""

    def held() -> bool:
        with open(directory / "alone.gate", "a") as gate:
            try:
                fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(gate, fcntl.LOCK_UN)
            return False

    wait_until(held, timeout_s=10, interval_s=0.01, message="the alone test takes the gate")
