"""A/B measurement of candidate write-path changes before they are written.

    python -m bench.experiment --configs baseline proposals_in_flight=1 malloc-keep \\
        [--cells 1:1 4:1 1:10000 4:10000] [--columns 11] [--duration 3] [--repeat 3] [--trace]

Each config is a comma-separated list of knobs ("baseline" = none): `key=value` items are
raftstore/tuning.py's knobs (HASTREAM_TUNING: proposals_in_flight, switch_interval_ms,
yield_after_ack), and `malloc-keep` sets glibc's malloc environment for the node processes.
The nodes are the unmodified product: a candidate that is not a knob is measured by writing
it (on a branch) and comparing checkouts (bench/append_path.py), not by patching private
names here. For every repeat, every config gets a fresh three-node cluster, then the HA
cells (threads:batch) run exactly as in bench.throughput. The configs' order rotates from
repeat to repeat so drifting background load does not favour one. Reported: median rows/s
and the speed-up over the first config, and node CPU per 10,000 rows (summed over the three
node processes) - the cost of a row, which is less sensitive than rows/s to what else runs
on the machine. `--trace` has every node record where an entry's time goes (raftstore/trace.py).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Final

from bench import common, throughput, timeline
from deploy.local_cluster import LocalCluster
from raftstore import tuning

# Environment presets (they must be in place before the node's interpreter starts).
ENVIRONMENT: Final[dict[str, dict[str, str]]] = {
    # glibc: serve allocations below 64 MiB from the heap and never trim it, so the
    # multi-MB buffers of every entry reuse memory instead of mmap-ing fresh pages.
    "malloc-keep": {
        "MALLOC_MMAP_THRESHOLD_": str(64 << 20),
        "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
        "MALLOC_TOP_PAD_": str(64 << 20),
    },
}


def node_environment(config: str, root: Path, *, trace: bool) -> dict[str, str]:
    """The node processes' environment for `config`. Raises ConfigError (a bad knob)."""
    knobs: list[str] = []
    environment: dict[str, str] = {}
    for item in [] if config == "baseline" else config.split(","):
        if item in ENVIRONMENT:
            environment.update(ENVIRONMENT[item])
        elif "=" in item:
            knobs.append(item)
        else:
            known = ", ".join([*ENVIRONMENT, *tuning.Tuning.__dataclass_fields__])
            raise SystemExit(f"config {config!r}: unknown item {item!r} (known: {known})")
    if trace:
        knobs.append(f"trace_file={trace_path(root, '<ALIAS>')}")
    return {**environment, **common.tuning_environment(",".join(knobs))}


def trace_path(root: Path, alias: str) -> Path:
    return root / f"{alias}-trace.json"


def read_traces(cluster: LocalCluster) -> dict[str, dict[str, dict[str, float]]]:
    """Per node, its trace summary (written when the node stopped)."""
    found = {}
    for alias in cluster.nodes:
        path = trace_path(cluster.root, alias)
        if path.exists():
            found[alias] = json.loads(path.read_text())
    return found


def publish_leader(summaries: dict[str, dict[str, dict[str, float]]]) -> str | None:
    """The node that answered the publishes (the most Publish handler samples): the HA
    group's leader. A node that led another group for a moment, or this one before an
    election, also has stages named "leader: ..."; it is not the one measured."""
    answered = {
        alias: summary.get(_ANSWERED, {}).get("count", 0) for alias, summary in summaries.items()
    }
    best = max(answered, key=lambda alias: answered[alias], default=None)
    return best if best is not None and answered[best] > 0 else None


_ANSWERED: Final = "gRPC Publish handler (total)"


def between_nodes(cluster: LocalCluster, leader: str) -> dict[str, list[float]]:
    """The hops of the leader's entries between the nodes (bench/timeline.py)."""
    timelines = timeline.load({alias: trace_path(cluster.root, alias) for alias in cluster.nodes})
    if leader not in timelines:
        return {}
    followers = [found for alias, found in timelines.items() if alias != leader]
    return timeline.hops(timelines[leader], followers)


def cpu_ms_per_10k_rows(result: throughput.CellResult) -> float:
    nodes = sum(cores for alias, cores in result.cpu_cores.items() if alias != "client")
    return nodes * result.wall_s * 1000 / max(result.rows, 1) * 10_000


def run(args: argparse.Namespace) -> int:
    cells = [tuple(int(part) for part in cell.split(":")) for cell in args.cells]
    settings = throughput.Settings(
        duration_s=args.duration,
        cell_bytes_max=int(args.cell_mb * 1e6),
        repeats=args.repeat,
        grid={},
        purge_interval_s=60.0,
        election_timeout_s=1.5,
    )
    pools = {
        (columns, batch): common.payloads(
            common.schema_for(columns), batch, max(1, min(8, (32 << 20) // (batch * 1300)))
        )
        for columns in args.columns
        for _, batch in cells
    }
    results: dict[str, list[throughput.CellResult]] = {config: [] for config in args.configs}
    traces: dict[str, list[dict[str, object]]] = {}
    between: dict[str, dict[str, list[float]]] = {}  # config -> hop -> seconds (timeline.py)
    versions: set[str] = set()
    for repeat in range(args.repeat):
        shift = repeat % len(args.configs)
        for config in args.configs[shift:] + args.configs[:shift]:
            versions.add(common.code_version())  # what the nodes about to start will run
            root = Path(tempfile.mkdtemp(prefix="hastream-experiment-"))
            cluster = LocalCluster(
                root,
                purge_interval_s=60.0,
                election_timeout_s=1.5,
                environment=node_environment(config, root, trace=args.trace),
            )
            try:
                cluster.start()
                cluster.leader(common.HA_GROUP)
                for columns in args.columns:
                    for threads, batch in cells:
                        for mode in args.modes:
                            result = throughput.run_cell(
                                cluster, mode, threads, batch, columns, repeat, settings,
                                pools[columns, batch],
                            )  # fmt: skip
                            results[config].append(result)
                            print(f"{config:>40} {throughput._progress_line(result)}", flush=True)
            finally:
                cluster.stop()
                summaries = read_traces(cluster)
                leader = publish_leader(summaries)
                for alias, summary in summaries.items():
                    role = "leader" if alias == leader else "follower"
                    traces.setdefault(config, []).append({"node": alias, "role": role, **summary})
                if leader is not None:
                    hops = between_nodes(cluster, leader)
                    for hop, seconds in hops.items():
                        between.setdefault(config, {}).setdefault(hop, []).extend(seconds)
                shutil.rmtree(root, ignore_errors=True)
    text = report(args, cells, results, sorted(versions)) + trace_report(traces, between)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    (args.out / f"{args.name}.json").write_text(
        json.dumps(
            {
                "results": {c: [asdict(r) for r in rs] for c, rs in results.items()},
                "traces": traces,
            },
            indent=1,
        )
    )
    print(text)
    return 0


def report(
    args: argparse.Namespace,
    cells: list[tuple[int, ...]],
    results: dict[str, list[throughput.CellResult]],
    versions: list[str],
) -> str:
    base = args.configs[0]
    lines = [
        f"# Experiment: {' vs '.join(args.configs)}",
        "",
        f"`python -m bench.experiment {' '.join(sys.argv[1:])}` on code "
        f"{' and '.join(versions)}"
        f"{' (the code changed during the run!)' if len(versions) > 1 else ''}. "
        f"Medians of {args.repeat} "
        f"repeat(s), {args.duration:g} s per cell; speed-up = median rows/s over the median of "
        f"`{base}`. CPU = node CPU ms per 10,000 rows (three node processes summed). Load "
        f"average {common.load_average():.1f} at the end (2 cores, shared).",
        "",
        "| cell | mode | " + " | ".join(f"`{c}`" for c in args.configs) + " |",
        "|---|---|" + "---:|" * len(args.configs),
    ]
    for columns in args.columns:
        for threads, batch in cells:
            for mode in args.modes:
                cell = [
                    [
                        r
                        for r in results[config]
                        if (r.columns, r.threads, r.batch_rows, r.mode)
                        == (columns, threads, batch, mode)
                    ]
                    for config in args.configs
                ]
                rates = [common.median([r.rows_per_s for r in rs]) for rs in cell]
                cpus = [common.median([cpu_ms_per_10k_rows(r) for r in rs]) for rs in cell]
                p50s = [common.median([r.latency_p50_ms for r in rs]) for rs in cell]
                entries = [common.median([r.publishes_per_entry for r in rs]) for rs in cell]
                values = []
                for rate, cpu, p50, per_entry in zip(rates, cpus, p50s, entries, strict=True):
                    speedup = rate / rates[0] if rates[0] and not math.isnan(rate) else math.nan
                    values.append(
                        f"{rate:,.0f} rows/s (x{speedup:.2f}), p50 {p50:.1f} ms, "
                        f"CPU {cpu:,.1f} ms, {per_entry:.1f} pub/entry"
                    )
                label = f"{columns}c {threads}t batch {batch:,}"
                lines.append(f"| {label} | {throughput.MODE_LABEL[mode]} | " + " | ".join(values))
    return "\n".join(lines) + "\n"


def trace_report(
    traces: dict[str, list[dict[str, object]]],
    between: dict[str, dict[str, list[float]]] | None = None,
) -> str:
    """Median over runs of each stage's p50, for the leader and for the followers; then,
    from the nodes' timelines, the hops between them (every entry of every run)."""
    lines: list[str] = []
    for config, hops in (between or {}).items():
        lines += ["", f"## Between the nodes: `{config}` (bench/timeline.py, ms)", ""]
        lines += timeline.report(hops)
    for config, runs in traces.items():
        lines += ["", f"## Where an entry's time goes: `{config}` (raftstore/trace.py, ms)", ""]
        lines += ["| node | stage | p50 | p90 | mean | count |", "|---|---|---:|---:|---:|---:|"]
        for role in ("leader", "follower"):
            stages: dict[str, list[dict[str, float]]] = {}
            for run in runs:
                if run["role"] != role:
                    continue
                for stage, stats in run.items():
                    if isinstance(stats, dict):
                        stages.setdefault(stage, []).append(stats)
            for stage, stats in stages.items():
                if "p50_ms" not in stats[0]:
                    total = sum(int(s["count"]) for s in stats)
                    lines.append(f"| {role} | {stage} | | | | {total} |")
                    continue
                lines.append(
                    f"| {role} | {stage} "
                    f"| {common.median([s['p50_ms'] for s in stats]):.2f} "
                    f"| {common.median([s['p90_ms'] for s in stats]):.2f} "
                    f"| {common.median([s['mean_ms'] for s in stats]):.2f} "
                    f"| {sum(int(s['count']) for s in stats)} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.experiment",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--configs", nargs="+", default=["baseline"])
    parser.add_argument("--cells", nargs="+", default=["1:1", "4:1", "1:10000", "4:10000"])
    parser.add_argument("--columns", type=int, nargs="+", default=[11])
    parser.add_argument("--modes", nargs="+", default=["ha"], choices=throughput.MODES)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--cell-mb", type=float, default=200.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--trace",
        action="store_true",
        help="nodes record where an entry's time goes; report the stages",
    )
    parser.add_argument("--name", default="experiment")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR / "experiments")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
