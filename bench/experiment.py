"""A/B measurement of candidate write-path changes (bench/patches.py) before they are written.

    python -m bench.experiment --configs baseline inflight=1 tcp-recv \\
        [--cells 1:1 4:1 1:10000 4:10000] [--columns 11] [--duration 3] [--repeat 3]

Each config is a comma-separated list of patches ("baseline" = none). For every repeat, every
config gets a fresh three-node cluster whose nodes run `python -m bench.patched_node`
(the unmodified node after the patches), then the HA cells (threads:batch) run exactly as in
bench.throughput. The configs' order rotates from repeat to repeat so drifting background
load does not favour one. Reported: median rows/s and the speed-up over the first config,
and node CPU per 10,000 rows (summed over the three node processes) - the cost of a row,
which is less sensitive than rows/s to what else runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import common, patches, throughput
from deploy.local_cluster import REPO, LocalCluster


@dataclass
class PatchedCluster(LocalCluster):
    """LocalCluster whose nodes run bench.patched_node with `patches`."""

    patches: str = ""

    def start_node(self, alias: str, *, wait: bool = True) -> None:
        node = self.nodes[alias]
        node.log_offset = node.log_path.stat().st_size if node.log_path.exists() else 0
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env[patches.TRACE_ENV] = str(self.trace_path(alias))
        env.update(patches.environment([name for name in self.patches.split(",") if name]))
        command = [sys.executable, "-m", "bench.patched_node", "--patches", self.patches, "--"]
        command += ["--config", str(self.config_path), "--node", alias]
        with node.log_path.open("ab") as log_file:
            node.process = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        if wait:
            self.wait_node_ready(alias)

    def trace_path(self, alias: str) -> Path:
        return self.root / f"{alias}-trace.json"

    def traces(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per node, the trace patch's stage summary (after stop)."""
        found = {}
        for alias in self.nodes:
            path = self.trace_path(alias)
            if path.exists():
                found[alias] = json.loads(path.read_text())
        return found


def _patches(config: str, *, trace: bool) -> str:
    names = [] if config == "baseline" else config.split(",")
    return ",".join([*names, "trace"] if trace else names)


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
    versions: set[str] = set()
    for repeat in range(args.repeat):
        shift = repeat % len(args.configs)
        for config in args.configs[shift:] + args.configs[:shift]:
            versions.add(common.code_version())  # what the nodes about to start will run
            root = Path(tempfile.mkdtemp(prefix="hastream-experiment-"))
            cluster = PatchedCluster(
                root,
                purge_interval_s=60.0,
                election_timeout_s=1.5,
                patches=_patches(config, trace=args.trace),
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
                for alias, summary in cluster.traces().items():
                    role = "leader" if any(k.startswith("leader") for k in summary) else "follower"
                    traces.setdefault(config, []).append({"node": alias, "role": role, **summary})
                shutil.rmtree(root, ignore_errors=True)
    text = report(args, cells, results, sorted(versions)) + trace_report(traces)
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


def trace_report(traces: dict[str, list[dict[str, object]]]) -> str:
    """Median over runs of each stage's p50, for the leader and for the followers."""
    lines: list[str] = []
    for config, runs in traces.items():
        lines += ["", f"## Where an entry's time goes: `{config}` (trace patch, ms)", ""]
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
    parser.add_argument("--trace", action="store_true", help="add the trace patch; report stages")
    parser.add_argument("--name", default="experiment")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR / "experiments")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
