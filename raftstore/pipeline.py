"""PublishStream, server side: many publishes in flight on one bidi stream, answered in order.

Each request is an ordinary publish that must carry a producer id. It is validated as a
unary Publish is (leader, table, `validate_payload`), then handed to group commit without
waiting; the answers go back in request order, each only once its rows are committed on a
majority and applied, exactly as for Publish. Items are proposed `contiguous`: the state
machine refuses a sequence that skips past the producer's last applied one + 1, so when a
request fails, no later request of the producer can land before its resend.

Messages carry several requests (`PublishBatch`) and several answers (`PublishAcks`):
whatever the sender has ready. gRPC costs ~150-200 us of Python per message and side on this
machine, against ~13 us per request when 16 share a message, so packing is what makes 1-row
publishes cheap. The answers of the requests that are done go out together.

The first request that fails ends the stream: the answers of the requests before it are
sent, its error becomes the call's status (typed, in trailing metadata, like Publish), and
the requests after it are not answered (those already proposed are refused as SequenceGap,
the others are neither proposed nor read).

Threads: the gRPC handler thread runs `PublishStream.responses()`, which yields the answers;
a reader thread per stream takes messages from the request iterator, validates and submits
their requests. Reading stops while `limits.PIPELINE_IN_FLIGHT_MAX` requests or
`limits.PIPELINE_IN_FLIGHT_BYTES_MAX` payload bytes are read and unanswered (HTTP/2 flow
control then holds the client back).

Group commit: pipelined items go to the group's own batcher (`Group.submit_appends`), so
they share Raft entries with unary publishes and fail with them when the node steps down
(`Group.on_role_change` fails every uncommitted item, queued ones included).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Final

from hastream.errors import (
    InvalidArgument,
    LeadershipLost,
    NotLeader,
    ProposalTimeout,
    RaftStoreError,
)
from raftstore import commands, limits
from raftstore.group import Group
from raftstore.state_machine import ItemResult, TableMeta

log = logging.getLogger(__name__)

# How often the responder, while it waits for an answer, checks whether this node stepped
# down or the client went away.
_POLL_S: Final = 0.2

Route = Callable[[str], Group]
Answer = Future[tuple[int, ItemResult]]


@dataclass(frozen=True, slots=True)
class StreamedPublish:
    """One request read from the stream (the servicer converts the wire message)."""

    table: str
    producer_id: bytes
    sequence: int
    payload: bytes | memoryview  # a view of the received message (publish_wire)


@dataclass(frozen=True, slots=True)
class Ack:
    """The answer to one request: committed at `lsn` with `result` (rows and offsets)."""

    lsn: int
    result: ItemResult
    sequence: int


@dataclass(slots=True)
class _Pending:
    """One request read from the stream and not answered yet."""

    sequence: int
    size: int  # payload bytes
    table: str
    group: Group | None
    deadline: float  # time.monotonic() by which it must be committed
    answer: Answer | None  # None when `error` is set
    error: RaftStoreError | None  # refused before it was proposed


@dataclass(slots=True)
class _Target:
    """Where the requests of one table in one message go (looked up once per message)."""

    group: Group
    meta: TableMeta


class PublishStream:
    """One PublishStream call. `responses()` is the handler's answer iterator; `close()`
    (in a finally) stops the reader."""

    def __init__(
        self,
        messages: Iterator[list[StreamedPublish]],
        *,
        route: Route,
        is_active: Callable[[], bool],
        in_flight_max: int = limits.PIPELINE_IN_FLIGHT_MAX,
        in_flight_bytes_max: int = limits.PIPELINE_IN_FLIGHT_BYTES_MAX,
    ) -> None:
        assert in_flight_max >= 1, in_flight_max
        assert in_flight_bytes_max >= 1, in_flight_bytes_max
        self._messages = messages
        self._route = route
        self._is_active = is_active
        self._in_flight_max = in_flight_max
        self._in_flight_bytes_max = in_flight_bytes_max
        self._condition = threading.Condition()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._pending_bytes = 0
        self._reading = True  # False once the client half-closed or the reader stopped
        self._group: Group | None = None  # the one group this stream carries (reader thread)
        self._closed = False
        # Not the node's threads.Threads: request-scoped, it ends with this one gRPC stream.
        self._reader = threading.Thread(target=self._read, name="publish-stream", daemon=True)

    # --- reader thread -----------------------------------------------------------------

    def _read(self) -> None:
        try:
            while self._wait_for_room():
                message = self._next_message()
                if message is None:
                    break  # the client half-closed, or the call ended
                pending = self._submit_all(message)
                with self._condition:
                    self._pending.extend(pending)
                    self._pending_bytes += sum(request.size for request in pending)
                    self._condition.notify_all()
                if pending and pending[-1].error is not None:
                    break  # nothing after a refused request is read
        finally:
            with self._condition:
                self._reading = False
                self._condition.notify_all()

    def _wait_for_room(self) -> bool:
        with self._condition:
            while not self._closed and (
                len(self._pending) >= self._in_flight_max
                or self._pending_bytes >= self._in_flight_bytes_max
            ):
                self._condition.wait(timeout=_POLL_S)
            return not self._closed

    def _next_message(self) -> list[StreamedPublish] | None:
        """The next message's requests; None when the client half-closed or the call ended
        (the servicer's iterator ends then)."""
        return next(self._messages, None)

    def _submit_all(self, requests: list[StreamedPublish]) -> list[_Pending]:
        """Validate the requests of one message in order and hand them to group commit,
        without waiting. Stops at the first refused request, which ends the list."""
        deadline = time.monotonic() + limits.PROPOSAL_TIMEOUT_S
        if len(requests) > limits.PIPELINE_BATCH_REQUESTS_MAX:
            error = InvalidArgument(
                "requests",
                f"{len(requests)} in one message > {limits.PIPELINE_BATCH_REQUESTS_MAX}",
            )
            first = requests[0]
            return [_Pending(first.sequence, 0, first.table, None, deadline, None, error)]
        targets: dict[str, _Target] = {}
        accepted: list[tuple[_Target, commands.AppendItem]] = []
        refused: _Pending | None = None
        for request in requests:
            try:
                target = targets.get(request.table) or self._target(request.table)
                targets[request.table] = target
                accepted.append((target, _item(request, target)))
            except RaftStoreError as error:
                refused = _Pending(request.sequence, 0, request.table, None, deadline, None, error)
                break
        pending = self._propose(accepted, deadline)
        if refused is not None and len(pending) == len(accepted):
            pending.append(refused)
        return pending

    def _target(self, table: str) -> _Target:
        group = self._route(table)
        if self._group is None:
            self._group = group
        elif group is not self._group:
            # One group per stream: its answers are in request order and the first failure
            # ends it, which is only true of requests that share one group's log.
            raise InvalidArgument(
                "table",
                f"{table!r} is in raft group {group.group_id}; this PublishStream carries "
                f"raft group {self._group.group_id} (open one stream per group)",
            )
        group.require_leader()
        return _Target(group, group.table_view(table).meta)

    def _propose(
        self, accepted: list[tuple[_Target, commands.AppendItem]], deadline: float
    ) -> list[_Pending]:
        """Submit runs of consecutive items of one group together. If a run is refused
        (Overloaded, shutting down), its first item carries the error and ends the list."""
        pending: list[_Pending] = []
        start = 0
        while start < len(accepted):
            target = accepted[start][0]
            end = start + 1
            while end < len(accepted) and accepted[end][0].group is target.group:
                end += 1
            items = [item for _, item in accepted[start:end]]
            sizes = [len(item.payload) for item in items]  # released once in an entry
            try:
                answers = target.group.submit_appends(items)
            except RaftStoreError as error:
                first = items[0]
                refused = _Pending(first.sequence, 0, first.table, None, deadline, None, error)
                pending.append(refused)
                return pending
            pending += [
                _Pending(
                    item.sequence,
                    size,
                    item.table,
                    target.group,
                    deadline,
                    answer,
                    None,
                )
                for item, size, answer in zip(items, sizes, answers, strict=True)
            ]
            start = end
        return pending

    # --- handler thread ----------------------------------------------------------------

    def responses(self) -> Iterator[list[Ack]]:
        """The answers, in request order, packed: every answer that is ready when the head
        one is goes into the same message. Raises the first failed request's error once the
        answers before it are sent (the caller makes it the call's status)."""
        self._reader.start()
        while True:  # one message per round; ends when the reader is done
            head = self._head()
            if head is None:
                return
            acks, error = self._ready_answers(head)
            if acks:
                yield acks
            if error is not None:
                raise error

    def _head(self) -> _Pending | None:
        """The oldest unanswered request; None once the reader is done and all are answered
        (or the client went away)."""
        with self._condition:
            while not self._pending:
                if not self._reading or not self._is_active():
                    return None
                self._condition.wait(timeout=_POLL_S)
            return self._pending[0]

    def _ready_answers(self, head: _Pending) -> tuple[list[Ack], RaftStoreError | None]:
        """Wait for `head`, then take it and every following answer that is already done.
        Returns them and the error that ends the stream, if one of them failed."""
        acks: list[Ack] = []
        pending: _Pending | None = head
        wait = True
        while pending is not None:  # bounded by the unanswered requests
            if not wait and not _ready(pending):
                break
            try:
                acks.append(self._answer(pending))
            except RaftStoreError as error:
                return acks, error
            wait = False
            with self._condition:
                self._pending_bytes -= self._pending.popleft().size
                self._condition.notify_all()
                pending = self._pending[0] if self._pending else None
        return acks, None

    def _answer(self, pending: _Pending) -> Ack:
        if pending.error is not None:
            raise pending.error
        assert pending.answer is not None
        assert pending.group is not None
        lsn, result = self._wait(pending, pending.group, pending.answer)
        if result.error is not None:
            raise result.error
        # Arrival time: the deadline was set PROPOSAL_TIMEOUT_S after the message was read.
        started_s = pending.deadline - limits.PROPOSAL_TIMEOUT_S
        pending.group.record_publish(pending.table, result.row_count, pending.size, started_s)
        return Ack(lsn, result, pending.sequence)

    def _wait(self, pending: _Pending, group: Group, answer: Answer) -> tuple[int, ItemResult]:
        while True:  # bounded by the proposal deadline
            remaining_s = pending.deadline - time.monotonic()
            if remaining_s <= 0:
                raise ProposalTimeout(limits.PROPOSAL_TIMEOUT_S)
            try:
                return answer.result(timeout=min(remaining_s, _POLL_S))
            except FutureTimeout:
                pass
            except NotLeader as error:
                raise _with_leader(error, group) from None
            # A step-down fails the answer itself (Group.on_role_change); nothing to watch.
            if not self._is_active():
                raise LeadershipLost("the client went away")  # nobody reads this answer

    def close(self) -> None:
        """Stop reading (handler thread, when the call ends for any reason)."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()


def _ready(pending: _Pending) -> bool:
    return pending.error is not None or (pending.answer is not None and pending.answer.done())


def _item(request: StreamedPublish, target: _Target) -> commands.AppendItem:
    """The contiguous item of a valid request. Raises InvalidArgument (producer id) or what
    `validate_payload` raises."""
    if len(request.producer_id) != commands.PRODUCER_ID_BYTES:
        raise InvalidArgument("producer_id", "PublishStream needs a 16-byte producer_id")
    validated = target.group.applier.machine.validate_publish(target.meta, request.payload)
    return commands.AppendItem(
        table=request.table,
        producer_id=request.producer_id,
        sequence=request.sequence,
        payload=request.payload,
        contiguous=True,
        seal=validated.seal,
    )


def _with_leader(error: NotLeader, group: Group) -> NotLeader:
    """A NotLeader without a leader, completed with the leader this node knows now."""
    if error.leader is not None:
        return error
    hint = group.not_leader()
    return error if hint.leader is None else hint
