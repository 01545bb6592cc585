"""Where `Session.call` goes after a failed attempt: one pure decision, tested by table.

`decide(state, error) -> Decision` reads the failed attempt (its site, the session's sites,
whether the call has time left, the leader the failure named) and the call's memory of its
earlier failures, and answers with one action:

| action | when | backs off first |
|---|---|---|
| `GIVE_UP` | a non-retryable error; TableNotFound once every known site said so | - |
| `DONE` | a drop whose earlier attempt had an unknown outcome now hears TableNotFound | - |
| `NEXT_SITE` | TableNotFound from a site not asked yet: ask the next untried one | no |
| `LEADER` | the first NotLeader that names another node in this call | no |
| `NEXT_SITE` | a named leader turned out unreachable: resume after the site that named it | yes |
| `SAME_SITE` | the call is pinned to its site, or the leader is Overloaded (busy, not gone) | yes |
| `LEADER` | a later NotLeader that names another (reachable) node | yes |
| `NEXT_SITE` | any other retryable error | yes |

The shell (`Session.call`) performs it: it forgets the failed site as the table's leader
when told, waits on its `Backoff` when told (and raises the error if the wait runs out),
then sends the next attempt. The waits are the only thing that bounds the retries, so
every action that does not wait moves to a site this call cannot move to again that way:
an untried one, or the first leader hint, or the leader an `Unresponsive` attempt was left
for (that attempt waited at least the hedge delay).

**Leaving a silent leader** (`hedge`, `hedgeable`). A leader cut off by the network or
frozen answers nothing and resets nothing: the attempt would wait for its deadline, or for
HTTP/2 keepalive (5 s after a ping). While an attempt of an idempotent call is outstanding
past a short hedge delay, the shell asks the other sites who leads (GetStreamingLeader, a
local read on each node) every `interval_s`; `hedge` reads their answers:

| when | step |
|---|---|
| the attempt has waited less than the hedge delay | wait |
| another site names itself, and most sites that name a leader name it | move there |
| otherwise | wait; ask every site not asked within `interval_s` |

Moving means: cancel the attempt, and fail it as `Unresponsive(site, waited_s, leader)`,
which `decide` sends to that leader at once. A site is asked again only once its last
question was answered or timed out.

Before the cut-off leader's followers elect another, they still name it: the client waits,
as it must. A slow but live leader is named by the others too: the client waits for it.
Only idempotent requests are left this way (`hedgeable`): a publish with a producer id and
sequence (a resend is answered from the producer window), an offset commit (it sets an
absolute value), and reads. The leader left behind may still apply the request before it
learns it lost its leadership; Raft then keeps or drops it with the rest of its log, and
the resend is deduplicated: the outcome is unknown, as for a timeout.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from api_clients.transport import DeadlineExceeded, TransportError, Unresponsive
from hastream.errors import (
    LeadershipLost,
    NodeUnavailable,
    NotLeader,
    Overloaded,
    ProposalTimeout,
    RaftStoreError,
    TableNotFound,
)


class Action(enum.Enum):
    SAME_SITE = "same site"  # try the failed site again
    LEADER = "leader"  # go to the leader the failure named
    NEXT_SITE = "next site"  # try another site
    GIVE_UP = "give up"  # raise the error
    DONE = "done"  # the call's effect is known to have happened: return without an answer


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptState:
    """What `decide` knows when an attempt of a call failed."""

    # The failed attempt, filled in by the shell at each failure.
    target: str  # the site it went to
    sites: tuple[str, ...]  # the session's known sites, in order (a named leader included)
    time_left: bool  # the call's deadline has not passed
    hint: str | None = None  # the leader the failure named, as host:port; None: no usable one
    # The call, fixed for its life.
    pinned: bool = False  # the call names its site: never leave it
    table_lookup: bool = False  # a call about a table: TableNotFound needs every site's word
    gone_ok: bool = False  # a drop: TableNotFound after an unknown outcome means it is done
    # The call's memory of its earlier failures, carried on by `Decision.state`.
    redirected: bool = False  # a leader hint was followed at once already
    hint_origin: str | None = None  # the site whose hint `target` was
    unreachable_hints: frozenset[str] = frozenset()  # hinted leaders that could not be reached
    not_found: frozenset[str] = frozenset()  # sites that answered TableNotFound
    outcome_unknown: bool = False  # an attempt failed after the request may have been applied


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    action: Action
    target: str | None  # where the next attempt goes; None for GIVE_UP and DONE
    backoff: bool  # wait on the call's Backoff before it (and give up when that runs out)
    forget_leader: bool  # stop routing the table (and its group) to the failed site
    state: AttemptState  # the memory the next failure is decided with


def outcome_unknown(error: RaftStoreError) -> bool:
    """Whether the failed attempt may have been applied anyway."""
    return isinstance(error, ProposalTimeout | LeadershipLost | DeadlineExceeded | Unresponsive)


def leader_named(error: RaftStoreError) -> str | None:
    """The leader a failure names, as the node or the hedge said it (NotLeader: the node's
    `host:port:alias`, None during an election; Unresponsive: `host:port`)."""
    if isinstance(error, NotLeader):
        return error.leader
    if isinstance(error, Unresponsive):
        return error.leader
    return None


def unreachable(error: RaftStoreError) -> bool:
    """Whether the site did not serve the attempt at all (a hinted leader behind this is
    not followed again in the same call)."""
    return isinstance(error, TransportError | NodeUnavailable)


def next_site(sites: tuple[str, ...], site: str) -> str:
    """The site after `site` in `sites`, wrapping around (the first if `site` is unknown)."""
    if site not in sites:
        return sites[0]
    return sites[(sites.index(site) + 1) % len(sites)]


def next_site_except(sites: tuple[str, ...], site: str, skip: frozenset[str]) -> str:
    """The first site after `site` (wrapping around) that is not in `skip`."""
    candidate = site
    for _ in range(len(sites) + 1):
        candidate = next_site(sites, candidate)
        if candidate not in skip:
            return candidate
    return next_site(sites, site)


def untried_site(sites: Iterable[str], not_found: Container[str]) -> str | None:
    """The first of `sites` that has not answered TableNotFound, None once every one has. A
    follower that has not applied a table's creation yet answers it before it looks at
    leadership: a call, stream or read about a table believes it only from every site."""
    return next((site for site in sites if site not in not_found), None)


def decide(state: AttemptState, error: RaftStoreError) -> Decision:
    """The next step of a call whose attempt on `state.target` failed with `error`."""
    assert state.sites, "a session has at least one site"
    if isinstance(error, TableNotFound):
        if state.gone_ok and state.outcome_unknown:
            return _stop(Action.DONE, state)
        if state.table_lookup:
            # A follower that has not applied the table's creation yet answers this before it
            # looks at leadership: ask every known site before believing it.
            state = dataclasses.replace(state, not_found=state.not_found | {state.target})
            untried = untried_site(state.sites, state.not_found)
            if untried is not None and state.time_left:
                return Decision(
                    action=Action.NEXT_SITE,
                    target=untried,
                    backoff=False,
                    forget_leader=True,
                    state=state,
                )
    if not error.retryable:
        return _stop(Action.GIVE_UP, state)
    if isinstance(error, Unresponsive) and state.time_left and not state.pinned:
        # The other sites agree on another leader, and the attempt waited the hedge delay
        # already (which bounds these moves): resend there at once.
        memory = dataclasses.replace(state, hint_origin=None, outcome_unknown=True)
        return _go(Action.LEADER, error.leader, memory, backoff=False)
    return _retry(state, error)


def decide_after(
    memory: AttemptState,
    error: RaftStoreError,
    *,
    target: str,
    sites: tuple[str, ...],
    time_left: bool,
    hint: str | None,
) -> Decision:
    """`decide` for the attempt on `target` that failed with `error`, with what the session
    knows now (its sites, whether time is left, the leader the error named)."""
    state = dataclasses.replace(memory, target=target, sites=sites, time_left=time_left, hint=hint)
    return decide(state, error)


def _retry(state: AttemptState, error: RaftStoreError) -> Decision:
    resume_after: str | None = None
    unreachable_hints = state.unreachable_hints
    if state.hint_origin is not None and unreachable(error):
        # `target` was a hint (e.g. a container host name that does not resolve here): go on
        # with the site after the one that named it, so every listed site gets its turn.
        unreachable_hints = unreachable_hints | {state.target}
        resume_after = state.hint_origin
    hint = None if state.pinned or state.hint in unreachable_hints else state.hint
    memory = dataclasses.replace(
        state,
        hint_origin=None,
        unreachable_hints=unreachable_hints,
        outcome_unknown=state.outcome_unknown or outcome_unknown(error),
    )
    if hint is not None and not state.redirected and state.time_left:
        # The first redirect goes at once; later ones back off.
        memory = dataclasses.replace(memory, redirected=True, hint_origin=state.target)
        return _go(Action.LEADER, hint, memory, backoff=False)
    if resume_after is not None:
        target = next_site_except(state.sites, resume_after, unreachable_hints)
        return _go(Action.NEXT_SITE, target, memory, backoff=True)
    if state.pinned or isinstance(error, Overloaded):
        # Overloaded: the leader is busy, not gone; another site would only redirect here.
        return _go(Action.SAME_SITE, state.target, memory, backoff=True)
    if hint is not None:
        memory = dataclasses.replace(memory, hint_origin=state.target)
        return _go(Action.LEADER, hint, memory, backoff=True)
    return _go(Action.NEXT_SITE, next_site(state.sites, state.target), memory, backoff=True)


def _go(action: Action, target: str, state: AttemptState, *, backoff: bool) -> Decision:
    return Decision(action=action, target=target, backoff=backoff, forget_leader=True, state=state)


def _stop(action: Action, state: AttemptState) -> Decision:
    return Decision(action=action, target=None, backoff=False, forget_leader=False, state=state)


# -- leaving a silent leader ---------------------------------------------------------------

# Calls whose attempt may be abandoned while outstanding and sent again elsewhere: sending
# one twice changes nothing. Publish only with a producer id (checked by `hedgeable`).
HEDGEABLE_METHODS: Final = frozenset(
    {
        "Publish",
        "CommitOffset",
        "GetTableInfo",
        "GetOffsetForTime",
        "GetTopicProcessedOffset",
        "GetStreamingLeader",
    }
)


def hedgeable(method_name: str, *, pinned: bool, routed: bool, with_producer: bool) -> bool:
    """Whether an outstanding attempt of this call may be left for another leader: an
    idempotent method (a Publish only with its producer id), routed by a table or group
    (so "who leads" has an answer), and not pinned to its site."""
    if pinned or not routed or method_name not in HEDGEABLE_METHODS:
        return False
    return method_name != "Publish" or with_producer


@dataclass(frozen=True, slots=True)
class SiteProbe:
    """The latest question "who leads?" to one site."""

    asked_s_ago: float  # since it was sent
    pending: bool  # not answered yet (nor failed)
    leader: str | None = None  # host:port the site named in its latest answer; None: none


@dataclass(frozen=True, slots=True, kw_only=True)
class HedgeState:
    """What `hedge` knows while an attempt on `target` is outstanding."""

    target: str
    sites: tuple[str, ...]  # the session's known sites
    waited_s: float  # how long the attempt (or stream) has gone without an answer
    delay_s: float  # the hedge delay: before it, nothing is asked
    interval_s: float  # how often one site is asked again
    probes: Mapping[str, SiteProbe]  # by site; a site not in it was never asked


@dataclass(frozen=True, slots=True)
class HedgeStep:
    move_to: str | None  # cancel the attempt and resend it there; None: keep waiting
    probe: tuple[str, ...] = ()  # ask these sites who leads now


def agreed_leader(probes: Mapping[str, SiteProbe]) -> str | None:
    """The leader most answering sites name, if it answered naming itself."""
    named = [probe.leader for probe in probes.values() if probe.leader is not None]
    for leader in dict.fromkeys(named):
        votes = named.count(leader)
        own = probes.get(leader)
        if 2 * votes > len(named) and own is not None and own.leader == leader:
            return leader
    return None


def hedge(state: HedgeState) -> HedgeStep:
    """The next step while an attempt on `state.target` has no answer (see the module
    docstring's table)."""
    if state.waited_s < state.delay_s:
        return HedgeStep(None)
    leader = agreed_leader(state.probes)
    if leader is not None and leader != state.target:
        return HedgeStep(leader)
    due = tuple(
        site
        for site in state.sites
        if site != state.target
        and (
            (probe := state.probes.get(site)) is None
            or (not probe.pending and probe.asked_s_ago >= state.interval_s)
        )
    )
    return HedgeStep(None, due)
