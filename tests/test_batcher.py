"""Group commit (raftstore/batcher.py): packing, in-flight slots, and what a step-down fails."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from hastream.errors import LeadershipLost, Overloaded, RaftStoreError
from raftstore import commands, limits
from raftstore.batcher import Batcher
from raftstore.threads import Threads
from tests.harness import wait_until

pytestmark = pytest.mark.unit

Callback = Callable[[Any, RaftStoreError | None], None]


class HeldProposals:
    """A propose() that records what it is given and answers only when told to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proposed: list[tuple[commands.Append, Callback]] = []

    def __call__(self, command: bytes, callback: Callback) -> None:
        decoded = commands.decode(command)
        assert isinstance(decoded, commands.Append)
        with self.lock:
            self.proposed.append((decoded, callback))

    def count(self) -> int:
        with self.lock:
            return len(self.proposed)


def _item(sequence: int) -> commands.AppendItem:
    return commands.AppendItem(
        table="t", producer_id=b"p" * 16, sequence=sequence, payload=b"x" * 10
    )


def test_step_down_fails_in_flight_and_queued_publishes_and_proposes_none_later() -> None:
    proposals = HeldProposals()
    batcher = Batcher(2, proposals, spawn=Threads().start, in_flight_max=1)
    try:
        first = batcher.submit(_item(1))
        wait_until(lambda: proposals.count() == 1, timeout_s=5)
        queued = batcher.submit_many([_item(2), _item(3)])  # the only slot is taken
        assert batcher.queue_depth == 2

        batcher.fail_in_flight(LeadershipLost("stepped down"))

        for future in (first, *queued):
            assert isinstance(future.exception(timeout=5), LeadershipLost)
        assert batcher.queue_depth == 0
        # The slot frees when the old proposal is answered; nothing queued is proposed then.
        _, callback = proposals.proposed[0]
        callback(None, LeadershipLost("stepped down"))
        later = batcher.submit(_item(4))
        wait_until(lambda: proposals.count() == 2, timeout_s=5)
        sequences = [item.sequence for item in proposals.proposed[1][0].items]
        assert sequences == [4]
        assert not later.done()
    finally:
        batcher.close()


def test_the_queue_refuses_payload_bytes_past_its_bound() -> None:
    held = HeldProposals()
    batcher = Batcher(2, held, spawn=Threads().start)
    try:
        big = commands.AppendItem(
            table="t", producer_id=b"", sequence=0, payload=b"x" * limits.BATCH_BYTES_MAX
        )
        # Hold every in-flight slot so that submitted items stay queued.
        fill = limits.PUBLISH_QUEUE_BYTES_MAX // limits.BATCH_BYTES_MAX
        refused: Overloaded | None = None
        accepted = 0
        for _ in range(fill + limits.PROPOSALS_IN_FLIGHT_MAX + 2):
            try:
                batcher.submit(big)
            except Overloaded as error:
                refused = error
                break
            accepted += 1
        assert refused is not None
        assert refused.queue == "publish bytes"
        assert refused.limit == limits.PUBLISH_QUEUE_BYTES_MAX
        assert accepted >= fill
    finally:
        batcher.close()


def test_in_flight_max_never_exceeds_the_limit_buffers_were_sized_by() -> None:
    # raftstore/tuning.py may lower it for an A/B run; limits.py sized the Raft send buffer
    # cap by PROPOSALS_IN_FLIGHT_MAX, so nothing may raise it.
    for bad in (0, limits.PROPOSALS_IN_FLIGHT_MAX + 1):
        with pytest.raises(ValueError, match="in_flight_max"):
            Batcher(2, HeldProposals(), spawn=Threads().start, in_flight_max=bad)
