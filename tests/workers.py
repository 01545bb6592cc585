"""How the suite is split over two pytest-xdist workers (tests/conftest.py applies it).

The suite waits on clusters, Spark and Docker far more than it computes (run serially it
used a quarter of two cores), so two workers run it side by side. What must not meet:
- ports: each worker picks its clusters' ports from its own band below the kernel's
  ephemeral range (deploy/ports.py), so a port a killed node released is never handed to the
  other worker's cluster;
- the heavy, machine-filling tests: two groups, each run one after another on one worker
  and both handed out first, so that each starts at once on a worker of its own: chaos
  (with `deploy.local`'s security and the benchmarks that sample the whole machine) and
  Spark. They may run beside each other: the one chaos test a Spark job once pushed past
  its deadline runs alone (ALONE_TESTS);
- a module's tests share its module-scoped cluster: every other file is a group of its own
  (test_docker.py's among them: one worker builds the images);
- the tests that bound a stall on a real cluster to a second or two run with nothing beside
  them: the other worker waits (`alone_lock`).
The groups reach xdist through `Scheduler` (its loadscope scheduler, with these groups as
the scopes). xdist's own `--dist loadgroup` cannot carry them: under pytest 9 the test ids it
rewrites to mark a group (`item._nodeid`) are no longer what pytest reports.
"""

from __future__ import annotations

import collections
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import pytest

PORT_BANDS: Final = range(20000, 32768)  # below 32768, the start of Linux's ephemeral range

HEAVY_FILES: Final = frozenset(
    {
        "tests/chaos/test_regressions.py",
        "tests/chaos/test_campaign.py",
        "tests/chaos/test_randomized.py",
        "tests/test_deploy_local_security.py",
        "tests/test_bench_sched_wakeups.py",  # `perf record -a`: the whole machine
        "tests/test_bench_checkouts_ab.py",
        "tests/test_bench_vs_nats.py",
    }
)
SPARK_DIRECTORY: Final = "tests/spark/"
CHAOS_GROUP: Final = "heavy-chaos"  # HEAVY_FILES
SPARK_GROUP: Final = "heavy-spark"  # SPARK_DIRECTORY
# The heavy groups, in the order they are handed out (before every other group).
HEAVY_GROUPS: Final = (CHAOS_GROUP, SPARK_GROUP)
ALONE_FILES: Final = frozenset(
    {
        "tests/test_ops_cluster.py",  # acknowledgement gaps < 1 s through transfers
        "tests/test_rolling_restart.py",  # acknowledgement gap < 1 s
        "tests/test_pacing_cluster.py",  # gap < 1 s, no election
        "tests/test_partition_cluster.py",  # publishes resume <= 2 s; its subnets are Docker's
        "tests/test_cluster.py",  # checkpoints counted in 7 s; no election in a 3 s freeze
        "tests/test_peer_links.py",  # 0.5 s election timeout
    }
)
ALONE_TESTS: Final = frozenset(
    {
        # Twelve graceful restarts inside the client's deadline: once outlasted it beside a
        # Spark job.
        "tests/chaos/test_regressions.py::"
        "test_publishers_ride_through_graceful_restarts_of_the_leader",
    }
)


def this_worker() -> tuple[int, int] | None:
    """(this worker's index, the number of workers), or None when not an xdist worker."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not name.startswith("gw"):
        return None
    return int(name[2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def port_band(index: int, count: int) -> range:
    """Worker `index`'s share of PORT_BANDS."""
    size = len(PORT_BANDS) // max(count, 1)
    return range(PORT_BANDS.start + index * size, PORT_BANDS.start + (index + 1) * size)


def group_of(nodeid: str) -> str:
    """The group of the test `nodeid` (its path relative to the repo, then `::`...)."""
    path = nodeid.partition("::")[0]
    if path.startswith(SPARK_DIRECTORY):
        return SPARK_GROUP
    if path in HEAVY_FILES:
        return CHAOS_GROUP
    return path


class HeavyFirst(collections.OrderedDict[str, Any]):
    """xdist's queue of groups (scope -> its tests), from which it takes the next group
    with `popitem(last=False)`: the heavy groups come out first, the rest in xdist's own
    order (the groups of the most tests first). The heavy groups take the longest; handed
    out late they would run on past every other test."""

    def popitem(self, last: bool = True) -> tuple[str, Any]:
        if not last:
            for group in HEAVY_GROUPS:
                if group in self:
                    return group, self.pop(group)
        return super().popitem(last=last)


class Scheduler:
    """The xdist plugin that hands whole groups to the workers: the heavy groups first, one
    to each worker, then the groups of the most tests first."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        from xdist.scheduler import LoadScopeScheduling

        class _Groups(LoadScopeScheduling):  # type: ignore[misc]
            def __init__(self, config: pytest.Config, log: Any) -> None:
                super().__init__(config, log)
                self.workqueue = HeavyFirst()

            def _split_scope(self, nodeid: str) -> str:
                return group_of(nodeid)

        return _Groups(config, log)


def runs_alone(path: str, name: str) -> bool:
    """Whether the test `name` (pytest's item name, with parameters) in `path` must run with
    no other test beside it."""
    return path in ALONE_FILES or f"{path}::{name.partition('[')[0]}" in ALONE_TESTS


@contextmanager
def alone_lock(directory: Path, *, alone: bool) -> Iterator[None]:
    """Held around a test: shared by every test, exclusive for one that must run alone.
    A test waiting to run alone holds the gate, so that the other worker starts no new test
    meanwhile (flock alone would let a stream of shared holders starve it)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "alone.gate", "a") as gate, open(directory / "alone.lock", "a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
