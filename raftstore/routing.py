"""Which group on this node serves a request for a table (no I/O, no gRPC)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final

from hastream.errors import NodeUnavailable, RaftStoreError, TableNotFound
from hastream.model import LOCAL_GROUP
from raftstore.group import Group

# The group the catalog of table names (catalog.py) says owns a name: its id, NO_OWNER for a
# name never claimed (or released), None when the catalog cannot be asked right now.
NameOwner = Callable[[str], int | None]
NO_OWNER: Final = -1


def group_of(
    groups: Sequence[Group],
    table: str,
    *,
    leader_only: bool = False,
    owner_of: NameOwner | None = None,
) -> Group:
    """The group holding `table` on this node.

    A table this node does not hold may exist elsewhere (in a group this node is not in) or
    not have reached this replica yet. The catalog decides: a name it never claimed is
    TableNotFound on every node alike, so a client asking any site gets the same answer. A
    claimed name is TableNotFound only on its group's leader (claimed, not created yet, or
    dropped, not released yet); elsewhere the client is sent on (NotLeader with the leader,
    or a retryable NodeUnavailable) instead of a wrong TableNotFound. Without the catalog, a
    node that leads (and has applied) every group it is in knows their tables for sure;
    one that does not sends the client on, reads included (NotLeader with the leader of a
    one-group node, else a retryable NodeUnavailable): leading one group says nothing of
    a table another group holds.

    A lagging replica may hold one name in two groups for a moment (dropped in one, not yet
    applied here, and created again in the other): the catalog's owner is served, and while
    the catalog cannot answer, neither (NodeUnavailable, retryable).

    "Not found" is said only after a second look, taken once the leader was seen ready:
    the first may predate the apply of the creation that readiness waited for. (A seeded
    chaos run with long logs saw pipelines fail "table not found" as a restarted leader
    became ready; the client believed it, every other site pointing at that leader.)"""
    held = _held_here(groups, table, owner_of)
    if held is not None:
        return held
    owner = owner_of(table) if owner_of is not None else None
    if owner == NO_OWNER:
        raise TableNotFound(table)
    if owner is not None:
        return _not_here_yet(groups, table, owner, leader_only=leader_only)
    raft_groups = [group for group in groups if group.group_id != LOCAL_GROUP]
    if raft_groups and not all(group.leads_and_ready() for group in raft_groups):
        # A group this node does not lead (or has not caught up in) may hold the table
        # already: leading another group proves nothing about it.
        if leader_only and len(raft_groups) == 1:
            hint = raft_groups[0].not_leader()
            if hint.leader is not None:
                raise hint
        raise NodeUnavailable(
            f"table {table!r} unknown here, the catalog cannot be asked now and this node "
            "does not lead every group it is in"
        )
    held = _held_here(groups, table, None)  # applied since the first look, maybe
    if held is not None:
        return held
    raise TableNotFound(table)


def _held_here(groups: Sequence[Group], table: str, owner_of: NameOwner | None) -> Group | None:
    """The group on this node holding `table` (None: none does). Two hold it while a
    replica lags: the catalog's owner (asked only then), NodeUnavailable when it cannot
    say."""
    holding = [group for group in groups if group.has_table(table)]
    if len(holding) == 1:
        return holding[0]
    if holding:
        owner = owner_of(table) if owner_of is not None else None
        for group in holding:
            if group.group_id == owner:
                return group
        raise NodeUnavailable(f"table {table!r} is in two groups here while a replica lags")
    return None


def _not_here_yet(groups: Sequence[Group], table: str, owner: int, *, leader_only: bool) -> Group:
    """`table` is claimed by group `owner` but this replica does not hold it: only the
    owner's leader knows it is not created yet (or being dropped); anywhere else the
    client is sent on (NotLeader with the leader, or a retryable NodeUnavailable)."""
    group = next((group for group in groups if group.group_id == owner), None)
    if group is None:
        raise NodeUnavailable(f"table {table!r} is in group {owner}, which this node is not in")
    if group.leads_and_ready():
        if group.has_table(table):
            return group  # applied since the first look, before the leader was ready
        raise TableNotFound(table)
    if leader_only:
        hint = group.not_leader()
        if hint.leader is not None:
            raise hint
    raise NodeUnavailable(f"table {table!r} has not reached this replica of group {owner} yet")


def owner_in(claims: Callable[[], dict[str, tuple[int, bytes]]]) -> NameOwner:
    """A NameOwner over a catalog's claims (None when the catalog cannot be read)."""

    def owner(table: str) -> int | None:
        try:
            claim = claims().get(table)
        except RaftStoreError:
            return None
        return NO_OWNER if claim is None else claim[0]

    return owner


def one_group_per_name(tables: dict[int, list[str]], owner_of: NameOwner) -> dict[int, list[str]]:
    """Tables per group as listed to clients: a name a lagging replica holds in two groups is
    listed under the catalog's owner only (under neither while the catalog cannot answer)."""
    counts = Counter(name for names in tables.values() for name in names)
    doubled = {name for name, count in counts.items() if count > 1}
    if not doubled:
        return tables
    owners = {name: owner_of(name) for name in doubled}
    return {
        group_id: [name for name in names if name not in doubled or owners[name] == group_id]
        for group_id, names in tables.items()
    }


def table_count(groups: Sequence[Group]) -> int:
    """Tables held on this node, every group counted (the per-node table limit)."""
    return sum(len(group.table_names()) for group in groups)
