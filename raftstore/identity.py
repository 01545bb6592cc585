"""A node's durable identity, and what it does when it finds its Raft state lost or damaged.

A Raft member that forgets its log or its vote and starts as a blank voter can vote a
candidate that lacks committed entries into office: acknowledged rows would be lost. So a
node writes its identity once, at first start (`node.identity` in both of its roots,
streamingHADir and persistenceDir: alias, layout version, the groups it joined), and at
every start checks what it finds against it:

- no identity, no data: a new node; the identity is written (durably) before anything else.
- no identity, but data in its directories: written by an older layout, or the identity was
  lost; it refuses to start (the operator wipes or moves the directories).
- an identity, and a group it joined whose Raft state (raft.meta) is gone, or whose Raft log
  or checkpoint fails its checks: it refuses to start that group as a voter. With
  `--rejoin GROUP` (or `streamingAutoRejoin=true`) the group's Raft directory is moved aside
  and the group starts *rejoining*: an empty replica that takes the leader's log or
  checkpoint, neither votes nor stands for election nor acknowledges entries, and becomes a
  normal member once it holds everything the leader had committed when it first heard from
  it (replication.py). The rejoin marker is durable, so a crash meanwhile resumes it.
- the streamingHADir identity gone but the persistenceDir one present: the Raft state was
  lost with its disk; every group must rejoin (the same rule).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from hastream.errors import CorruptionError
from raftstore.storage import checkpoint, group_checkpoint
from raftstore.storage.files import REAL_FILES, ensure_dir
from raftstore.storage.format import FormatError
from raftstore.storage.journal import META_KIND, DurableJournal, segment_paths

log = logging.getLogger(__name__)

IDENTITY_FILE: Final = "node.identity"
IDENTITY_KIND: Final = b"NODE"
LAYOUT_VERSION: Final = 2  # table files per incarnation, checkpoint layout 2
REJOIN_MARKER: Final = "rejoin"


class StartRefused(Exception):
    """The node must not start as it is: `reason` says why and what the operator can do."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class Identity:
    alias: str
    layout: int
    groups: tuple[int, ...]
    created_ms: int

    def to_json(self) -> bytes:
        document = {
            "alias": self.alias,
            "layout": self.layout,
            "groups": list(self.groups),
            "created_ms": self.created_ms,
        }
        return json.dumps(document, sort_keys=True).encode()

    @classmethod
    def from_json(cls, body: bytes) -> Identity:
        document: dict[str, Any] = json.loads(body)
        return cls(
            alias=str(document["alias"]),
            layout=int(document["layout"]),
            groups=tuple(int(group) for group in document["groups"]),
            created_ms=int(document["created_ms"]),
        )


def group_raft_dir(ha_dir: Path, group_id: int) -> Path:
    return ha_dir / f"group-{group_id}"


def check_and_record(
    alias: str,
    ha_dir: Path,
    persistence_dir: Path,
    groups: Iterable[int],
    *,
    rejoin: frozenset[int],
    auto_rejoin: bool,
) -> None:
    """Check this node's directories against its identity (see the module docstring), mark
    groups that must rejoin, and record the identity. Raises StartRefused."""
    groups = tuple(sorted(groups))
    raft_identity = _read(ha_dir / IDENTITY_FILE)
    data_identity = _read(persistence_dir / IDENTITY_FILE)
    identity = raft_identity or data_identity
    if identity is None:
        _refuse_unknown_data(ha_dir, persistence_dir, groups)
        identity = Identity(alias, LAYOUT_VERSION, (), int(time.time() * 1000))
    elif identity.alias != alias:
        raise StartRefused(
            f"{ha_dir} belongs to node {identity.alias!r}, not {alias!r}: check cluster.cfg"
        )
    elif identity.layout != LAYOUT_VERSION:
        raise StartRefused(
            f"{ha_dir} was written with data layout {identity.layout}; this version reads "
            f"{LAYOUT_VERSION}: move the node's directories away and let it catch up"
        )
    raft_state_lost = raft_identity is None and data_identity is not None
    for group_id in groups:
        if group_id not in identity.groups:
            _initialise_group(group_raft_dir(ha_dir, group_id))  # joined now: a new member
            continue
        problem = "its Raft directory was lost" if raft_state_lost else None
        problem = problem or _raft_state_problem(group_raft_dir(ha_dir, group_id))
        if problem is None:
            continue
        if group_id in rejoin or auto_rejoin:
            prepare_rejoin(group_raft_dir(ha_dir, group_id), problem)
        else:
            raise StartRefused(
                f"raft group {group_id}: {problem}. The node must not vote with a lost log; "
                f"start it with --rejoin {group_id} (or set streamingAutoRejoin=true) to "
                "rebuild the group's state from its peers"
            )
    recorded = Identity(
        alias, LAYOUT_VERSION, tuple(sorted({*identity.groups, *groups})), identity.created_ms
    )
    for root, on_disk in ((ha_dir, raft_identity), (persistence_dir, data_identity)):
        # Rewritten only when it changes: a restart writes nothing here, so a node whose
        # disk filled up still starts (its writes wait in doubt until space is freed).
        if on_disk != recorded:
            ensure_dir(REAL_FILES, root, root=root)
            checkpoint.write_atomic(root / IDENTITY_FILE, IDENTITY_KIND, recorded.to_json())


def _read(path: Path) -> Identity | None:
    try:
        body = checkpoint.read_checked(path, IDENTITY_KIND)
    except FileNotFoundError:
        return None
    except CorruptionError as error:
        raise StartRefused(f"{path} is damaged ({error.detail}); restore or remove it") from None
    try:
        return Identity.from_json(body)
    except (ValueError, KeyError, TypeError) as error:
        raise StartRefused(f"{path} is not a node identity: {error}") from None


def _refuse_unknown_data(ha_dir: Path, persistence_dir: Path, groups: tuple[int, ...]) -> None:
    for root in (ha_dir, persistence_dir):
        if not root.is_dir():
            continue
        found = [
            entry.name
            for entry in root.iterdir()
            if entry.name.startswith("group-") or entry.name == "local"
        ]
        if found:
            raise StartRefused(
                f"{root} holds data ({', '.join(sorted(found))}) but no {IDENTITY_FILE}: "
                "written by an older version, or the identity was lost. Move the directory "
                "away and start the node empty (it catches up from its peers)"
            )


def _initialise_group(directory: Path) -> None:
    """A group this node joins for the first time: its Raft state (term 0, no vote) exists
    durably before the identity says the node joined it, so a lost one is always noticed."""
    if (directory / "raft.meta").exists():
        return
    journal = DurableJournal(directory)
    try:
        journal.set_term(0, None)
    finally:
        journal.close()


def _raft_state_problem(directory: Path) -> str | None:
    """Why a group's Raft state cannot be trusted, or None."""
    if (directory / REJOIN_MARKER).exists():
        return None  # a rejoin under way resumes (replication.py)
    if not (directory / "raft.meta").exists():
        return f"its Raft state ({directory / 'raft.meta'}) is missing"
    checkpoint_path = directory / "checkpoint"
    try:
        meta = json.loads(checkpoint.read_checked(directory / "raft.meta", META_KIND))
        synced = int(meta.get("synced_last_index", 0))
        if checkpoint_path.exists():
            group_checkpoint.decode(checkpoint.read_checked(checkpoint_path, group_checkpoint.KIND))
        elif synced > 0 and not segment_paths(directory):
            return f"its Raft log is gone (entries up to {synced} were synced)"
        journal = DurableJournal(directory)
        empty = len(journal) == 0
        journal.close()
        if empty and synced > 0 and not checkpoint_path.exists():
            return f"its Raft log is empty (entries up to {synced} were synced)"
    except CorruptionError as error:
        return f"its Raft log is damaged: {error}"
    except FormatError as error:
        return f"its checkpoint is unreadable: {error.detail}"
    return None


def prepare_rejoin(directory: Path, problem: str) -> None:
    """Move the group's Raft directory aside and start it over, empty, marked rejoining."""
    aside = directory.with_name(f"{directory.name}.damaged-{int(time.time() * 1000)}")
    log.error("raft group dir %s: %s; moved to %s, rejoining from peers", directory, problem, aside)
    if directory.exists():
        os.rename(directory, aside)
        checkpoint.fsync_dir(directory.parent)
    ensure_dir(REAL_FILES, directory, root=directory)
    checkpoint.write_atomic(directory / REJOIN_MARKER, b"RJN1", problem.encode())
