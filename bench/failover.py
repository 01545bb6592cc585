"""Failover: lose the leader under a steady publisher; time to recover; lost/duplicated rows.

    python -m bench.failover [--kills 3] [--rate 50] [--batch 100]   # kill -9
    python -m bench.failover --freeze --kills 5      # SIGSTOP the leader, SIGCONT later
    python -m bench.failover --partition --kills 5   # cut the leader's link (root, ip netns)

A three-node local cluster, one HA table (11 columns, no key column, so a duplicate would be
visible). One publisher (the project's client: a `Session` over every site, as
`api_clients.connect` makes it, and `Publisher.append`, which retries a failed request with
the same producer id and sequence until it is acknowledged) appends batches of `--batch`
rows with unique ids at `--rate` batches/s. While it runs, the leader is lost, and once publishes
succeed again it comes back and catches up, and the next round loses the new leader:
- kill (default): SIGKILL, then the node is restarted on its data;
- `--freeze`: SIGSTOP (a stuck VM or process: its TCP connections stay open, silent), then
  SIGCONT;
- `--partition`: every node runs in its own network namespace (`deploy.netns`, the
  publisher in the root namespace on a link into their bridge), and the leader's bridge port
  is taken down (`ip link set DEV down`: it is cut off from its peers and the client alike,
  its connections silent), then up again. Needs root and `ip netns`.

Measured per round ("kill" below: the moment the leader was lost):
- the stall: the longest gap between two acknowledgements from 1 s before the kill to the
  first acknowledgement after the election (what the publisher experiences, client
  backoff included; with a silent leader an answer already on its way may still arrive
  just after the kill, so "the first acknowledgement after the kill" would not do);
- recovery: from the kill to the acknowledgement that ended the stall;
- election: from the kill until a surviving node reports itself leader, ready for writes
  (polled every 50 ms over gRPC), and from then to the acknowledgement that ended the
  stall (slightly negative when the poll saw the election late).
At the end every replica is read in full (the Read RPC on each node) and compared with the
acknowledged batches: rows lost (acknowledged ids missing) and rows duplicated (an id more
than once), per replica; both must be 0.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from api_clients import Publisher, Session
from api_clients.hedge import HEDGE_DELAY_S_DEFAULT
from bench import common
from deploy import netns
from deploy.local_cluster import LocalCluster, wait_until
from raftstore import tuning

TABLE = "failover_ticks"
TARGET_RECOVERY_S = 3.0
FAULTS = {
    "kill": "kill -9 of the leader",
    "freeze": "SIGSTOP of the leader",
    "partition": "the leader's link cut (network namespaces)",
}


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
    ack_gap_s: float = float("nan")  # the stall: the longest gap between acks around it
    after_election_s: float = float("nan")  # new leader seen -> the ack that ended the stall
    terms: int = 0  # terms it took to elect the new leader (1 = the first election won)
    leader_after_restore: str = ""  # the leader once the lost node is back
    restore_gap_s: float = float("nan")  # the longest gap between acks after it is back
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
        self,
        cluster: LocalCluster,
        rate: float,
        batch_rows: int,
        table: str = TABLE,
        *,
        hedge: bool = True,
    ) -> None:
        super().__init__(daemon=True)
        sites = [node.site for node in cluster.nodes.values()]
        # What connect() makes; without the hedge for the A/B (`--no-hedge`).
        self.session = Session(sites, hedge_delay_s=HEDGE_DELAY_S_DEFAULT if hedge else None)
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

    def longest_gap_s(self, start: float, end: float) -> float:
        """The longest time between two acknowledgements in [start, end]."""
        acks = [p.acked_at for p in list(self.published) if start <= p.acked_at <= end]
        return max((b - a for a, b in itertools.pairwise(acks)), default=float("nan"))

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


class Fault:
    """How a round loses the leader and brings it back."""

    def __init__(self, mode: str, cluster: LocalCluster, network: netns.NamespaceNetwork | None):
        self.mode = mode
        self.cluster = cluster
        self.network = network

    def lose(self, alias: str) -> None:
        if self.mode == "kill":
            self.cluster.kill(alias)
        elif self.mode == "freeze":
            self.cluster.signal(alias, signal.SIGSTOP)
        else:
            assert self.network is not None
            self.network.cut(alias)

    def restore(self, alias: str) -> None:
        if self.mode == "kill":
            self.cluster.start_node(alias)  # rejoins as a follower and catches up
        elif self.mode == "freeze":
            self.cluster.signal(alias, signal.SIGCONT)
        else:
            assert self.network is not None
            self.network.heal(alias)


def kill_round(
    cluster: LocalCluster, publisher: SteadyPublisher, settle_s: float, fault: Fault
) -> Kill:
    leader = cluster.leader(common.HA_GROUP)
    time.sleep(settle_s)  # steady state before the kill
    term_before = int(cluster.group_status(leader, common.HA_GROUP)["term"])
    kill = Kill(leader, time.monotonic())
    fault.lose(leader)
    terms: set[int] = set()
    new_leader = wait_until(
        lambda: _ready_leader(cluster, leader, terms, kill.timeline, kill.killed_at),
        timeout_s=60,
        interval_s=0.05,
        message="election",
    )
    kill.terms = max(terms) - term_before
    kill.new_leader = new_leader
    elected_at = time.monotonic()
    kill.election_s = elected_at - kill.killed_at
    first = wait_until(
        lambda: publisher.acked_after(elected_at) or publisher.errors,
        timeout_s=120,
        interval_s=0.02,
        message="publishes acknowledged after the election",
    )
    if isinstance(first, Publish):
        acks = [
            p.acked_at
            for p in list(publisher.published)
            if kill.killed_at - 1.0 <= p.acked_at <= first.acked_at
        ]
        gap_s, ended_at = max(
            ((later - earlier, later) for earlier, later in itertools.pairwise(acks)),
            default=(float("nan"), first.acked_at),
        )
        kill.ack_gap_s = gap_s
        kill.recovery_s = ended_at - kill.killed_at
        kill.after_election_s = ended_at - elected_at
    time.sleep(settle_s)  # publishing continues on the new leader
    restored_at = time.monotonic()
    fault.restore(leader)
    # Every node agrees on a leader again before the next round picks it. A node that was
    # cut off or frozen comes back with a higher term (it stepped down and stood for
    # election alone: pysyncobj has no PreVote), which may force one more election.
    kill.leader_after_restore = wait_until(
        lambda: cluster.leader(common.HA_GROUP, timeout_s=1),
        timeout_s=60,
        interval_s=0.1,
        message=f"the cluster agrees on a leader after {leader} is back",
    )
    time.sleep(settle_s)
    kill.restore_gap_s = publisher.longest_gap_s(restored_at, time.monotonic())
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
    stalls = [kill.ack_gap_s for kill in outcome.kills]
    resumes = [kill.after_election_s for kill in outcome.kills]
    lost = sum(r["lost"] for r in outcome.replicas.values())
    duplicated = sum(r["duplicated"] for r in outcome.replicas.values())
    lines = [
        f"# Failover: {FAULTS[args.mode]} under a steady publisher",
        "",
        f"Run {meta['started']} (code {common.code_version()}): "
        f"`python -m bench.failover {' '.join(meta['argv'])}`. "
        f"{args.kills} round(s) of {FAULTS[args.mode]}; "
        f"publisher at {args.rate:g} batches/s x {args.batch} rows "
        f"(api_clients Publisher, retries with the same producer id/sequence); "
        f"election timeout {args.election_timeout:g} s (max {1.5 * args.election_timeout:g} s); "
        f"load average {meta['load']:.1f} (2 cores, shared)."
        + (f" Nodes run with HASTREAM_TUNING `{args.tuning}`." if args.tuning else "")
        + (" Client without its hedge (`--no-hedge`)." if args.no_hedge else ""),
        "",
        "| round | leader lost | new leader | election s | terms | publishes succeed again s "
        "| gap between acks (stall) s | first ack after the election s "
        "| leader after it is back | longest gap after it is back s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for number, kill in enumerate(outcome.kills, 1):
        lines.append(
            f"| {number} | {kill.leader} | {kill.new_leader} | {kill.election_s:.2f} "
            f"| {kill.terms} "
            f"| {kill.recovery_s:.2f} | {kill.ack_gap_s:.2f} | {kill.after_election_s:.2f} "
            f"| {kill.leader_after_restore} | {kill.restore_gap_s:.2f} |"
        )
    lines += [
        "",
        f"Median recovery {common.median(recoveries):.2f} s, worst {worst:.2f} s: target <= "
        f"{TARGET_RECOVERY_S:g} s **{'met' if worst <= TARGET_RECOVERY_S else 'NOT met'}** "
        "(worst case).",
        f"Stall (gap between acks): median {common.median(stalls):.2f} s, worst "
        f"{max(stalls, default=float('nan')):.2f} s; first ack after the new leader was seen: "
        f"median {common.median(resumes):.2f} s, worst {max(resumes, default=float('nan')):.2f} s.",
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


def run(
    args: argparse.Namespace, outcome: Outcome, network: netns.NamespaceNetwork | None
) -> SteadyPublisher:
    with common.bench_cluster(
        purge_interval_s=60.0,
        election_timeout_s=args.election_timeout,
        environment={tuning.ENVIRONMENT_VARIABLE: args.tuning} if args.tuning else None,
        hosts=network.hosts() if network is not None else None,
        launch_prefix=network.prefixes() if network is not None else None,
    ) as cluster:
        common.create_table(
            cluster, None, TABLE, common.schema_for(common.NARROW_COLUMNS), group=common.HA_GROUP
        )
        publisher = SteadyPublisher(cluster, args.rate, args.batch, hedge=not args.no_hedge)
        publisher.start()
        fault = Fault(args.mode, cluster, network)
        try:
            for number in range(args.kills):
                kill = kill_round(cluster, publisher, args.settle, fault)
                outcome.kills.append(kill)
                print(
                    f"round {number + 1}: {kill.leader} -> {kill.new_leader}, election "
                    f"{kill.election_s:.2f} s ({kill.terms} term(s)), publishes succeed after "
                    f"{kill.recovery_s:.2f} s, stall {kill.ack_gap_s:.2f} s, "
                    f"{kill.after_election_s:.2f} s after the election; back: leader "
                    f"{kill.leader_after_restore}, longest gap {kill.restore_gap_s:.2f} s",
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
    return publisher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.failover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kills", type=int, default=3, help="rounds")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--freeze", dest="mode", action="store_const", const="freeze", help="SIGSTOP, SIGCONT"
    )
    mode.add_argument(
        "--partition",
        dest="mode",
        action="store_const",
        const="partition",
        help="nodes in network namespaces; the leader's link down, then up (root)",
    )
    parser.set_defaults(mode="kill")
    parser.add_argument("--rate", type=float, default=50.0, help="batches per second")
    parser.add_argument("--batch", type=int, default=100, help="rows per batch")
    parser.add_argument("--settle", type=float, default=3.0, help="s of steady load per phase")
    parser.add_argument("--election-timeout", type=float, default=1.5)
    parser.add_argument(
        "--tuning", default="", help="HASTREAM_TUNING for the nodes (raftstore/tuning.py; A/B only)"
    )
    parser.add_argument(
        "--no-hedge",
        action="store_true",
        help="the client without its hedge (Session(hedge_delay_s=None)): the code before it",
    )
    parser.add_argument("--name", default="failover", help="output file stem")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    import sys

    meta: dict[str, object] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    outcome = Outcome()
    network: netns.NamespaceNetwork | None = None
    if args.mode == "partition":
        reason = netns.unavailable()
        if reason is not None:
            parser.error(reason)
        network = netns.NamespaceNetwork.create(["node1", "node2", "node3"])
    try:
        publisher = run(args, outcome, network)
    finally:
        if network is not None:
            network.destroy()
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
