"""bench.func_costs: calls and CPU of chosen functions inside the nodes of a real cluster,
and its parts (the node-side wrapping and request files, the per-append arithmetic)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import func_costs, func_costs_node

TARGET = f"{__name__}:_Target.work"


class _Target:
    def work(self, spin_s: float) -> str:
        deadline = time.thread_time() + spin_s
        while time.thread_time() < deadline:
            pass
        return "done"


@pytest.fixture
def restored() -> Iterator[None]:
    """The test's own method, which `wrap` replaces for real, is put back after the test."""
    work = _Target.__dict__["work"]
    yield
    _Target.work = work  # type: ignore[method-assign]


@pytest.mark.usefixtures("restored")
def test_a_wrapped_method_counts_its_calls_and_thread_cpu() -> None:
    counter = func_costs_node.wrap(TARGET)
    target = _Target()
    assert target.work(0.01) == "done"
    assert target.work(0.0) == "done"
    assert counter.calls == 2
    assert counter.ns >= 10_000_000  # the first call spun 10 ms of this thread's CPU
    assert _Target.work.__name__ == "work"  # functools.wraps: names stay readable


@pytest.mark.parametrize(
    "target",
    [f"{__name__}:_Target.absent", "no_such_module_here:f", "no-colon", f"{__name__}:_Target"],
)
def test_a_target_that_is_not_a_function_is_refused(target: str) -> None:
    with pytest.raises((AttributeError, ImportError, ValueError)):
        func_costs_node.wrap(target)


@pytest.mark.usefixtures("restored")
def test_the_watcher_wraps_at_its_first_request_and_reports_each_one(tmp_path: Path) -> None:
    missing = f"{__name__}:_Target.absent"
    watcher = func_costs_node._Watcher(tmp_path, [TARGET, missing])
    watcher._answer(1)
    _Target().work(0.0)
    watcher._answer(2)
    first, second = (json.loads((tmp_path / f"{os.getpid()}-{n}.json").read_text()) for n in (1, 2))
    assert first["functions"][TARGET] == [0, 0]  # wrapped at the first request: nothing yet
    assert second["functions"][TARGET][0] == 1
    assert set(second["missing"]) == {missing}
    assert not list(tmp_path.glob("*.part"))


def test_costs_are_per_append() -> None:
    before = {"functions": {"a": [10, 5_000], "b": [0, 0]}, "missing": {}}
    after = {"functions": {"a": [30, 45_000], "b": [0, 0]}, "missing": {"c": "gone"}}
    costs = func_costs.node_costs("leader node1", before, after, cpu_s=0.01, appends=10)
    assert costs.cpu_us == pytest.approx(1_000)
    a, b = costs.functions
    assert (a.calls, a.cpu_us, a.us_per_call) == (2.0, pytest.approx(4.0), pytest.approx(2.0))
    assert (b.calls, b.us_per_call) == (0.0, 0.0)
    assert costs.missing == {"c": "gone"}


@pytest.mark.cluster
def test_a_cell_reports_the_write_path_of_each_node(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "scratch").mkdir()
    out_file = tmp_path / "costs.md"
    argv = ["--shape", "wait:1", "--seconds", "0.5", "--markdown", str(out_file)]
    argv += ["--scratch", str(tmp_path / "scratch")]
    assert func_costs.main(argv) == 0
    assert list((tmp_path / "scratch").iterdir()) == []  # the cluster and request files went
    out = capsys.readouterr().out
    assert out_file.read_text().endswith(out)
    assert re.search(r"^shape wait:1: [0-9,]+ appends, [0-9,]+ rows/s", out, re.MULTILINE)
    headings = re.findall(r"^## (leader|follower) node\d: [0-9,]+ us of CPU", out, re.MULTILINE)
    assert headings == ["leader", "follower", "follower"], out
    # Every node's Raft tick ran, and only the leader validated publishes.
    ticks = re.findall(r"^\| `raftstore.replication:_SyncObj._tick` \| ([0-9.]+) \|", out, re.M)
    assert len(ticks) == 3, out
    assert all(float(calls) > 0 for calls in ticks), out
    validated = re.findall(r"GroupStateMachine.validate_publish` \| ([0-9.]+) \|", out)
    assert [float(calls) for calls in validated] == [1.0], out
