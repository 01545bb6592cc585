"""Replicas compare themselves: digests of the same rows, compared by the leader.

CRCs catch a flipped bit; they cannot catch two replicas that hold different, well-formed
rows (a bug in apply, a repair from a wrong peer). So now and then (`streamingDigestInterval`)
each group's leader asks every replica for a digest of each table over the same rows, in
the spirit of CockroachDB's replica consistency checker:

1. every replica reports its retained range [earliest, row_count);
2. the leader picks rows every replica holds, the newest `DIGEST_ROWS_MAX` of them, and of
   those no more than its own newest `DIGEST_RECORDS_MAX` records hold (a record costs a
   read and Python work however few rows it has: a million one-row records are seconds of
   CPU on every replica). Rows are immutable once written, so replicas that keep appending
   still agree on them;
3. each replica digests the records covering those rows: (first_offset, row_count,
   crc32(payload)) of each, in order. Records are the same on every replica (apply writes
   them deterministically and repair copies them byte for byte);
4. a replica whose digest differs from the majority is told to repair the table (it moves
   its files aside and fetches them from a peer); with no majority, nothing is repaired and
   the mismatch is logged. Each mismatch is counted (`digest_mismatches`).
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from typing import Final

from hastream.checksum import crc32
from hastream.errors import RaftStoreError
from hastream.model import NodeAddress, TableDigest
from raftstore import limits
from raftstore.group import Group
from raftstore.peers import PeerClient
from raftstore.tables import TableStore

log = logging.getLogger(__name__)

_RECORD: Final = struct.Struct("<QQI")


def table_digest(store: TableStore, offset_from: int, offset_to: int) -> TableDigest:
    """The digest of the records overlapping [offset_from, offset_to) (empty range: just the
    replica's retained range). Raises OffsetOutOfRange, CorruptionError."""
    earliest, row_count = store.earliest_offset, store.row_count
    if offset_to <= offset_from:
        return TableDigest(offset_from, offset_from, 0, 0, earliest, row_count)
    digest = 0
    records = 0
    first = last = offset_from
    for record in store.records(offset_from, offset_to):
        if records == 0:
            first = record.first_offset
        header = _RECORD.pack(record.first_offset, record.row_count, crc32(record.payload))
        digest = crc32(header, digest)
        records += 1
        last = record.first_offset + record.row_count
        if last >= offset_to:
            break
    return TableDigest(first, last, records, digest, earliest, row_count)


class DigestChecker:
    """Run by the node's housekeeping thread on each group this node leads."""

    def __init__(self, peers: PeerClient) -> None:
        self._peers = peers
        self.mismatches = 0
        self.comparisons = 0

    def check(self, group: Group, members: dict[str, NodeAddress], self_alias: str) -> None:
        """Compare every table of `group` across its members (alias -> peer address)."""
        if not group.leads_and_ready():
            return
        for table in group.table_names():
            try:
                self._check_table(group, table, members, self_alias)
            except RaftStoreError as error:
                log.info("digest of %s skipped: %s", table, error)

    def _check_table(
        self, group: Group, table: str, members: dict[str, NodeAddress], self_alias: str
    ) -> None:
        store = group.store(table)
        ranges = {self_alias: table_digest(store, 0, 0)}
        for alias, peer in members.items():
            if alias == self_alias:
                continue
            try:
                ranges[alias] = self._peers.table_digest(peer, group.group_id, table, 0, 0)
            except RaftStoreError:
                continue  # down or in doubt: compared next time
        if len(ranges) < 2:
            return
        offset_to = min(span.row_count for span in ranges.values())
        offset_from = max(
            [span.earliest_offset for span in ranges.values()]
            + [
                offset_to - limits.DIGEST_ROWS_MAX,
                store.newest_records_offset(limits.DIGEST_RECORDS_MAX),
            ]
        )
        if offset_to <= offset_from:
            return
        digests = {self_alias: table_digest(store, offset_from, offset_to)}
        for alias in ranges:
            if alias != self_alias:
                try:
                    digests[alias] = self._peers.table_digest(
                        members[alias], group.group_id, table, offset_from, offset_to
                    )
                except RaftStoreError:
                    continue
        self.comparisons += 1
        self._judge(group, table, digests, members, self_alias)

    def _judge(
        self,
        group: Group,
        table: str,
        digests: dict[str, TableDigest],
        members: dict[str, NodeAddress],
        self_alias: str,
    ) -> None:
        votes = Counter((d.offset_from, d.offset_to, d.records, d.digest) for d in digests.values())
        if len(votes) == 1:
            return
        self.mismatches += 1
        winner, count = votes.most_common(1)[0]
        if count * 2 <= len(members):
            log.critical(
                "replicas disagree with no majority group=%d table=%s digests=%s",
                group.group_id,
                table,
                digests,
            )
            return
        for alias, digest in digests.items():
            if (digest.offset_from, digest.offset_to, digest.records, digest.digest) == winner:
                continue
            reason = f"digest of rows [{digest.offset_from},{digest.offset_to}) disagrees"
            log.error(
                "replica disagrees group=%d table=%s replica=%s: %s",
                group.group_id,
                table,
                alias,
                reason,
            )
            if alias == self_alias:
                group.applier.report_damage(table, group.table_view(table).meta.created_lsn, reason)
            else:
                try:
                    self._peers.repair_table(members[alias], group.group_id, table, reason)
                except RaftStoreError as error:
                    log.warning("asking %s to repair %s failed: %s", alias, table, error)
