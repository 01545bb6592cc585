"""Group commit: concurrent publishes to one group are packed into one Raft entry.

Every Raft entry costs a journal write, a network message per follower, one apply and an
fdatasync shared by the tick. Packing the publishes that arrive while earlier entries are in
flight into one `Append` command makes batch-1 publishing from several threads cost one entry
per round trip instead of one per row.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from hastream.errors import LeadershipLost, Overloaded, ProposalTimeout, RaftStoreError
from raftstore import commands, limits
from raftstore.replica import CommandBytes
from raftstore.state_machine import AppendResult, ItemResult
from raftstore.threads import Spawn

log = logging.getLogger(__name__)

Propose = Callable[[CommandBytes, Callable[[Any, RaftStoreError | None], None]], None]
_Future = Future[tuple[int, ItemResult]]


class Batcher:
    """Runs one thread, started through `spawn` (the node's threads.Threads). `submit` may
    be called from any thread; when nothing is being sent and a slot is free, it proposes
    on the calling thread (a waited publish then skips the hand-over)."""

    def __init__(
        self,
        group_id: int,
        propose: Propose,
        *,
        spawn: Spawn,
        in_flight_max: int = limits.PROPOSALS_IN_FLIGHT_MAX,
        proposal_timeout_s: float = limits.PROPOSAL_TIMEOUT_S,
    ) -> None:
        # Never above the limit: the Raft send buffer cap (limits.py) is sized by it.
        if not 1 <= in_flight_max <= limits.PROPOSALS_IN_FLIGHT_MAX:
            raise ValueError(f"in_flight_max must be 1..{limits.PROPOSALS_IN_FLIGHT_MAX}")
        self._in_flight_max = in_flight_max
        self._proposal_timeout_s = proposal_timeout_s
        self._group_id = group_id
        self._propose = propose
        self._queue: collections.deque[tuple[commands.AppendItem, _Future]] = collections.deque()
        self._queued_bytes = 0
        self._condition = threading.Condition()
        # Proposal number -> deadline. A slot is freed by the proposal's callback, or at its
        # deadline, where its publishes fail with ProposalTimeout: pysyncobj never calls
        # back for entries a snapshot install wiped out, and a deferred answer (a unary
        # Publish, grpc_unary.Deferred) comes only when its future completes.
        self._in_flight: dict[int, float] = {}
        self._waiting: dict[int, list[_Future]] = {}
        self._expired: list[_Future] = []  # of expired proposals, for the thread to fail
        self._proposals = 0
        self._sending = False  # a proposal's number is taken and its propose not yet done
        self._closed = False
        self.entries_proposed = 0
        self.items_proposed = 0
        self._thread = spawn(f"batcher-{group_id}", self._run)

    def submit(self, item: commands.AppendItem) -> _Future:
        return self.submit_many([item])[0]

    def submit_many(self, items: list[commands.AppendItem]) -> list[_Future]:
        """Queue `items` for group commit, in order: all are queued or none (Overloaded,
        LeadershipLost). When no proposal is being sent and a slot is free, the caller
        proposes what is queued itself: handing it to the batcher thread would add a thread
        wake-up and a GIL hand-over to every waited publish's path. A payload given as a
        memoryview (a received message, publish_wire) is released once its entry is joined
        (`_let_go_of_payloads`): a caller reads its size before submitting it."""
        futures: list[_Future] = [Future() for _ in items]
        with self._condition:
            if self._closed:
                raise LeadershipLost("node shutting down")
            if len(self._queue) + len(items) > limits.PUBLISH_QUEUE_MAX:
                raise Overloaded("publish", limits.PUBLISH_QUEUE_MAX)
            size = sum(len(item.payload) for item in items)
            if self._queued_bytes + size > limits.PUBLISH_QUEUE_BYTES_MAX:
                raise Overloaded("publish bytes", limits.PUBLISH_QUEUE_BYTES_MAX)
            self._queue.extend(zip(items, futures, strict=True))
            self._queued_bytes += size
            if self._sending or not self._slot_free():
                self._condition.notify()
                return futures
            batch = self._drain()
            number = self._take_slot(batch)
        self._send_and_finish(number, batch)
        return futures

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        # Waited for here too: the queue is failed below only once the loop takes no more.
        self._thread.join(timeout=5)
        # Queued and uncommitted publishes alike: no callback comes after the node stops,
        # and a deferred answer (grpc_unary.Deferred) comes only when its future completes.
        self.fail_in_flight(LeadershipLost("node shutting down"))

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def _run(self) -> None:  # the batcher's event loop: runs until close()
        while True:
            batch: list[tuple[commands.AppendItem, _Future]] = []
            with self._condition:
                free = self._slot_free()  # also expires what is past its deadline
                if not self._closed and not self._can_send(free):
                    self._condition.wait(timeout=0.1)
                    free = self._slot_free()
                expired, self._expired = self._expired, []
                closed = self._closed
                if not closed and self._can_send(free):
                    # Publishes that arrived while every slot was busy join this entry.
                    batch = self._drain()
                    number = self._take_slot(batch)
            timeout = ProposalTimeout(self._proposal_timeout_s)
            for future in expired:  # outside the lock: completing a future runs callbacks
                _settle(future, error=timeout)
            if closed:
                return
            if batch:
                self._send_and_finish(number, batch)

    def _can_send(self, slot_free: bool) -> bool:
        """A proposal can be sent now (caller holds the condition)."""
        return slot_free and bool(self._queue) and not self._sending

    def _take_slot(self, batch: list[tuple[commands.AppendItem, _Future]]) -> int:
        """A proposal number for `batch`, marked as being sent (caller holds the
        condition). One proposal is sent at a time, so they reach Raft in number order,
        which is the order their publishes were submitted in."""
        self._proposals += 1
        number = self._proposals
        self._in_flight[number] = time.monotonic() + self._proposal_timeout_s
        self._waiting[number] = [future for _, future in batch]
        self._sending = True
        return number

    def _send_and_finish(
        self, number: int, batch: list[tuple[commands.AppendItem, _Future]]
    ) -> None:
        try:
            self._send(number, batch)
        finally:
            with self._condition:
                self._sending = False
                if self._queue:
                    self._condition.notify()

    def _slot_free(self) -> bool:
        """Whether a proposal may be sent (caller holds the condition). An expired proposal
        frees its slot first; the batcher's thread fails its publishes with ProposalTimeout
        (whether they commit is unknown; a deduplicated retry is safe)."""
        now = time.monotonic()
        for number, deadline in list(self._in_flight.items()):
            if deadline < now:
                log.warning("proposal expired without a callback group=%d", self._group_id)
                del self._in_flight[number]
                self._expired += self._waiting.pop(number, [])
        return len(self._in_flight) < self._in_flight_max

    def _release(self, number: int) -> None:
        with self._condition:
            self._in_flight.pop(number, None)
            self._waiting.pop(number, None)
            if self._queue:  # the batcher thread waits for a slot only with publishes queued
                self._condition.notify()

    def fail_in_flight(self, error: RaftStoreError) -> None:
        """Answer every publish not committed yet with `error` (leadership was lost): those
        waiting for commit (their outcome is unknown; a deduplicated retry on the new leader
        is safe) and those still queued, which are dropped: proposed later, should this node
        lead again, they could commit after a producer's earlier publish had failed."""
        with self._condition:
            waiting = [future for futures in self._waiting.values() for future in futures]
            queued = [future for _, future in self._queue]
            self._queue.clear()
            self._queued_bytes = 0
        for future in waiting + queued:
            _settle(future, error=error)

    def _drain(self) -> list[tuple[commands.AppendItem, _Future]]:
        """Take queued publishes for one entry (caller holds the condition)."""
        batch: list[tuple[commands.AppendItem, _Future]] = []
        size = 0
        while self._queue and len(batch) < limits.ENTRY_ITEMS_MAX:
            item, future = self._queue[0]
            # The MiB left covers the items' framing and seals (checked_payload.py: 44
            # bytes each; ENTRY_ITEMS_MAX of them with their headers take ~0.6 MiB).
            if batch and size + len(item.payload) > limits.ENTRY_BYTES_MAX - limits.MIB:
                break
            self._queue.popleft()
            self._queued_bytes -= len(item.payload)
            size += len(item.payload)
            batch.append((item, future))
        return batch

    def _send(self, number: int, batch: list[tuple[commands.AppendItem, _Future]]) -> None:
        futures = [future for _, future in batch]
        command = commands.Append(
            timestamp_ms=int(time.time() * 1000), items=tuple(item for item, _ in batch)
        )

        def done(result: Any, error: RaftStoreError | None) -> None:
            self._release(number)
            if error is None and not isinstance(result, AppendResult):
                error = LeadershipLost("entry applied without a result (node catching up)")
            if error is not None:
                for future in futures:
                    _settle(future, error=error)
                return
            assert len(result.items) == len(futures), "one result per packed item"
            for future, item_result in zip(futures, result.items, strict=True):
                _settle(future, result=(result.lsn, item_result))

        self.entries_proposed += 1
        self.items_proposed += len(batch)
        try:
            # Joined once, by the replica, behind its own framing (replica.join_command).
            self._propose(commands.append_parts(command), done)
        except Exception as error:  # handed to every waiting publisher
            self._release(number)
            for future in futures:
                _settle(future, error=error)
        finally:
            _let_go_of_payloads(command.items)


def _let_go_of_payloads(items: tuple[commands.AppendItem, ...]) -> None:
    """The replica has joined the entry (a copy of every payload), or refused it: release
    the views of the received gRPC messages (publish_wire), so that each message's bytes are
    freed now rather than when its publisher is answered. A 211-column 10,000-row request
    is 12.7 MB, and a leader held one per publish waiting for its commit, beside the
    entry's copy. Callers read a payload's size before they submit it. A view something
    still exports (an Arrow buffer over it) is left as it is: the garbage collector frees it
    with its last user."""
    for item in items:
        if isinstance(item.payload, memoryview):
            with contextlib.suppress(BufferError):
                item.payload.release()


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Complete `future` once; later completions (a commit after leadership loss) are
    dropped. The tick thread completes most, but a propose refused at once (a full queue, a
    leadership transfer) fails its futures on the proposing thread, which may race a
    step-down's `fail_in_flight`: whichever comes second is dropped."""
    if future.done():
        return
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
