"""Group commit (raftstore/batcher.py): packing, in-flight slots, and what a step-down fails."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from hastream.errors import LeadershipLost, Overloaded, ProposalTimeout, RaftStoreError
from raftstore import commands, limits
from raftstore.batcher import Batcher
from raftstore.replica import CommandBytes, join_command
from raftstore.state_machine import AppendResult, ItemResult
from raftstore.threads import Threads
from tests.harness import wait_until

pytestmark = pytest.mark.unit

Callback = Callable[[Any, RaftStoreError | None], None]


class HeldProposals:
    """A propose() that records what it is given and answers only when told to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proposed: list[tuple[commands.Append, Callback]] = []

    def __call__(self, command: CommandBytes, callback: Callback) -> None:
        decoded = commands.decode(join_command(command))
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


def test_a_proposal_never_called_back_fails_its_publishes_at_its_deadline() -> None:
    """pysyncobj never calls back for entries a snapshot install wiped out: at the deadline
    the publishes fail with ProposalTimeout, with nothing else queued to look at the slot
    (a deferred unary answer waits for exactly this future), and the slot is free again."""
    proposals = HeldProposals()
    batcher = Batcher(2, proposals, spawn=Threads().start, in_flight_max=1, proposal_timeout_s=0.3)
    try:
        lost = batcher.submit_many([_item(1), _item(2)])
        for future in lost:
            error = future.exception(timeout=10)
            assert isinstance(error, ProposalTimeout)
            assert error.timeout_s == 0.3
        later = batcher.submit(_item(3))
        assert proposals.count() == 2
        _, callback = proposals.proposed[1]
        callback(_result(7, 1), None)
        assert later.result(timeout=5)[0] == 7
    finally:
        batcher.close()


def test_close_fails_queued_and_uncommitted_publishes() -> None:
    proposals = HeldProposals()
    batcher = Batcher(2, proposals, spawn=Threads().start, in_flight_max=1)
    in_flight = batcher.submit(_item(1))
    queued = batcher.submit(_item(2))
    batcher.close()
    for future in (in_flight, queued):
        error = future.exception(timeout=5)
        assert isinstance(error, LeadershipLost)
        assert "shutting down" in str(error)


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


def test_an_idle_batcher_proposes_on_the_submitting_thread() -> None:
    # Nothing queued, nothing being sent, a slot free: the publish is proposed before
    # submit returns, by the caller, not after a hand-over to the batcher thread.
    proposals = HeldProposals()
    proposers: list[str] = []

    def propose(command: CommandBytes, callback: Callback) -> None:
        proposers.append(threading.current_thread().name)
        proposals(command, callback)

    batcher = Batcher(2, propose, spawn=Threads().start, in_flight_max=2)
    try:
        batcher.submit(_item(1))
        assert proposals.count() == 1
        assert proposers == [threading.current_thread().name]
        batcher.submit(_item(2))  # the second slot: on this thread too
        assert proposals.count() == 2
        third = batcher.submit(_item(3))  # no slot free: queued for the batcher thread
        assert proposals.count() == 2
        assert batcher.queue_depth == 1
        _, callback = proposals.proposed[0]
        callback(_result(1, 1), None)
        wait_until(lambda: proposals.count() == 3, timeout_s=5)
        assert proposers[2].startswith("batcher")
        assert not third.done()
    finally:
        batcher.close()


def test_received_payloads_are_let_go_once_their_entry_holds_a_copy() -> None:
    # A publish's payload is a view of the gRPC message it came in (publish_wire); the
    # entry copies it, and the view is released then, not when the publisher is answered:
    # the message's buffer is free (a bytearray can grow again only without exports) while
    # the entry still waits for its commit. Both proposers: the caller's thread and the
    # batcher thread (a second publish queued behind a full slot).
    proposals = HeldProposals()
    batcher = Batcher(2, proposals, spawn=Threads().start, in_flight_max=1)
    try:
        messages = [bytearray(b"y" * 10), bytearray(b"z" * 10)]
        items = [
            commands.AppendItem(
                table="t", producer_id=b"p" * 16, sequence=n + 1, payload=memoryview(message)
            )
            for n, message in enumerate(messages)
        ]
        first = batcher.submit(items[0])
        second = batcher.submit(items[1])  # no slot: the batcher thread proposes it later
        messages[0].extend(b"!")  # released: would raise BufferError while viewed
        with pytest.raises(BufferError):
            messages[1].extend(b"!")  # still queued, still viewed
        _, callback = proposals.proposed[0]
        callback(_result(1, 1), None)
        wait_until(lambda: proposals.count() == 2, timeout_s=5)
        wait_until(lambda: _grows(messages[1]), timeout_s=5)
        assert [item.payload for item, _ in _proposed_items(proposals)] == [b"y" * 10, b"z" * 10]
        assert first.done()
        assert not second.done()
    finally:
        batcher.close()


def _grows(message: bytearray) -> bool:
    try:
        message.extend(b"!")
    except BufferError:
        return False
    return True


def _proposed_items(proposals: HeldProposals) -> list[tuple[commands.AppendItem, commands.Append]]:
    return [(item, command) for command, _ in proposals.proposed for item in command.items]


def test_a_publish_waits_behind_a_proposal_being_sent_rather_than_overtake_it() -> None:
    # One thread has taken two publishes and is inside propose (a big entry's encoding,
    # Raft's queue) when the same producer's next publish arrives with nothing queued and a
    # slot free. Proposed on its caller's thread at once, it would reach Raft before the two
    # it follows.
    entered = threading.Event()
    gate = threading.Event()
    proposals = HeldProposals()

    def propose(command: CommandBytes, callback: Callback) -> None:
        if not entered.is_set():
            entered.set()
            assert gate.wait(timeout=10)
        proposals(command, callback)

    batcher = Batcher(2, propose, spawn=Threads().start)
    first = threading.Thread(target=batcher.submit_many, args=([_item(1), _item(2)],))
    try:
        first.start()  # an idle batcher: that thread proposes, and stops at the gate
        wait_until(entered.is_set, timeout_s=5)
        batcher.submit(_item(3))
        assert proposals.count() == 0
        assert batcher.queue_depth == 1
        gate.set()
        wait_until(lambda: proposals.count() == 2, timeout_s=5)
        entries = [[item.sequence for item in entry.items] for entry, _ in proposals.proposed]
        assert entries == [[1, 2], [3]]
    finally:
        gate.set()
        first.join(timeout=10)
        batcher.close()


def _result(lsn: int, items: int) -> AppendResult:
    return AppendResult(lsn, tuple(ItemResult("t", lsn, 1, 0, False, None) for _ in range(items)))


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_concurrent_submitters_are_proposed_once_each_in_their_order(seed: int) -> None:
    # Submitting threads race the batcher thread (the caller proposes when the batcher is
    # idle, the batcher thread when it is not) while a responder answers proposals at
    # random moments. Every publish is proposed exactly once and answered with its own
    # entry's result; each thread's publishes reach Raft in the order it submitted them;
    # no more proposals are in flight than the slots. The plans and the slots come from the
    # seed; the threads' interleaving is the machine's.
    rng = random.Random(seed)
    in_flight_max = rng.choice([1, 2, 8])
    spins = [rng.randint(0, 50) for _ in range(7)]
    lock = threading.Condition()
    proposed: list[tuple[commands.Append, Callback]] = []
    answered = 0
    most_in_flight = 0

    def propose(command: CommandBytes, callback: Callback) -> None:
        nonlocal most_in_flight
        decoded = commands.decode(join_command(command))
        assert isinstance(decoded, commands.Append)
        # A propose takes a while (Raft's queue, a big entry's encoding): another submitter
        # or the batcher thread gets the GIL meanwhile. Spinning, not sleeping, for it.
        for _ in range(spins[len(decoded.items) % len(spins)]):
            os.sched_yield()
        with lock:
            proposed.append((decoded, callback))
            most_in_flight = max(most_in_flight, len(proposed) - answered)
            lock.notify()

    stop = threading.Event()

    def respond() -> None:
        nonlocal answered
        responder_rng = random.Random(seed + 1000)

        def pending() -> bool:
            return len(proposed) > answered or stop.is_set()

        while not stop.is_set():
            with lock:
                lock.wait_for(pending, timeout=1)
                ready = proposed[answered:]
            if not ready:
                continue
            for entry, callback in ready[: responder_rng.randint(1, len(ready))]:
                with lock:
                    answered += 1
                    lsn = answered
                callback(_result(lsn, len(entry.items)), None)

    batcher = Batcher(2, propose, spawn=Threads().start, in_flight_max=in_flight_max)
    responder = threading.Thread(target=respond, daemon=True)
    responder.start()
    per_thread = 150
    futures: dict[int, list[Future[tuple[int, ItemResult]]]] = {}
    # Each payload is a view of a message of its own, as publish_wire hands them over; the
    # batcher releases the views once the entry is joined, whichever thread proposes.
    messages: list[bytearray] = []

    def submitter(thread: int, plan: list[tuple[int, bool]]) -> None:
        mine: list[Future[tuple[int, ItemResult]]] = []
        sequence = 0
        for size, waited in plan:
            received = [bytearray(f"{thread}:{sequence + k}".encode()) for k in range(size)]
            messages.extend(received)
            items = [
                commands.AppendItem(
                    table="t",
                    producer_id=bytes([thread]) * 16,
                    sequence=sequence + k,
                    payload=memoryview(received[k]),
                )
                for k in range(size)
            ]
            sequence += size
            mine.extend([batcher.submit(items[0])] if size == 1 else batcher.submit_many(items))
            if waited:  # a unary publisher; the others keep several in flight
                mine[-1].result(timeout=30)
        futures[thread] = mine

    # Per submitter: (items in one submit, then wait for it?) - one by one, three at once.
    plans = {
        t: [(rng.choice([1, 1, 1, 3]), rng.random() < 0.5) for _ in range(per_thread)]
        for t in range(4)
    }
    threads = [threading.Thread(target=submitter, args=(t, plans[t])) for t in plans]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        for mine in futures.values():
            for future in mine:
                lsn, result = future.result(timeout=30)
                assert result.first_offset == lsn  # its own entry's answer
    finally:
        stop.set()
        with lock:
            lock.notify()
        responder.join(timeout=5)
        batcher.close()
    seen: dict[int, list[int]] = {t: [] for t in plans}
    for entry, _ in proposed:
        for item in entry.items:
            seen[item.producer_id[0]].append(item.sequence)
            assert bytes(item.payload) == f"{item.producer_id[0]}:{item.sequence}".encode()
    assert all(_grows(message) for message in messages), f"seed {seed}: a view not released"
    for number, plan in plans.items():
        expected = list(range(sum(size for size, _ in plan)))
        assert seen[number] == expected, f"seed {seed}, submitter {number}"
    assert most_in_flight <= in_flight_max, f"seed {seed}"
