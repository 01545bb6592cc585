"""`api_clients.call_policy.decide`, the retry decision of `Session.call`, by table: no
network, no clock. The real-server behaviour is in test_client_unit.py (leader following)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from api_clients.call_policy import (
    Action,
    AttemptState,
    Decision,
    HedgeState,
    HedgeStep,
    SiteProbe,
    agreed_leader,
    decide,
    hedge,
    hedgeable,
    next_site,
    next_site_except,
)
from api_clients.transport import DeadlineExceeded, RpcFailed, SiteUnavailable, Unresponsive
from hastream.errors import (
    LeadershipLost,
    NodeUnavailable,
    NotLeader,
    Overloaded,
    ProposalTimeout,
    RaftStoreError,
    SchemaMismatch,
    TableNotFound,
)

pytestmark = pytest.mark.unit

A, B, C, U = "a:1", "b:2", "c:3", "u:9"  # U: a hinted leader this client cannot reach
SITES = (A, B, C)


def state(**changes: Any) -> AttemptState:
    base = AttemptState(target=A, sites=SITES, time_left=True)
    return dataclasses.replace(base, **changes)


def unavailable(site: str) -> SiteUnavailable:
    return SiteUnavailable(site, "UNAVAILABLE", "connection refused")


@dataclass(frozen=True)
class Case:
    name: str
    state: AttemptState
    error: RaftStoreError
    action: Action
    target: str | None
    backoff: bool = True
    forget_leader: bool = True
    memory: dict[str, object] = field(default_factory=dict)  # fields of Decision.state


CASES = [
    Case(
        "a non-retryable error gives up at once",
        state(),
        SchemaMismatch("t", "column x"),
        Action.GIVE_UP,
        None,
        backoff=False,
        forget_leader=False,
    ),
    Case(
        "the first NotLeader that names a leader goes there at once",
        state(hint=B),
        NotLeader(f"{B}:node2", 2),
        Action.LEADER,
        B,
        backoff=False,
        memory={"redirected": True, "hint_origin": A},
    ),
    Case(
        "a later NotLeader with a leader backs off first",
        state(hint=B, redirected=True),
        NotLeader(f"{B}:node2", 2),
        Action.LEADER,
        B,
        memory={"hint_origin": A},
    ),
    Case(
        "the first redirect without time left backs off (and so gives up)",
        state(hint=B, time_left=False),
        NotLeader(f"{B}:node2", 2),
        Action.LEADER,
        B,
        memory={"redirected": False},
    ),
    Case(
        "NotLeader during an election (no leader named) tries the next site",
        state(),
        NotLeader(None, 2),
        Action.NEXT_SITE,
        B,
    ),
    Case(
        "an unreachable site: the next site, wrapping around",
        state(target=C),
        unavailable(C),
        Action.NEXT_SITE,
        A,
    ),
    Case(
        "an unreachable hinted leader: resume after the site that named it, never again",
        state(target=U, sites=(*SITES, U), hint_origin=A, redirected=True),
        unavailable(U),
        Action.NEXT_SITE,
        B,
        memory={"unreachable_hints": frozenset({U}), "hint_origin": None},
    ),
    Case(
        "a node that says it is unavailable counts as unreachable when hinted",
        state(target=B, hint_origin=A, redirected=True),
        NodeUnavailable("catching up"),
        Action.NEXT_SITE,
        C,
        memory={"unreachable_hints": frozenset({B})},
    ),
    Case(
        "a hint already found unreachable is not followed",
        state(
            target=B, sites=(*SITES, U), hint=U, redirected=True, unreachable_hints=frozenset({U})
        ),
        NotLeader(f"{U}:node9", 2),
        Action.NEXT_SITE,
        C,
    ),
    Case(
        "an unreachable hint skips every unreachable site when resuming",
        state(target=U, sites=(A, U, B), hint_origin=A, unreachable_hints=frozenset({B})),
        unavailable(U),
        Action.NEXT_SITE,
        A,
    ),
    Case(
        "Overloaded: the leader is busy, not gone: the same site after a backoff",
        state(target=B),
        Overloaded("publish", 10),
        Action.SAME_SITE,
        B,
    ),
    Case(
        "a pinned call never leaves its site",
        state(target=B, pinned=True),
        unavailable(B),
        Action.SAME_SITE,
        B,
    ),
    Case(
        "a pinned call ignores a leader hint",
        state(target=B, pinned=True, hint=C),
        NotLeader(f"{C}:node3", 2),
        Action.SAME_SITE,
        B,
    ),
    Case(
        "TableNotFound from one site: ask the next site not asked yet, at once",
        state(target=A, table_lookup=True, not_found=frozenset({B})),
        TableNotFound("t"),
        Action.NEXT_SITE,
        C,
        backoff=False,
        memory={"not_found": frozenset({A, B})},
    ),
    Case(
        "TableNotFound believed once every known site said so",
        state(target=C, table_lookup=True, not_found=frozenset({A, B})),
        TableNotFound("t"),
        Action.GIVE_UP,
        None,
        backoff=False,
        forget_leader=False,
    ),
    Case(
        "TableNotFound with no time left is believed",
        state(table_lookup=True, time_left=False),
        TableNotFound("t"),
        Action.GIVE_UP,
        None,
        backoff=False,
        forget_leader=False,
    ),
    Case(
        "TableNotFound for a call not about a table is believed at once",
        state(),
        TableNotFound("t"),
        Action.GIVE_UP,
        None,
        backoff=False,
        forget_leader=False,
    ),
    Case(
        "a drop hearing TableNotFound after an unknown outcome is done",
        state(table_lookup=True, gone_ok=True, outcome_unknown=True),
        TableNotFound("t"),
        Action.DONE,
        None,
        backoff=False,
        forget_leader=False,
    ),
    Case(
        "a drop hearing TableNotFound with every outcome known asks on",
        state(table_lookup=True, gone_ok=True),
        TableNotFound("t"),
        Action.NEXT_SITE,
        B,
        backoff=False,
    ),
    Case(
        "an attempt without an answer in time: outcome unknown, next site",
        state(),
        DeadlineExceeded(A, 15.0),
        Action.NEXT_SITE,
        B,
        memory={"outcome_unknown": True},
    ),
    Case(
        "a proposal timeout: outcome unknown",
        state(),
        ProposalTimeout(10.0),
        Action.NEXT_SITE,
        B,
        memory={"outcome_unknown": True},
    ),
    Case(
        "a lost leadership: outcome unknown",
        state(),
        LeadershipLost("stepped down"),
        Action.NEXT_SITE,
        B,
        memory={"outcome_unknown": True},
    ),
    Case(
        "a refused connection: the outcome is known (not applied)",
        state(),
        unavailable(A),
        Action.NEXT_SITE,
        B,
        memory={"outcome_unknown": False},
    ),
    Case(
        "a silent site left for the leader the others agree on: there at once",
        state(target=A),
        Unresponsive(A, 1.3, C),
        Action.LEADER,
        C,
        backoff=False,
        memory={"outcome_unknown": True, "hint_origin": None},
    ),
    Case(
        "a silent site left after a redirect: still at once (the hedge delay bounds it)",
        state(target=B, hint=None, redirected=True, hint_origin=A),
        Unresponsive(B, 1.0, C),
        Action.LEADER,
        C,
        backoff=False,
        memory={"outcome_unknown": True, "redirected": True, "hint_origin": None},
    ),
    Case(
        "a silent site with no time left: the backoff gives up",
        state(target=A, time_left=False),
        Unresponsive(A, 1.0, C),
        Action.NEXT_SITE,
        B,
        memory={"outcome_unknown": True},
    ),
    Case(
        "a gRPC failure without a typed error is not retried",
        state(),
        RpcFailed(A, "INTERNAL", "boom"),
        Action.GIVE_UP,
        None,
        backoff=False,
        forget_leader=False,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_decide(case: Case) -> None:
    decision = decide(case.state, case.error)
    assert (decision.action, decision.target) == (case.action, case.target)
    assert (decision.backoff, decision.forget_leader) == (case.backoff, case.forget_leader)
    for name, value in case.memory.items():
        assert getattr(decision.state, name) == value, name


def walk(
    sites: tuple[str, ...], answers: dict[str, RaftStoreError | None], **call: Any
) -> list[str]:
    """The sites a call visits, performing each decision as `Session.call` does (a wait
    always succeeds), until a site answers (None) or the call stops."""
    memory = dataclasses.replace(state(sites=sites, target=sites[0]), **call)
    target, visited = sites[0], [sites[0]]
    for _ in range(20):
        error = answers[target]
        if error is None:
            return visited
        hint = None
        if isinstance(error, NotLeader) and error.leader is not None:
            hint = error.leader.rsplit(":", 1)[0]
        decision: Decision = decide(
            dataclasses.replace(memory, target=target, hint=None if hint == target else hint), error
        )
        if decision.target is None:
            return [*visited, decision.action.value]
        memory, target = decision.state, decision.target
        visited.append(target)
    raise AssertionError(f"no end: {visited}")


def test_an_unreachable_leader_hint_does_not_hide_the_other_sites() -> None:
    """Both followers name a leader this client cannot reach (a container's host name):
    the call follows the hint once, then goes through the listed sites to the leader."""
    answers: dict[str, RaftStoreError | None] = {
        A: NotLeader(f"{U}:node9", 2),
        B: NotLeader(f"{U}:node9", 2),
        U: unavailable(U),
        C: None,
    }
    assert walk((A, B, C, U), answers) == [A, U, B, C]


def test_a_table_not_yet_known_to_followers_is_found_at_the_leader() -> None:
    answers: dict[str, RaftStoreError | None] = {
        A: TableNotFound("t"),
        B: TableNotFound("t"),
        C: None,
    }
    assert walk(SITES, answers, table_lookup=True) == [A, B, C]
    gone: dict[str, RaftStoreError | None] = dict.fromkeys(SITES, TableNotFound("t"))
    assert walk(SITES, gone, table_lookup=True) == [A, B, C, "give up"]


def test_a_retried_drop_that_timed_out_takes_table_not_found_as_done() -> None:
    answers: dict[str, RaftStoreError | None] = {A: ProposalTimeout(10.0), B: TableNotFound("t")}
    assert walk(SITES, answers, table_lookup=True, gone_ok=True) == [A, B, "done"]


def test_next_site_wraps_around_and_starts_over_for_an_unknown_site() -> None:
    assert [next_site(SITES, site) for site in (A, B, C, U)] == [B, C, A, A]
    assert next_site_except(SITES, A, frozenset({B})) == C
    assert next_site_except(SITES, A, frozenset(SITES)) == B  # nothing left: plain next


# -- leaving a silent leader ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "pinned", "routed", "with_producer", "expected"),
    [
        ("Publish", False, True, True, True),
        ("Publish", False, True, False, False),  # no producer id: a resend could land twice
        ("Publish", True, True, True, False),  # pinned to its site
        ("Publish", False, False, True, False),  # no table or group: no "who leads"
        ("CommitOffset", False, True, False, True),  # sets an absolute offset
        ("GetTableInfo", False, True, False, True),
        ("GetTopicProcessedOffset", False, True, False, True),
        ("GetStreamingLeader", False, True, False, True),
        ("HaStreamTable", False, True, False, False),  # a second create: TableExists
        ("DropStreamTable", False, True, False, False),
        ("RemoveTopicOffset", False, True, False, False),
        ("TransferLeadership", False, True, False, False),
        ("GetNodeStatus", False, True, False, False),
    ],
)
def test_only_idempotent_routed_calls_are_hedged(
    method: str, pinned: bool, routed: bool, with_producer: bool, expected: bool
) -> None:
    assert hedgeable(method, pinned=pinned, routed=routed, with_producer=with_producer) is expected


def answered(leader: str | None, asked_s_ago: float = 0.1) -> SiteProbe:
    return SiteProbe(asked_s_ago, pending=False, leader=leader)


def pending(asked_s_ago: float = 0.1, leader: str | None = None) -> SiteProbe:
    return SiteProbe(asked_s_ago, pending=True, leader=leader)


def hedge_state(waited_s: float = 1.5, **probes: SiteProbe) -> HedgeState:
    """An attempt on A (delay 1 s, interval 0.25 s); probes by site name a/b/c."""
    names = {"a": A, "b": B, "c": C, "u": U}
    return HedgeState(
        target=A,
        sites=SITES,
        waited_s=waited_s,
        delay_s=1.0,
        interval_s=0.25,
        probes={names[name]: probe for name, probe in probes.items()},
    )


@dataclass(frozen=True)
class HedgeCase:
    name: str
    state: HedgeState
    step: HedgeStep


HEDGE_CASES = [
    HedgeCase("before the hedge delay: nothing is asked", hedge_state(0.9), HedgeStep(None)),
    HedgeCase("at the delay: ask every other site", hedge_state(1.0), HedgeStep(None, (B, C))),
    HedgeCase(
        "the followers still name the silent leader (no election yet): wait, ask again",
        hedge_state(b=answered(A, 0.3), c=answered(A, 0.3)),
        HedgeStep(None, (B, C)),
    ),
    HedgeCase(
        "asked within the interval: not again yet",
        hedge_state(b=answered(A, 0.1), c=answered(A, 0.3)),
        HedgeStep(None, (C,)),
    ),
    HedgeCase(
        "one question per site at a time: an unanswered one is not repeated",
        hedge_state(b=pending(0.9), c=answered(A, 0.3)),
        HedgeStep(None, (C,)),
    ),
    HedgeCase(
        "both followers name the new leader, which names itself: move",
        hedge_state(b=answered(B), c=answered(B)),
        HedgeStep(B),
    ),
    HedgeCase(
        "the new leader alone answers, naming itself: move",
        hedge_state(b=answered(B), c=pending(0.5)),
        HedgeStep(B),
    ),
    HedgeCase(
        "the new leader names itself, the other follower still the old one: a tie, wait",
        hedge_state(b=answered(B), c=answered(A)),
        HedgeStep(None),
    ),
    HedgeCase(
        "a node named by the other but not by itself (it lost it again): wait",
        hedge_state(b=answered(None), c=answered(B)),
        HedgeStep(None),
    ),
    HedgeCase(
        "a named leader that did not answer (unreachable from here): wait",
        hedge_state(b=answered(None), c=answered(U), u=answered(None)),
        HedgeStep(None),
    ),
    HedgeCase(
        "an election under way (nobody named): wait, ask again",
        hedge_state(b=answered(None, 0.3), c=answered(None, 0.3)),
        HedgeStep(None, (B, C)),
    ),
    HedgeCase(
        "a live but slow leader: the others name it: wait",
        hedge_state(5.0, b=answered(A), c=answered(A)),
        HedgeStep(None),
    ),
    HedgeCase(
        "a pending re-question keeps the site's last answer",
        hedge_state(b=pending(0.05, leader=B), c=answered(B)),
        HedgeStep(B),
    ),
]


@pytest.mark.parametrize("case", HEDGE_CASES, ids=[case.name for case in HEDGE_CASES])
def test_hedge(case: HedgeCase) -> None:
    assert hedge(case.state) == case.step


def test_agreed_leader_needs_a_majority_of_the_named_and_its_own_word() -> None:
    assert agreed_leader({}) is None
    assert agreed_leader({B: answered(B), C: answered(B), U: answered(A)}) == B
    assert agreed_leader({B: answered(C), C: answered(B)}) is None  # each names the other
    assert agreed_leader({B: answered(None), C: answered(C)}) == C  # "none" is no vote
