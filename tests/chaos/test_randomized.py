"""The seeded randomised real-cluster test, bounded for CI (see tests/chaos/randomized.py).

python -m pytest tests/chaos/test_randomized.py --chaos-seed 7    # replay a seed
python -m tests.chaos.run random --minutes 30 --seed 7            # the long version
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.randomized import run_random

pytestmark = pytest.mark.cluster

CI_DURATION_S = 60.0


def test_random_faults_under_random_load_keep_every_acknowledged_row(
    chaos_seed: int, tmp_path: Path, tmpfs_refusal: str | None
) -> None:
    result = run_random(
        chaos_seed, duration_s=CI_DURATION_S, root=tmp_path, disks=tmpfs_refusal is None
    )
    print(result.report)
    assert result.passed, (
        f"{result.report}\n\nreproduce: python -m pytest {__file__} --chaos-seed {chaos_seed}"
    )
