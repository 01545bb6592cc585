"""transfer.py: leadership transfer against a scripted Raft member and a hand-moved clock.
The request runs on a worker thread, as on a node; this thread drives it as the tick
thread would."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from hastream.errors import InvalidArgument, NotLeader, TransferFailed
from raftstore.transfer import LeadershipTransfer

pytestmark = pytest.mark.unit

SELF, PEER, OTHER = "a:1", "b:1", "c:1"
WAIT_S = 10.0  # only reached when a test is broken


class Member:
    def __init__(self) -> None:
        self.leader = True
        self.leader_at: str | None = SELF
        self.commit_index = 40
        self.log_end = 40
        self.caught_up: tuple[str, object] | None = None
        self.asked_requested: list[str | None] = []
        self.timeout_now: list[object] = []
        self.leadership_asked = threading.Event()

    def is_leader(self) -> bool:
        self.leadership_asked.set()
        return self.leader

    def leader_address(self) -> str | None:
        return self.leader_at

    def last_log_index(self) -> int:
        return self.log_end

    def caught_up_follower(self, requested: str | None) -> tuple[str, object] | None:
        self.asked_requested.append(requested)
        return self.caught_up

    def send_timeout_now(self, follower: object) -> None:
        self.timeout_now.append(follower)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def _transfer(member: Member, clock: Clock) -> LeadershipTransfer:
    return LeadershipTransfer(
        member, group_id=3, self_address=SELF, peer_addresses=(SELF, PEER, OTHER), clock=clock
    )


def _start(
    pool: ThreadPoolExecutor,
    transfer: LeadershipTransfer,
    member: Member,
    target: str | None,
    timeout_s: float = 5.0,
) -> Future[str]:
    """The request, once it has set its transfer: it asks the member under the lock it sets
    the transfer under, and `admit` takes that lock (and is refused from then on)."""
    member.leadership_asked.clear()
    future = pool.submit(transfer.request, target, timeout_s)
    assert member.leadership_asked.wait(WAIT_S)
    assert not transfer.admit(lambda: pytest.fail("proposed during a transfer"))
    return future


def test_the_target_gets_timeout_now_once_caught_up_and_the_transfer_ends_when_it_leads(
    pool: ThreadPoolExecutor,
) -> None:
    member, clock = Member(), Clock()
    transfer = _transfer(member, clock)
    future = _start(pool, transfer, member, PEER)
    assert transfer.target() == PEER

    transfer.drive()  # not caught up yet
    assert member.asked_requested == [PEER]
    assert member.timeout_now == []
    handle = object()
    member.caught_up = (PEER, handle)
    transfer.drive()
    assert member.timeout_now == [handle]

    member.leader, member.leader_at = False, PEER
    transfer.drive()  # a follower now, but the new leader committed nothing past the log yet
    assert not future.done()
    member.commit_index = 41
    transfer.drive()
    assert future.result(WAIT_S) == PEER
    assert transfer.target() is None
    proposed: list[bool] = []
    assert transfer.admit(lambda: proposed.append(True))
    assert proposed == [True]


def test_timeout_now_is_resent_only_after_its_interval(pool: ThreadPoolExecutor) -> None:
    member, clock = Member(), Clock()
    transfer = _transfer(member, clock)
    future = _start(pool, transfer, member, None)
    assert transfer.target() == ""
    member.caught_up = (OTHER, "other")
    transfer.drive()
    clock.now += 0.25
    transfer.drive()
    assert member.timeout_now == ["other"]
    clock.now += 0.25
    transfer.drive()
    assert member.timeout_now == ["other", "other"]
    assert transfer.target() == OTHER

    clock.now += 5.0
    transfer.drive()
    with pytest.raises(TransferFailed, match="did not take over in time"):
        future.result(WAIT_S)


@pytest.mark.parametrize(
    ("leader", "reason"),
    [(True, "did not catch up in time"), (False, "no new leader was heard of in time")],
)
def test_the_deadline_fails_the_transfer_and_proposals_are_taken_again(
    pool: ThreadPoolExecutor, leader: bool, reason: str
) -> None:
    member, clock = Member(), Clock()
    transfer = _transfer(member, clock)
    future = _start(pool, transfer, member, PEER, timeout_s=2.0)
    member.leader, member.leader_at = leader, None if not leader else SELF
    clock.now += 1.5
    transfer.drive()
    assert not future.done()
    clock.now += 0.5
    transfer.drive()
    with pytest.raises(TransferFailed, match=reason):
        future.result(WAIT_S)
    assert transfer.target() is None
    assert transfer.admit(lambda: None)


def test_requests_that_cannot_start_a_transfer() -> None:
    member = Member()
    transfer = _transfer(member, Clock())
    assert transfer.request(SELF, 1.0) == SELF
    with pytest.raises(InvalidArgument):
        transfer.request("z:9", 1.0)
    member.leader = False
    with pytest.raises(NotLeader):
        transfer.request(PEER, 1.0)
    assert transfer.target() is None
    transfer.drive()  # nothing under way: nothing asked of the member
    assert member.asked_requested == []
