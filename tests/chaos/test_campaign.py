"""The fault campaign, short (2 rounds per class) for CI; see tests/chaos/campaign.py.

python -m pytest tests/chaos/test_campaign.py --chaos-seed 7        # replay a seed
python -m tests.chaos.run campaign --rounds 20 --nodes 3 5          # the long run
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.campaign import FaultClass, run_campaign

pytestmark = pytest.mark.cluster

CI_ROUNDS = 2

FLIP_SEGMENT_FAILS = (
    "a flipped byte in a data segment (payload or header): the node moves the table aside "
    "('corrupt data files ... moved_to=<table>.corrupt-<ms>') and catches it up from a peer, "
    "but within ~20 rounds a catch-up thread dies (AssertionError 'peer ... sent offset N, "
    "expected M' with N < M) or the tick fails ('failed _onTick', AssertionError (lsn, "
    "lsn_applied) in _finish_catch_up); the group then stays catching_up for good ('Failed to "
    "store full dump' every tick) and its replicas never apply the barrier"
)
FLIP_CHECKPOINT_FAILS = (
    "a flipped byte in the group checkpoint: 'cannot load checkpoint ...; stopping' "
    "(CorruptionError 'frame body crc ... != header ...'), exit 71 after NODE READY, on every "
    "restart; the checkpoint is not rebuilt from the peers"
)
FLIP_JOURNAL_FAILS = (
    "a flipped byte in raft.journal: the node does not start (exit 1, CorruptionError 'crc "
    "mismatch ...; entry N was fdatasynced ... so this is no torn write'), on every restart"
)
DISK_FULL_FAILS = (
    "a full data disk: 'apply failed; stopping the node' with OSError ENOSPC, exit 70, "
    "instead of stalling the group replica until space is freed"
)
MIX_FAILS = "the mix draws the failing classes: " + "; ".join(
    (FLIP_SEGMENT_FAILS, FLIP_CHECKPOINT_FAILS, FLIP_JOURNAL_FAILS, DISK_FULL_FAILS)
)

CASES = [
    pytest.param(FaultClass.KILL_RANDOM, 3, id="kill-random-3"),
    pytest.param(FaultClass.KILL_LEADER, 3, id="kill-leader-3"),
    pytest.param(FaultClass.KILL_TWO, 5, id="kill-two-5"),
    pytest.param(FaultClass.STOP_LEADER, 3, id="stop-leader-3"),
    pytest.param(FaultClass.STOP_FOLLOWER, 3, id="stop-follower-3"),
    pytest.param(
        FaultClass.FLIP_DATA,
        3,
        id="flip-data-3",
    ),
    pytest.param(
        FaultClass.FLIP_HEADER,
        3,
        id="flip-header-3",
    ),
    pytest.param(
        FaultClass.FLIP_CHECKPOINT,
        3,
        id="flip-checkpoint-3",
    ),
    pytest.param(
        FaultClass.FLIP_JOURNAL,
        3,
        id="flip-journal-3",
    ),
    pytest.param(
        FaultClass.DISK_FULL_LEADER,
        3,
        id="disk-full-leader-3",
    ),
    pytest.param(
        FaultClass.DISK_FULL_FOLLOWER,
        3,
        id="disk-full-follower-3",
    ),
    pytest.param(
        FaultClass.MIX,
        5,
        id="mix-5",
    ),
]


@pytest.mark.parametrize(("fault", "nodes"), CASES)
def test_fault_class_keeps_every_acknowledged_row_and_every_node(
    fault: FaultClass, nodes: int, chaos_seed: int, tmp_path: Path, tmpfs_refusal: str | None
) -> None:
    if fault.needs_disks and tmpfs_refusal is not None:
        pytest.skip(tmpfs_refusal)
    result = run_campaign(
        fault,
        nodes=nodes,
        rounds=CI_ROUNDS,
        seed=chaos_seed,
        root=tmp_path,
        disks=tmpfs_refusal is None,
    )
    print(result.report)
    assert result.passed, (
        f"{result.report}\n\nreproduce: python -m pytest '{__file__}::"
        f"test_fault_class_keeps_every_acknowledged_row_and_every_node[{fault.value}-{nodes}]' "
        f"--chaos-seed {chaos_seed}"
    )
