"""Failover: kill -9 the leader under a steady publisher; time to recover; lost/duplicated rows.

    python -m bench.failover [--kills 3] [--rate 50] [--batch 100]

A three-node local cluster, one HA table (11 columns, no key column, so a duplicate would be
visible). One publisher (the project's client: `api_clients.connect` with every site as
`highAvailabilitySites`, `Publisher.append`, which retries a failed request with the same
producer id and sequence until it is acknowledged) appends batches of `--batch` rows with
unique ids at `--rate` batches/s. While it runs, the leader is killed with SIGKILL; once
publishes succeed again the killed node is restarted, it catches up, and the next round
kills the new leader.

Measured per kill:
- recovery: from the kill to the first acknowledgement of a publish that had not been
  acknowledged before the kill (what the publisher experiences, client backoff included);
- election: from the kill until a surviving node reports itself leader, ready for writes
  (polled every 50 ms over gRPC);
- the gap between the last acknowledgement before the kill and the first one after it.
At the end every replica is read in full (the Read RPC on each node) and compared with the
acknowledged batches: rows lost (acknowledged ids missing) and rows duplicated (an id more
than once), per replica; both must be 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from api_clients import Publisher, connect
from bench import common
from deploy.local_cluster import LocalCluster, wait_until

TABLE = "failover_ticks"
TARGET_RECOVERY_S = 3.0


@dataclass
class Publish:
    number: int
    sent_at: float
    acked_at: float = 0.0
    attempts_failed: int = 0


@dataclass
class Kill:
    leader: str
    killed_at: float
    new_leader: str = ""
    election_s: float = float("nan")
    recovery_s: float = float("nan")
    ack_gap_s: float = float("nan")  # last ack before the kill -> first ack after
    terms: int = 0  # terms it took to elect the new leader (1 = the first election won)
    timeline: list[str] = field(default_factory=list)  # survivors' term/role/log changes


@dataclass
class Outcome:
    kills: list[Kill] = field(default_factory=list)
    batches_acked: int = 0
    rows_acked: int = 0
    replicas: dict[str, dict[str, int]] = field(default_factory=dict)


class SteadyPublisher(threading.Thread):
    """Appends batch `n` (ids [n * batch, (n + 1) * batch)) every 1/rate s; a batch that is
    being retried delays the next ones (one publisher, in order)."""

    def __init__(
        self, cluster: LocalCluster, rate: float, batch_rows: int, table: str = TABLE
    ) -> None:
        super().__init__(daemon=True)
        sites = [f"127.0.0.1:{node.port}" for node in cluster.nodes.values()]
        self.session = connect(
            "127.0.0.1", cluster.nodes["node1"].port, highAvailabilitySites=sites
        )
        self.publisher = Publisher(self.session, table, deadline_s=120.0)
        self.schema = common.schema_for(common.NARROW_COLUMNS)
        self.interval_s = 1.0 / rate
        self.batch_rows = batch_rows
        self.published: list[Publish] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        next_at = time.monotonic()
        number = 0
        while not self.stop_event.is_set():
            # Column-wise (numpy) construction; unique ids per batch.
            table = common.make_table(self.schema, self.batch_rows, number * self.batch_rows)
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            next_at = max(next_at + self.interval_s, time.monotonic())
            publish = Publish(number, time.monotonic())
            try:
                self.publisher.append(table)
            except Exception as error:  # the deadline passed: report it, never hide it
                self.errors.append(f"batch {number}: {error!r}")
                return
            publish.acked_at = time.monotonic()
            self.published.append(publish)
            number += 1

    @property
    def rows_acked(self) -> int:
        return len(self.published) * self.batch_rows

    def acked_after(self, moment: float) -> Publish | None:
        """The first publish acknowledged after `moment` (acks are in order: one thread)."""
        for publish in list(self.published):
            if publish.acked_at > moment:
                return publish
        return None


def _ready_leader(
    cluster: LocalCluster, exclude: str, terms: set[int], timeline: list[str], killed_at: float
) -> str | None:
    """The survivor that reports itself leader, if any; collects the terms seen (more than
    one new term means the first election failed: a split vote, or a candidate whose log
    was behind the other survivor's was refused)."""
    leader = None
    for alias in cluster.alive():
        if alias == exclude:
            continue
        try:
            status = cluster.group_status(alias, common.HA_GROUP)
        except Exception:
            continue
        terms.add(int(status["term"]))
        state = f"{alias} term={status['term']} role={status['role']} log_len={status['log_len']}"
        if not any(line.endswith(state) for line in timeline[-4:]):
            timeline.append(f"+{time.monotonic() - killed_at:.2f}s {state}")
        if status["role"] == "leader":
            leader = alias
    return leader


def kill_round(cluster: LocalCluster, publisher: SteadyPublisher, settle_s: float) -> Kill:
    leader = cluster.leader(common.HA_GROUP)
    time.sleep(settle_s)  # steady state before the kill
    term_before = int(cluster.group_status(leader, common.HA_GROUP)["term"])
    kill = Kill(leader, time.monotonic())
    cluster.kill(leader)
    terms: set[int] = set()
    new_leader = wait_until(
        lambda: _ready_leader(cluster, leader, terms, kill.timeline, kill.killed_at),
        timeout_s=60,
        interval_s=0.05,
        message="election",
    )
    kill.terms = max(terms) - term_before
    kill.new_leader = new_leader
    kill.election_s = time.monotonic() - kill.killed_at
    first = wait_until(
        lambda: publisher.acked_after(kill.killed_at) or publisher.errors,
        timeout_s=120,
        interval_s=0.02,
        message="publishes acknowledged after the kill",
    )
    if isinstance(first, Publish):
        kill.recovery_s = first.acked_at - kill.killed_at
        before = [p.acked_at for p in publisher.published if p.acked_at <= kill.killed_at]
        if before:
            kill.ack_gap_s = first.acked_at - before[-1]
    time.sleep(settle_s)  # publishing continues on the new leader
    cluster.start_node(leader)  # the old leader rejoins as a follower and catches up
    return kill


def verify(cluster: LocalCluster, publisher: SteadyPublisher, outcome: Outcome) -> None:
    acked = np.array(sorted(p.number for p in publisher.published), dtype=np.int64)
    offsets = np.arange(publisher.batch_rows, dtype=np.int64)
    expected_ids = pa.array((acked[:, None] * publisher.batch_rows + offsets).ravel())
    outcome.batches_acked = len(acked)
    outcome.rows_acked = len(expected_ids)

    def caught_up() -> bool:
        counts = {alias: cluster.row_count(alias, TABLE) for alias in cluster.alive()}
        return len(set(counts.values())) == 1 and len(counts) == len(cluster.nodes)

    wait_until(caught_up, timeout_s=180, interval_s=0.5, message="replicas caught up")
    for alias in cluster.nodes:
        ids = cluster.read_table(alias, TABLE).column("id").combine_chunks()
        distinct = pc.unique(ids)
        missing = pc.sum(pc.invert(pc.is_in(expected_ids, value_set=distinct))).as_py() or 0
        unexpected = pc.sum(pc.invert(pc.is_in(distinct, value_set=expected_ids))).as_py() or 0
        outcome.replicas[alias] = {
            "rows": len(ids),
            "lost": int(missing),
            "duplicated": len(ids) - len(distinct),
            "unacknowledged_present": int(unexpected),
        }


def markdown(outcome: Outcome, args: argparse.Namespace, meta: dict[str, object]) -> str:
    recoveries = [kill.recovery_s for kill in outcome.kills]
    worst = max(recoveries, default=float("nan"))
    lost = sum(r["lost"] for r in outcome.replicas.values())
    duplicated = sum(r["duplicated"] for r in outcome.replicas.values())
    lines = [
        "# Failover: kill -9 of the leader under a steady publisher",
        "",
        f"Run {meta['started']} (code {common.code_version()}): "
        f"`python -m bench.failover {' '.join(meta['argv'])}`. "
        f"{args.kills} kill(s); publisher at {args.rate:g} batches/s x {args.batch} rows "
        f"(api_clients Publisher, retries with the same producer id/sequence); "
        f"election timeout {args.election_timeout:g} s (max {1.5 * args.election_timeout:g} s); "
        f"load average {meta['load']:.1f} (2 cores, shared)."
        + (f" Nodes run with bench.patches `{args.patches}`." if args.patches else ""),
        "",
        "| kill | leader killed | new leader | election s | terms | publishes succeed again s "
        "| gap between acks s |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for number, kill in enumerate(outcome.kills, 1):
        lines.append(
            f"| {number} | {kill.leader} | {kill.new_leader} | {kill.election_s:.2f} "
            f"| {kill.terms} "
            f"| {kill.recovery_s:.2f} | {kill.ack_gap_s:.2f} |"
        )
    lines += [
        "",
        f"Median recovery {common.median(recoveries):.2f} s, worst {worst:.2f} s: target <= "
        f"{TARGET_RECOVERY_S:g} s **{'met' if worst <= TARGET_RECOVERY_S else 'NOT met'}** "
        "(worst case).",
        "",
        f"Acknowledged: {outcome.batches_acked:,} batches, {outcome.rows_acked:,} rows.",
        "",
        "| replica | rows | lost | duplicated | unacknowledged rows present |",
        "|---|---:|---:|---:|---:|",
    ]
    for alias, replica in outcome.replicas.items():
        lines.append(
            f"| {alias} | {replica['rows']:,} | {replica['lost']} | {replica['duplicated']} "
            f"| {replica['unacknowledged_present']} |"
        )
    verdict = "0/0: met" if lost == 0 and duplicated == 0 else f"{lost}/{duplicated}: NOT met"
    lines += ["", f"Lost/duplicated over all replicas: **{verdict}**.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.failover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--rate", type=float, default=50.0, help="batches per second")
    parser.add_argument("--batch", type=int, default=100, help="rows per batch")
    parser.add_argument("--settle", type=float, default=3.0, help="s of steady load per phase")
    parser.add_argument("--election-timeout", type=float, default=1.5)
    parser.add_argument("--patches", default="", help="bench.patches to apply (A/B only)")
    parser.add_argument("--name", default="failover", help="output file stem")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    import sys

    meta: dict[str, object] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    outcome = Outcome()
    with common.bench_cluster(
        purge_interval_s=60.0, election_timeout_s=args.election_timeout, patches=args.patches
    ) as cluster:
        common.create_table(
            cluster, None, TABLE, common.schema_for(common.NARROW_COLUMNS), group=common.HA_GROUP
        )
        publisher = SteadyPublisher(cluster, args.rate, args.batch)
        publisher.start()
        try:
            for number in range(args.kills):
                kill = kill_round(cluster, publisher, args.settle)
                outcome.kills.append(kill)
                print(
                    f"kill {number + 1}: {kill.leader} -> {kill.new_leader}, election "
                    f"{kill.election_s:.2f} s ({kill.terms} term(s)), publishes succeed after "
                    f"{kill.recovery_s:.2f} s, ack gap {kill.ack_gap_s:.2f} s",
                    flush=True,
                )
                print("  " + "\n  ".join(kill.timeline), flush=True)
        finally:
            publisher.stop_event.set()
            publisher.join(timeout=180)
            publisher.session.close()
        if publisher.errors:
            print("publisher errors:", *publisher.errors, sep="\n  ")
        verify(cluster, publisher, outcome)
    meta["load"] = common.load_average()
    text = markdown(outcome, args, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    (args.out / f"{args.name}.json").write_text(
        json.dumps({"meta": meta, "outcome": asdict(outcome), "errors": publisher.errors}, indent=1)
    )
    print(text)
    lost = sum(r["lost"] for r in outcome.replicas.values())
    duplicated = sum(r["duplicated"] for r in outcome.replicas.values())
    return 0 if lost == 0 and duplicated == 0 and not publisher.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
