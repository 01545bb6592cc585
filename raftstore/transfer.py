"""Leadership transfer of one Raft member (Raft thesis 3.10): the leader stops taking
proposals, waits until a follower holds every entry, and sends it TimeoutNow.

A request thread starts a transfer (`request`) and waits for its end; the tick thread
drives it (`drive`) until the target leads or the deadline passes. The member's Raft
internals stay behind `RaftMember` (replication.py's RaftReplica).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

from hastream.errors import InvalidArgument, NotLeader, RaftStoreError, TransferFailed

log = logging.getLogger(__name__)

# A TimeoutNow that did not make the target stand for election is sent again after this.
_TIMEOUT_NOW_RESEND_S: Final = 0.5
# The request thread waits this much past the deadline: the tick thread ends a transfer by
# its deadline, and the margin covers a slow tick.
_ANSWER_MARGIN_S: Final = 2.0


class RaftMember(Protocol):
    """What a transfer reads of and asks from its Raft member."""

    def is_leader(self) -> bool: ...

    def leader_address(self) -> str | None: ...

    @property
    def commit_index(self) -> int: ...

    def last_log_index(self) -> int: ...

    def caught_up_follower(self, requested: str | None) -> tuple[str, object] | None:
        """(replica address, the handle `send_timeout_now` takes) of a connected follower
        (`requested`, or any) whose log holds every entry, once everything this leader
        accepted is in its log and applied; else None."""
        ...

    def send_timeout_now(self, follower: object) -> None: ...


@dataclass(slots=True)
class _Transfer:
    """A leadership transfer under way: proposals are refused until it ends (`done`)."""

    requested: str | None  # the member asked for (replica address); None: any caught-up one
    deadline: float  # on the transfer's clock
    done: threading.Event = field(default_factory=threading.Event)
    target: str | None = None  # the follower the last TimeoutNow went to
    sent_at: float | None = None
    last_index: int = 0  # the end of the log when TimeoutNow was sent
    new_leader: str | None = None
    error: RaftStoreError | None = None


class LeadershipTransfer:
    """The transfer state of one member. A transfer is set by a request thread under the
    lock and driven and ended by the tick thread; `admit` refuses proposals while it is set."""

    def __init__(
        self,
        member: RaftMember,
        *,
        group_id: int,
        self_address: str,
        peer_addresses: tuple[str, ...],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._member = member
        self._group_id = group_id
        self._self_address = self_address
        self._peer_addresses = peer_addresses
        self._clock = clock
        self._lock = threading.Lock()
        self._transfer: _Transfer | None = None

    def admit(self, propose: Callable[[], None]) -> bool:
        """Run `propose` unless a transfer is under way; False when refused."""
        with self._lock:
            # Under the lock: once a transfer is set, nothing more enters the member's
            # queue, so the target can hold every entry before it is asked to take over.
            if self._transfer is None:
                propose()
                return True
        return False

    def request(self, target: str | None, timeout_s: float) -> str:
        """Hand this group's leadership to `target` (a member's replica address; None: the
        first follower that holds every entry) and return the new leader's replica address.
        Request thread; blocks up to `timeout_s`.

        From now on proposals are refused (LeadershipLost: the client retries, at the new
        leader); once everything proposed before is applied here and the target's match
        index reaches the end of the log, the member sends it TimeoutNow and it stands for
        election at once, with a log no voter can refuse. Raises NotLeader (not the leader),
        InvalidArgument (not a member), TransferFailed (the target did not catch up or take
        over in time: this node then takes proposals again). Concurrent requests join the
        one under way."""
        if target == self._self_address and self._member.is_leader():
            return target
        if target is not None and target not in self._peer_addresses:
            raise InvalidArgument("to", f"{target} is not a member of group {self._group_id}")
        with self._lock:
            if not self._member.is_leader():
                raise NotLeader(None, self._group_id)
            transfer = self._transfer
            if transfer is None:
                deadline = self._clock() + timeout_s
                transfer = self._transfer = _Transfer(requested=target, deadline=deadline)
                log.info("leadership transfer group=%d to=%s", self._group_id, target or "any")
        if not transfer.done.wait(timeout=timeout_s + _ANSWER_MARGIN_S):
            raise TransferFailed(self._group_id, target, "the raft member did not answer")
        if transfer.error is not None:
            raise transfer.error
        assert transfer.new_leader is not None, "a transfer ends with a leader or an error"
        return transfer.new_leader

    def target(self) -> str | None:
        """While a transfer is under way: the member asked to take over ("" before one is
        chosen); None otherwise."""
        transfer = self._transfer
        if transfer is None:
            return None
        return transfer.target or transfer.requested or ""

    def wait(self, timeout_s: float) -> None:
        transfer = self._transfer
        if transfer is not None:
            transfer.done.wait(timeout=timeout_s)

    def drive(self) -> None:
        """Tick thread: advance the transfer under way, if any."""
        transfer = self._transfer
        if transfer is None:
            return
        now = self._clock()
        member = self._member
        if not member.is_leader():
            leader = member.leader_address()
            # Done once the new leader committed its first entry (past the log handed over):
            # it takes writes from then on.
            if (
                leader is not None
                and leader != self._self_address
                and member.commit_index > transfer.last_index
            ):
                self._end(transfer, new_leader=leader)
            elif now >= transfer.deadline:
                self._end(transfer, error="stepped down, but no new leader was heard of in time")
            return
        if now >= transfer.deadline:
            reason = (
                "the target did not catch up in time"
                if transfer.sent_at is None
                else "the target did not take over in time"
            )
            self._end(transfer, error=reason)
            return
        if transfer.sent_at is not None and now - transfer.sent_at < _TIMEOUT_NOW_RESEND_S:
            return
        follower = member.caught_up_follower(transfer.requested)
        if follower is None:
            return  # replication (a heartbeat at most 50 ms away) brings it up to date
        transfer.target, handle = follower
        transfer.sent_at = now
        transfer.last_index = member.last_log_index()
        log.info("sending TimeoutNow group=%d target=%s", self._group_id, transfer.target)
        member.send_timeout_now(handle)

    def _end(self, transfer: _Transfer, *, new_leader: str | None = None, error: str = "") -> None:
        if error:
            transfer.error = TransferFailed(self._group_id, transfer.requested, error)
            log.warning("leadership transfer failed group=%d: %s", self._group_id, error)
        else:
            transfer.new_leader = new_leader
            log.info("leadership transferred group=%d leader=%s", self._group_id, new_leader)
        with self._lock:
            if self._transfer is transfer:
                self._transfer = None
        transfer.done.set()
