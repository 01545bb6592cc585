"""The seeded randomised real-cluster test, bounded for CI (see tests/chaos/randomized.py).

python -m pytest tests/chaos/test_randomized.py --chaos-seed 7    # replay a seed
python -m tests.chaos.run random --minutes 30 --seed 7            # the long version
python -m tests.chaos.run random --minutes 30 --seed 7 --purge-interval 600 --resident-bytes 262144
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.randomized import RandomResult, run_random

pytestmark = pytest.mark.cluster

CI_DURATION_S = 60.0
# The long-log mode: checkpoints only when the Raft log reaches its size limit, and journals
# that hold 256 KiB of commands in memory, so restarts replay logs of many MB and lagging
# followers are sent entries read back from the journal files (the space where a replay
# that re-read its whole backlog on every tick hid from the default mode's 1-5 s
# checkpoints). Shorter than the default mode's run: the suite's time is shared.
LONG_LOG_DURATION_S = 40.0
LONG_LOG_PURGE_INTERVAL_S = 600.0
LONG_LOG_RESIDENT_BYTES = 256 * 1024


def test_random_faults_under_random_load_keep_every_acknowledged_row(
    chaos_seed: int, tmp_path: Path, tmpfs_refusal: str | None
) -> None:
    result = run_random(
        chaos_seed, duration_s=CI_DURATION_S, root=tmp_path, disks=tmpfs_refusal is None
    )
    _assert_passed(result, chaos_seed, "under_random_load")


def test_random_faults_over_long_logs_read_back_keep_every_acknowledged_row(
    chaos_seed: int, tmp_path: Path, tmpfs_refusal: str | None
) -> None:
    result = run_random(
        chaos_seed,
        duration_s=LONG_LOG_DURATION_S,
        root=tmp_path,
        disks=tmpfs_refusal is None,
        purge_interval_s=LONG_LOG_PURGE_INTERVAL_S,
        journal_resident_bytes=LONG_LOG_RESIDENT_BYTES,
    )
    _assert_passed(result, chaos_seed, "long_logs")


def _assert_passed(result: RandomResult, chaos_seed: int, selector: str) -> None:
    print(result.report)
    assert result.passed, (
        f"{result.report}\n\nreproduce: python -m pytest {__file__} --chaos-seed {chaos_seed}"
        f" -k {selector}"
    )
