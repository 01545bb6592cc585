"""Soak: a steady publisher and a subscriber against a three-node cluster for an hour; is the
nodes' memory flat, does the subscriber keep up, is every acknowledged row there once?

    python -m bench.soak [--minutes 60] [--rate 5000] [--batch 500] [--purge-interval 30]

One HA table (11 columns, key column `id`, so the dedup window fills to its 1,000,000-row
cap and stays there) receives `--rate` rows/s in batches of `--batch` rows from the project's
`Publisher`; a subscription (`Session.subscribe`, persisted offset) reads it from offset 0 as
it grows. Checkpoints purge the Raft log every `--purge-interval` s. Every `--sample` s
the RSS of each node process, the subscriber's lag and the data on disk are recorded.

Verdicts:
- memory flat: each node's RSS at the end is within `--rss-growth-max` (default 10%) of its
  RSS at the end of the warm-up (the first fifth of the run, when caches and the dedup
  window have filled); the least-squares slope over the rest is reported too;
- the subscriber received every row, in order, by the end (lag 0 after the drain);
- every acknowledged row is on every replica exactly once, in publish order (ids are
  consecutive in ack order: one publishing thread), read back in full over the Read RPC.

Writes bench/results/<name>.md and .json (samples included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from api_clients import connect
from bench import common
from bench.failover import SteadyPublisher
from deploy.local_cluster import LocalCluster, wait_until
from proto import hastream_pb2 as pb

TABLE = "soak_ticks"


@dataclass
class Sample:
    elapsed_s: float
    rss_mib: dict[str, float]
    rows_acked: int
    rows_received: int
    disk_mib: float
    load: float


@dataclass
class Outcome:
    samples: list[Sample] = field(default_factory=list)
    rows_acked: int = 0
    rows_received: int = 0
    received_in_order: bool = True
    replicas: dict[str, dict[str, int | bool]] = field(default_factory=dict)
    publisher_errors: list[str] = field(default_factory=list)


class OrderCheckingHandler:
    """Subscription handler: counts rows and checks ids arrive consecutively from 0."""

    def __init__(self) -> None:
        self.rows = 0
        self.in_order = True

    def __call__(self, table: pa.Table, first_offset: int) -> None:
        if first_offset != self.rows:
            self.in_order = False
        ids = table.column("id").to_numpy()
        if len(ids) and not np.array_equal(ids, np.arange(self.rows, self.rows + len(ids))):
            self.in_order = False
        self.rows += len(ids)


def _disk_mib(root: Path) -> float:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file()) / 2**20


def _verify_replica(cluster: LocalCluster, alias: str, rows_acked: int) -> dict[str, int | bool]:
    """Stream the whole table from `alias`; ids must be exactly 0..rows_acked-1 in order."""
    request = pb.ReadRequest(table=TABLE, offset_from=0, offset_to=rows_acked)
    expected = 0
    in_order = True
    for message in cluster.stub(alias).Read(request, timeout=600):
        ids = pa.ipc.open_stream(message.payload).read_all().column("id").to_numpy()
        if not np.array_equal(ids, np.arange(expected, expected + len(ids))):
            in_order = False
        expected += len(ids)
    return {"rows": expected, "exactly_once_in_order": in_order and expected == rows_acked}


def _slope_mib_per_hour(samples: list[Sample], alias: str) -> float:
    if len(samples) < 2:
        return float("nan")
    x = np.array([s.elapsed_s / 3600 for s in samples])
    y = np.array([s.rss_mib[alias] for s in samples])
    return float(np.polyfit(x, y, 1)[0])


def run(args: argparse.Namespace, outcome: Outcome) -> None:
    with common.bench_cluster(purge_interval_s=args.purge_interval, election_timeout_s=1.5) as (
        cluster
    ):
        schema = common.schema_for(common.NARROW_COLUMNS)
        common.create_table(
            cluster,
            None,
            TABLE,
            schema,
            group=common.HA_GROUP,
            cache_limit=100_000,
            key_column="id",
        )
        publisher = SteadyPublisher(cluster, args.rate / args.batch, args.batch, TABLE)
        handler = OrderCheckingHandler()
        sites = [f"127.0.0.1:{node.port}" for node in cluster.nodes.values()]
        session = connect("127.0.0.1", cluster.nodes["node1"].port, highAvailabilitySites=sites)
        subscription = session.subscribe(TABLE, handler, offset=0, actionName="soak")
        pids = common.node_pids(cluster)
        started = time.monotonic()
        publisher.start()
        end = started + args.minutes * 60
        stop = threading.Event()
        while time.monotonic() < end and not publisher.errors and subscription.error is None:
            sample = Sample(
                elapsed_s=round(time.monotonic() - started, 1),
                rss_mib={
                    alias: common.memory_kib(pid)["VmRSS"] / 1024 for alias, pid in pids.items()
                },
                rows_acked=publisher.rows_acked,
                rows_received=handler.rows,
                disk_mib=round(_disk_mib(cluster.root), 1),
                load=common.load_average(),
            )
            outcome.samples.append(sample)
            print(
                f"+{sample.elapsed_s / 60:5.1f} min rss "
                + " ".join(f"{a}={m:.0f}MiB" for a, m in sample.rss_mib.items())
                + f" acked={sample.rows_acked:,} received={sample.rows_received:,}"
                f" disk={sample.disk_mib:,.0f}MiB load={sample.load:.1f}",
                flush=True,
            )
            stop.wait(min(args.sample, max(0.0, end - time.monotonic())))
        publisher.stop_event.set()
        publisher.join(timeout=180)
        outcome.publisher_errors = publisher.errors
        outcome.rows_acked = publisher.rows_acked

        def drained() -> bool:
            if subscription.error is not None:
                raise AssertionError(f"subscription failed: {subscription.error!r}")
            return handler.rows >= outcome.rows_acked

        wait_until(
            drained,
            timeout_s=300,
            interval_s=0.5,
            message="subscriber drained",
        )
        outcome.rows_received = handler.rows
        outcome.received_in_order = handler.in_order
        subscription.stop()
        session.close()
        publisher.session.close()
        wait_until(
            lambda: all(
                cluster.row_count(alias, TABLE) >= outcome.rows_acked for alias in cluster.nodes
            ),
            timeout_s=300,
            interval_s=0.5,
            message="replicas caught up",
        )
        for alias in cluster.nodes:
            outcome.replicas[alias] = _verify_replica(cluster, alias, outcome.rows_acked)


def markdown(outcome: Outcome, args: argparse.Namespace, meta: dict[str, object]) -> str:
    samples = outcome.samples
    warm = [s for s in samples if s.elapsed_s >= args.minutes * 60 / 5]
    lines = [
        "# Soak: steady publish + subscribe, node memory over time",
        "",
        f"Run {meta['started']} (code {meta['code']}): `python -m bench.soak "
        f"{' '.join(meta['argv'])}`. {args.minutes:g} min, {args.rate:,.0f} rows/s in batches "
        f"of {args.batch:,} (11 columns, key column `id`), a subscriber from offset 0, "
        f"checkpoint every {args.purge_interval:g} s; three nodes and this client on one "
        "2-core machine.",
        "",
        "| minute | "
        + " | ".join(f"{a} RSS MiB" for a in samples[0].rss_mib)
        + " | rows acked | rows received | disk MiB | load |",
        "|---:|" + "---:|" * (len(samples[0].rss_mib) + 4),
    ]
    step = max(1, len(samples) // 13)
    for sample in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        lines.append(
            f"| {sample.elapsed_s / 60:.1f} | "
            + " | ".join(f"{v:,.0f}" for v in sample.rss_mib.values())
            + f" | {sample.rows_acked:,} | {sample.rows_received:,} | {sample.disk_mib:,.0f}"
            f" | {sample.load:.1f} |"
        )
    lines += [
        "",
        "| node | RSS after warm-up MiB | RSS at end MiB | growth | slope after warm-up |",
        "|---|---:|---:|---:|---:|",
    ]
    flat = True
    for alias in samples[0].rss_mib:
        first = warm[0].rss_mib[alias] if warm else float("nan")
        last = samples[-1].rss_mib[alias]
        growth = (last - first) / first if first else float("nan")
        flat = flat and growth <= args.rss_growth_max
        lines.append(
            f"| {alias} | {first:,.0f} | {last:,.0f} | {growth:+.1%} | "
            f"{_slope_mib_per_hour(warm, alias):+,.1f} MiB/h |"
        )
    replicas_ok = all(r["exactly_once_in_order"] for r in outcome.replicas.values())
    subscriber_ok = outcome.received_in_order and outcome.rows_received == outcome.rows_acked
    lines += [
        "",
        f"- Memory flat (end within {args.rss_growth_max:.0%} of the post-warm-up RSS): "
        f"**{'yes' if flat else 'NO'}**.",
        f"- Subscriber: {outcome.rows_received:,} of {outcome.rows_acked:,} rows, in order: "
        f"**{'yes' if subscriber_ok else 'NO'}**.",
        "- Every acknowledged row on every replica exactly once, in order: "
        + ", ".join(f"{a} {r['rows']:,} rows" for a, r in outcome.replicas.items())
        + f": **{'yes' if replicas_ok else 'NO'}**.",
    ]
    if outcome.publisher_errors:
        lines.append(f"- Publisher errors: {outcome.publisher_errors}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=5_000.0, help="rows per second")
    parser.add_argument("--batch", type=int, default=500, help="rows per publish")
    parser.add_argument("--purge-interval", type=float, default=30.0, help="s per checkpoint")
    parser.add_argument("--sample", type=float, default=30.0, help="s between samples")
    parser.add_argument("--rss-growth-max", type=float, default=0.10)
    parser.add_argument("--name", default="soak", help="output file stem")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    meta: dict[str, object] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else argv,
        "code": common.code_version(),
    }
    outcome = Outcome()
    run(args, outcome)
    text = markdown(outcome, args, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    (args.out / f"{args.name}.json").write_text(
        json.dumps({"meta": meta, "outcome": asdict(outcome)}, indent=1)
    )
    print(text)
    ok = (
        not outcome.publisher_errors
        and outcome.received_in_order
        and outcome.rows_received == outcome.rows_acked
        and all(r["exactly_once_in_order"] for r in outcome.replicas.values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
