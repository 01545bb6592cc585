"""raftstore/pacing.py: which followers the leader sends to when. Examples, and a hypothesis
state machine that drives a Pacing as the leader's tick does (entries added, acknowledgements,
time passing, commit notices, new terms) and checks it against a plain model of what each
follower was sent and when."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from raftstore.pacing import Follower, Pacing

HOLD_S = 0.010
HOLD_BYTES = 1000
HEARTBEAT_S = 0.050


def pacing() -> Pacing:
    return Pacing(hold_s=HOLD_S, hold_bytes=HOLD_BYTES, heartbeat_s=HEARTBEAT_S)


def started(match: int) -> tuple[Pacing, str, str]:
    """A new leader's pacing after its first plan (both followers acknowledged `match`):
    the pacing, its eager follower and the other one."""
    plan = pacing()
    both = [Follower("a", match, 0), Follower("b", match, 0)]
    assert sorted(sent_once(plan, 0.0, both), key=str) == ["a", "b"]  # a new term: everyone
    (eager,) = plan.eager
    return plan, str(eager), "b" if eager == "a" else "a"


def sent_once(plan: Pacing, now: float, followers: list[Follower]) -> list[object]:
    send = plan.plan(now, followers, 1, 0)
    for node in send:
        plan.sent(node, now)
    return send


@pytest.mark.unit
def test_one_follower_gets_each_entry_the_other_waits() -> None:
    plan, eager, other = started(10)
    assert plan.plan(0.001, [Follower(eager, 10, 1), Follower(other, 10, 1)], 1, 100) == [eager]
    plan.sent(eager, 0.001)
    assert plan.next_due() == pytest.approx(0.001 + HOLD_S)  # the other's first held entry
    assert plan.plan(0.005, [Follower(eager, 11, 1), Follower(other, 10, 2)], 1, 100) == [eager]
    plan.sent(eager, 0.005)
    # The other's first entry has waited HOLD_S: it gets all it lacks in one message.
    assert plan.plan(0.0111, [Follower(eager, 12, 0), Follower(other, 10, 2)], 1, 0) == [other]


@pytest.mark.unit
def test_a_held_follower_goes_at_once_when_it_lacks_hold_bytes() -> None:
    plan = pacing()
    sent_once(plan, 0.0, [Follower("a", 5, 0), Follower("b", 5, 0)])
    assert plan.plan(0.001, [Follower("a", 6, 1), Follower("b", 5, 1)], 1, 600) == ["a"]
    plan.sent("a", 0.001)
    assert plan.plan(0.002, [Follower("a", 6, 1), Follower("b", 5, 2)], 1, 600) == ["a", "b"]


@pytest.mark.unit
def test_a_follower_that_falls_behind_for_hold_s_loses_its_place() -> None:
    plan, frozen, other = started(5)
    assert plan.plan(0.001, [Follower(frozen, 5, 1), Follower(other, 5, 1)], 1, 10) == [frozen]
    plan.sent(frozen, 0.001)
    # The eager one never acknowledges; the other's batch goes HOLD_S later.
    assert plan.plan(0.0111, [Follower(frozen, 5, 0), Follower(other, 5, 1)], 1, 0) == [other]
    plan.sent(other, 0.0111)
    # Its acknowledgement (6) puts the frozen one behind: still eager for HOLD_S...
    assert plan.plan(0.012, [Follower(frozen, 5, 1), Follower(other, 6, 1)], 1, 10) == [frozen]
    plan.sent(frozen, 0.012)
    assert plan.eager == (frozen,)
    # ... then replaced.
    assert plan.plan(0.0221, [Follower(frozen, 5, 0), Follower(other, 6, 1)], 1, 0) == [other]
    assert plan.eager == (other,)


@pytest.mark.unit
def test_an_eager_follower_that_catches_up_in_time_keeps_its_place() -> None:
    plan, eager, other = started(5)
    for step in range(1, 20):  # the other's batch acknowledged first, every time
        now = step * 0.009
        plan.plan(now, [Follower(eager, 5 + step - 1, 1), Follower(other, 5 + step, 1)], 1, 10)
        plan.sent(eager, now)
        plan.plan(now + 0.001, [Follower(eager, 5 + step, 0), Follower(other, 5 + step, 1)], 1, 0)
        assert plan.eager == (eager,)


@pytest.mark.unit
def test_a_hold_of_zero_sends_every_follower_every_entry() -> None:
    plan = Pacing(hold_s=0.0, hold_bytes=HOLD_BYTES, heartbeat_s=HEARTBEAT_S)
    sent_once(plan, 0.0, [Follower("a", 1, 0), Follower("b", 1, 0)])
    assert plan.plan(0.001, [Follower("a", 1, 1), Follower("b", 1, 1)], 1, 10) == ["a", "b"]


@pytest.mark.unit
def test_five_members_send_two_followers_every_entry() -> None:
    plan = pacing()
    nodes = ["a", "b", "c", "d"]
    sent_once(plan, 0.0, [Follower(n, 1, 0) for n in nodes])
    lacking = [Follower(n, m, 1) for n, m in zip(nodes, (3, 1, 2, 1), strict=True)]
    assert plan.plan(0.001, lacking, 2, 10) == ["a", "c"]


@pytest.mark.unit
def test_a_commit_notice_reaches_every_follower_by_its_time() -> None:
    plan = pacing()
    sent_once(plan, 0.0, [Follower("a", 1, 0), Follower("b", 1, 0)])
    plan.pull(0.010)
    assert plan.next_due() == 0.010
    assert plan.plan(0.009, [Follower("a", 1, 0), Follower("b", 1, 0)], 1, 0) == []
    assert plan.plan(0.010, [Follower("a", 1, 0), Follower("b", 1, 0)], 1, 0) == ["a", "b"]


# --- the model -----------------------------------------------------------------------------


@dataclass
class Modelled:
    """What the model knows of one follower."""

    match_index: int = 0
    next_index: int = 1  # the first entry it has not been sent
    last_sent: float = 0.0
    lacking_since: float | None = None  # when the first entry it was not sent was added
    lacking_bytes: int = 0
    behind_since: float | None = None  # acknowledged less than another at every plan since
    # A commit notice it has not had yet: any message sent after the notice carries the
    # new commit index.
    pulled: float | None = 0.0  # a new leader's first plan is one


class PacingModel(RuleBasedStateMachine):
    """A leader's tick over a Pacing: it plans after every added entry and whenever
    `next_due` comes, as replication.py's __sendAppendEntries does."""

    @initialize(count=st.sampled_from([2, 4]))
    def start(self, count: int) -> None:
        self.pacing = pacing()
        self.now = 0.0
        self.last_index = 0
        self.needed = (count + 1) // 2
        self.followers = {f"n{k}": Modelled() for k in range(count)}
        self.plan(0)

    def plan(self, added_bytes: int) -> None:
        listed = [
            Follower(node, f.match_index, self.last_index + 1 - f.next_index)
            for node, f in self.followers.items()
        ]
        before = set(self.pacing.eager)
        best = max(f.match_index for f in self.followers.values())
        for f in self.followers.values():
            if f.match_index >= best:
                f.behind_since = None
            elif f.behind_since is None:
                f.behind_since = self.now
        send = self.pacing.plan(self.now, listed, self.needed, added_bytes)
        eager = set(self.pacing.eager)
        assert len(eager) == self.needed
        stayed_behind = {
            node
            for node, f in self.followers.items()
            if f.behind_since is not None and self.now - f.behind_since >= HOLD_S
        }
        match = {node: f.match_index for node, f in self.followers.items()}
        for node in eager & stayed_behind:  # kept only while nobody else is ahead of it
            assert all(match[other] <= match[node] for other in set(match) - eager), node
        for node in before - eager:  # replaced only once behind for HOLD_S, by one ahead
            assert node in stayed_behind, node
            assert all(match[new] > match[node] for new in eager - before), node
        for node, f in self.followers.items():
            lacks = f.next_index <= self.last_index
            if node in send:
                if not lacks:  # a message with nothing new: only a heartbeat or a notice
                    assert self.now >= f.last_sent + HEARTBEAT_S or self.pull_due(f), node
                elif node not in eager:  # a batch: only once it waited or grew
                    waited = f.lacking_since is not None and self.now >= f.lacking_since + HOLD_S
                    assert (
                        waited
                        or f.lacking_bytes >= HOLD_BYTES
                        or self.now >= f.last_sent + HEARTBEAT_S
                        or self.pull_due(f)
                    ), node
                f.next_index = self.last_index + 1
                f.last_sent = self.now
                f.lacking_since = None
                f.lacking_bytes = 0
                f.pulled = None
                self.pacing.sent(node, self.now)
            else:
                assert not (lacks and node in eager), f"{node} is needed for a commit"
                assert not self.pull_due(f), f"{node}: its commit notice is due"

    def pull_due(self, f: Modelled) -> bool:
        return f.pulled is not None and self.now >= f.pulled

    @rule(size=st.integers(min_value=1, max_value=700))
    def add_entry(self, size: int) -> None:
        self.last_index += 1
        for f in self.followers.values():
            if f.next_index <= self.last_index and f.lacking_since is None:
                f.lacking_since = self.now
            f.lacking_bytes += size
        self.plan(size)

    @rule(data=st.data())
    def acknowledge(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(sorted(self.followers)))
        f = self.followers[node]
        f.match_index = max(f.match_index, f.next_index - 1)

    @rule(seconds=st.floats(min_value=0.0, max_value=0.03))
    def time_passes(self, seconds: float) -> None:
        """Time goes on to the next send the pacing asked for, at most: the tick's poll
        wakes for it."""
        self.now = min(self.now + seconds, max(self.now, self.pacing.next_due()))
        if self.now >= self.pacing.next_due():
            self.plan(0)

    @rule(delay=st.floats(min_value=0.0, max_value=0.02))
    def commit_notice(self, delay: float) -> None:
        at = self.now + delay
        self.pacing.pull(at)
        for f in self.followers.values():
            f.pulled = at if f.pulled is None else min(f.pulled, at)

    @rule()
    def new_term(self) -> None:
        self.pacing.reset()
        for f in self.followers.values():
            f.behind_since = None
            f.pulled = self.now  # every follower hears from the new leader at once
        self.plan(0)

    @invariant()
    def every_follower_hears_in_time(self) -> None:
        due = self.pacing.next_due()
        for node, f in self.followers.items():
            assert due <= f.last_sent + HEARTBEAT_S, f"{node}: heartbeat late"
            if f.lacking_since is not None:
                assert due <= f.lacking_since + HOLD_S, f"{node}: held past HOLD_S"
            if f.pulled is not None:
                assert due <= f.pulled, f"{node}: its commit notice late"


PacingModel.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPacingModel = pytest.mark.property(PacingModel.TestCase)
