"""bench.thread_costs: every thread's CPU and context switches per append, on a real cluster,
and the pieces it is made of (its reading of /proc and of `py-spy dump`)."""

from __future__ import annotations

import os
import re
import tempfile
import threading
from pathlib import Path

import pytest

from bench import common, thread_costs
from bench.common import ThreadCounters

_DUMP = """Process 7233: /usr/bin/python -m raftstore --config cluster.cfg --node node1
Python v3.11.7 (/usr/bin/python3.11)

Thread 7233 (idle): "MainThread"
    wait (threading.py:327)
Thread 0x1C5F (active+gil): "Thread-1 (_autoTickThread)"
    _onTick (raftstore/replication.py:197)
Thread 7299 (idle): "grpc_0"
"""


def test_py_spy_dump_thread_lines_give_each_tid_its_name() -> None:
    assert thread_costs.parse_dump(_DUMP) == {
        7233: "MainThread",
        0x1C5F: "Thread-1 (_autoTickThread)",
        7299: "grpc_0",
    }


def test_this_process_threads_are_sampled_and_named() -> None:
    spinning = threading.Event()
    stop = threading.Event()

    def spin() -> None:
        spinning.set()
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, name="spinner")
    before = common.thread_counters(os.getpid())
    worker.start()
    try:
        assert spinning.wait(10)
        spent_s = 0.05
        while True:  # bounded by the thread's CPU growing; the test timeout backs it
            after = common.thread_counters(os.getpid())
            if worker.native_id in after and after[worker.native_id].cpu_s >= spent_s:
                break
        names = {**thread_costs.os_thread_names(os.getpid()), **thread_costs.own_thread_names()}
    finally:
        stop.set()
        worker.join()
    costs = thread_costs.costs("client", before, after, names, appends=10)
    spinner = next(cost for cost in costs if cost.thread == "spinner")
    assert spinner.cpu_us >= spent_s / 10 * 1e6  # started in between: counted from zero
    assert names[threading.main_thread().native_id or 0] == "MainThread"


def test_costs_are_per_append_and_sorted_by_cpu() -> None:
    before = {1: ThreadCounters(1.0, 10), 2: ThreadCounters(0.0, 0)}
    after = {1: ThreadCounters(1.5, 30), 2: ThreadCounters(2.0, 40), 3: ThreadCounters(0.1, 1)}
    costs = thread_costs.costs("leader node1", before, after, {1: "tick", 2: "grpc_0"}, 100)
    assert [(cost.thread, cost.cpu_us, cost.switches) for cost in costs] == [
        ("grpc_0", pytest.approx(20_000), 0.4),
        ("tick", pytest.approx(5_000), 0.2),
        ("tid 3", pytest.approx(1_000), 0.01),
    ]


@pytest.mark.cluster
@pytest.mark.parametrize("shape", ["wait:1", "async:100"])
def test_a_cell_prints_every_process_and_its_threads(
    shape: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "clusters"))
    (tmp_path / "clusters").mkdir()
    out_file = tmp_path / "costs.md"
    assert (
        thread_costs.main(["--shape", shape, "--seconds", "0.5", "--markdown", str(out_file)]) == 0
    )
    assert list((tmp_path / "clusters").iterdir()) == []  # the cluster's directory is gone
    out = capsys.readouterr().out
    assert out_file.read_text().endswith(out)
    assert re.search(rf"^shape {shape}: [0-9,]+ appends, [0-9,]+ rows/s", out, re.MULTILINE)
    totals = re.findall(
        r"^\| \*\*(leader|follower|client)[^|]*\*\* \| \*\*all (\d+) threads", out, re.MULTILINE
    )
    assert [role for role, _ in totals] == ["leader", "follower", "follower", "client"], out
    # The Raft thread is named as py-spy sees it (or by its OS name without py-spy).
    assert re.search(
        r"^\| leader \w+ \| (Thread-\d+ \(_autoTickThread\)|python) \| [0-9,]+ \|",
        out,
        re.MULTILINE,
    ), out
    assert re.search(r"^\| client \| MainThread \| [0-9,]+ \| [0-9.]+ \|", out, re.MULTILINE), out
