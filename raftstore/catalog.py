"""One name, one table: table names are unique across every Raft group of the cluster.

The decision lives in one place, the log of the *catalog group* (the lowest configured group
id): before a group creates a table, its leader claims the name there (`ClaimName`, with a
fresh nonce); the claim fails with TableExists when another group holds the name. The same
log orders concurrent claims, so two clients creating one name in two groups cannot both
win. A drop releases the claim after the table's drop commits; a release carries the
claim's nonce and undoes nothing else.

A claim whose table never came to be (the creating leader died between the claim and the
create, or the create was refused) would keep the name taken. Each group's leader therefore
reconciles now and then (`reconcile`): once it has applied everything committed before its
term (so no create of an earlier leader is still in flight), a claim of its group for a
table it does not hold, and that it is not creating right now, is released. A table it holds
without a claim (written by an older version) is claimed.

The catalog group also keeps the users and grants (access.py): a node that is a member reads
them from its own replica; any other node, and a member whose copy refuses a login or a
token, fetches the leader's and keeps it for ACCESS_CACHE_S. Changes are proposed on the
catalog group's leader (NotLeader elsewhere, so the client follows it there).

Threads: request threads call `create`, `drop` and the access calls; the node's
housekeeping thread calls `reconcile`, its watch thread `bootstrap_admin`. A lock per group
serialises create, drop and reconcile on the leader, so reconcile never releases a name
whose create is between its claim and its commit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

from hastream.errors import (
    InvalidArgument,
    LeadershipLost,
    NodeUnavailable,
    NotLeader,
    ProposalTimeout,
    RaftStoreError,
    TableExists,
    UnknownGroup,
)
from hastream.model import NodeAddress
from raftstore import commands
from raftstore.access import BOOTSTRAP_ADMIN, AccessControl
from raftstore.group import Group
from raftstore.peers import PeerClient
from raftstore.state_machine import TableView

log = logging.getLogger(__name__)

_ATTEMPTS: Final = 6
# How long a node outside the catalog group trusts its copy of the users and grants: a
# revoke or a password reset reaches it within this long.
ACCESS_CACHE_S: Final = 1.0
_RETRY_S: Final = 0.2

T = TypeVar("T")


class Catalog:
    def __init__(
        self,
        catalog_group_id: int,
        local_catalog: Group | None,
        members: dict[str, NodeAddress],
        peers: PeerClient,
    ) -> None:
        """`local_catalog`: this node's replica of the catalog group, if it is a member.
        `members`: the catalog group's members, alias -> the address peers dial."""
        self.group_id = catalog_group_id
        self._local = local_catalog
        self._members = members
        self._peers = peers
        self._locks: dict[int, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._creating: set[tuple[int, str]] = set()
        self._access_lock = threading.Lock()
        self._access_copy: tuple[float, AccessControl] | None = None

    def _lock(self, group_id: int) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(group_id, threading.Lock())

    # --- table lifecycle (request threads) ----------------------------------------------

    def create(self, group: Group, command: commands.CreateTable) -> TableView:
        """Claim the name, then create the table in `group`. Raises TableExists when another
        group holds the name, and whatever the create raises (the claim is released when
        the create was refused; left to `reconcile` when its outcome is unknown)."""
        group.require_leader()
        group.applier.machine.validate_create(command)  # refused here: nothing is claimed
        key = (group.group_id, command.table)
        nonce = os.urandom(commands.NONCE_BYTES)
        with self._lock(group.group_id):
            self._creating.add(key)
        try:
            self._claim(command.table, group.group_id, nonce)
            try:
                return group.create_table(command)
            except (InvalidArgument, NotLeader, NodeUnavailable):
                # Refused before it was proposed (or at apply): no such table; free the name.
                # (TableExists from the group itself means the table does exist: keep it.)
                self._release_quietly(command.table, group.group_id, nonce)
                raise
        finally:
            with self._lock(group.group_id):
                self._creating.discard(key)

    def drop(self, group: Group, table: str, *, force: bool) -> None:
        """Drop the table in `group`, then release its name."""
        group.drop_table(table, force=force)
        claim = self._claims().get(table)
        if claim is not None and claim[0] == group.group_id:
            self._release_quietly(table, group.group_id, claim[1])

    # --- reconciling (housekeeping thread) ----------------------------------------------

    def reconcile(self, group: Group) -> None:
        """Release this group's claims on tables it does not hold; claim the tables it holds
        without one. Only on a leader that has applied its predecessors' entries."""
        if not group.leads_and_ready():
            return
        claims = self._claims()
        with self._lock(group.group_id):
            if not group.leads_and_ready():
                return
            held = set(group.table_names())
            creating = {table for gid, table in self._creating if gid == group.group_id}
            stale = {
                table: nonce
                for table, (gid, nonce) in claims.items()
                if gid == group.group_id and table not in held and table not in creating
            }
            unclaimed = sorted(table for table in held if table not in claims)
            for table, nonce in sorted(stale.items()):
                log.info("releasing a stale name claim group=%d table=%s", group.group_id, table)
                self._release_quietly(table, group.group_id, nonce)
        for table in unclaimed:
            try:
                self._claim(table, group.group_id, os.urandom(commands.NONCE_BYTES))
            except TableExists as error:
                log.error(
                    "table %s exists in group %d and is claimed by group %s",
                    table,
                    group.group_id,
                    error.group_id,
                )
            except RaftStoreError as error:
                log.warning("claiming %s for group %d failed: %s", table, group.group_id, error)

    # --- the catalog group, local or through its leader ---------------------------------

    def _claim(self, table: str, group_id: int, nonce: bytes) -> None:
        command = commands.ClaimName(table=table, group_id=group_id, nonce=nonce)
        self._on_catalog_leader(
            lambda catalog: catalog.propose_command(command),
            lambda peer: self._peers.claim_name(peer, table, group_id, nonce),
        )

    def _release_quietly(self, table: str, group_id: int, nonce: bytes) -> None:
        command = commands.ReleaseName(table=table, group_id=group_id, nonce=nonce)
        try:
            self._on_catalog_leader(
                lambda catalog: catalog.propose_command(command),
                lambda peer: self._peers.release_name(peer, table, group_id, nonce),
            )
        except RaftStoreError as error:
            # The claim stays; the owning group's leader releases it when it reconciles.
            log.warning("releasing name %s failed (reconcile retries): %s", table, error)

    def authoritative_claims(self) -> dict[str, tuple[int, bytes]]:
        """Every claimed name as the catalog group's leader has applied them, so every
        committed claim: a name missing here was never claimed (or was released). Raises
        NodeUnavailable (or NotLeader) when no leader answers within a few attempts."""
        return self._on_catalog_leader(
            _leader_claims, lambda peer: self._peers.name_claims(peer, self.group_id)
        )

    def _claims(self) -> dict[str, tuple[int, bytes]]:
        """The catalog as applied by the local replica or a member (may lag: a stale view
        only delays a release, which is conditional on the claim's nonce anyway)."""
        if self._local is not None:
            return self._local.applier.machine.name_claims()
        last: RaftStoreError = NodeUnavailable("no member of the catalog group answered")
        for peer in self._members.values():
            try:
                return self._peers.name_claims(peer, self.group_id)
            except RaftStoreError as error:
                last = error
        raise last

    def _on_catalog_leader(
        self, local: Callable[[Group], T], remote: Callable[[NodeAddress], T]
    ) -> T:
        """Run a proposal (or a read) on the catalog group's leader: here when this node
        leads it, else by a peer call, following NotLeader hints; a few bounded attempts."""
        target: NodeAddress | None = None
        last: RaftStoreError = NodeUnavailable("the catalog group has no leader")
        for attempt in range(_ATTEMPTS):
            try:
                if self._local is not None and self._local.is_leader():
                    return local(self._local)
                peer = target or self._guess_leader(attempt)
                if peer is None:
                    raise NodeUnavailable("the catalog group has no known leader")
                return remote(peer)
            except NotLeader as error:
                target = self._member(error.leader)
                last = error
            except (LeadershipLost, ProposalTimeout, NodeUnavailable) as error:
                target = None
                last = error
            time.sleep(_RETRY_S * (attempt + 1))  # bounded: _ATTEMPTS tries
        raise last

    def _guess_leader(self, attempt: int) -> NodeAddress | None:
        if self._local is not None:
            leader = self._local.leader()
            if leader is not None:
                return self._members.get(leader.alias)
        members = list(self._members.values())
        return members[attempt % len(members)] if members else None

    def _member(self, advertised: str | None) -> NodeAddress | None:
        """The internal address of the member a NotLeader hint names (host:port:alias)."""
        if advertised is None:
            return None
        return self._members.get(NodeAddress.parse(advertised).alias)

    # --- serving peers (request threads on a catalog member) ----------------------------

    def serve_claim(self, table: str, group_id: int, nonce: bytes) -> None:
        catalog = self._require_local()
        catalog.require_leader()
        catalog.propose_command(commands.ClaimName(table=table, group_id=group_id, nonce=nonce))

    def serve_release(self, table: str, group_id: int, nonce: bytes) -> None:
        catalog = self._require_local()
        catalog.require_leader()
        catalog.propose_command(commands.ReleaseName(table=table, group_id=group_id, nonce=nonce))

    def serve_claims(self) -> dict[str, tuple[int, bytes]]:
        """The claims, from the catalog group's leader only (NotLeader elsewhere)."""
        catalog = self._require_local()
        if not catalog.is_leader():
            raise catalog.not_leader()
        return _leader_claims(catalog)

    # --- users and grants -------------------------------------------------------------

    def access_control(self) -> AccessControl:
        """The users and grants to decide a call with: this node's catalog replica's (may
        lag the leader by a moment), else the leader's (`leader_access_control`)."""
        if self._local is not None:
            return self._local.applier.machine.access
        return self.leader_access_control()

    def leader_access_control(self, *, fresh: bool = False) -> AccessControl:
        """The users and grants as the catalog group's ready leader has applied them (every
        committed change), cached for ACCESS_CACHE_S: what a login or token that the local
        copy refuses is checked against before it is refused (a node just restarted, or a
        follower a moment behind, has not applied the newest user or password yet).
        `fresh`: a copy fetched after this call began (a grant acknowledged a moment ago
        must count). Raises NodeUnavailable or NotLeader when no leader answers."""
        asked = time.monotonic()
        with self._access_lock:  # one fetch at a time; the others wait for its answer
            copy = self._access_copy
            if copy is not None and (
                copy[0] >= asked if fresh else time.monotonic() - copy[0] < ACCESS_CACHE_S
            ):
                return copy[1]
            document = self._on_catalog_leader(
                lambda catalog: _leader_access(catalog).to_json(),
                lambda peer: self._peers.access_control(peer, self.group_id),
            )
            try:
                access = AccessControl.from_json(document)
            except (ValueError, TypeError, KeyError, InvalidArgument) as error:
                reason = f"malformed access control from the leader: {error}"
                raise NodeUnavailable(reason) from None
            self._access_copy = (time.monotonic(), access)
            return access

    def change_access(self, command: commands.Command) -> None:
        """Propose a PutUser, DeleteUser or SetRule on the catalog group's leader (this
        node). Raises NotLeader (naming the leader), NodeUnavailable (this node is not a
        member: ask another), or the command's own error (UserExists...)."""
        catalog = self._local
        if catalog is None:
            raise NodeUnavailable(
                f"this node is not in the catalog group {self.group_id}: ask one of its members"
            )
        catalog.require_leader()
        catalog.propose_command(command)

    def bootstrap_admin(self, password_hash: Callable[[], bytes]) -> bool:
        """On the catalog group's ready leader of a cluster without users: propose the first
        admin (`access.BOOTSTRAP_ADMIN`), hashing its password now. True once users exist."""
        catalog = self._local
        if catalog is None:
            return False
        if catalog.applier.machine.access.has_users():
            return True
        if not catalog.leads_and_ready():
            return False
        command = commands.PutUser(
            BOOTSTRAP_ADMIN, password_hash(), admin=True, mode=commands.UserMode.BOOTSTRAP
        )
        catalog.propose_command(command)  # a no-op if another leader's came first
        log.info("created the first admin user %r", BOOTSTRAP_ADMIN)
        return True

    def serve_access(self) -> list[dict[str, Any]]:
        """The users and grants from the catalog group's leader only (NotLeader elsewhere)."""
        catalog = self._require_local()
        if not catalog.is_leader():
            raise catalog.not_leader()
        return _leader_access(catalog).to_json()

    def _require_local(self) -> Group:
        if self._local is None:
            raise UnknownGroup(self.group_id)
        return self._local


def _leader_access(catalog: Group) -> AccessControl:
    """The catalog leader's users and grants, once it applied everything before its term."""
    if not catalog.leads_and_ready():
        raise NodeUnavailable(f"catalog group {catalog.group_id} leader is not ready")
    return catalog.applier.machine.access


def _leader_claims(catalog: Group) -> dict[str, tuple[int, bytes]]:
    """The catalog leader's claims, once it applied everything committed before its term."""
    if not catalog.leads_and_ready():
        raise NodeUnavailable(f"catalog group {catalog.group_id} leader is not ready")
    return catalog.applier.machine.name_claims()
