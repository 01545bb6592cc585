"""Where the time of the write path goes: py-spy on the node processes under a steady load.

    python -m bench.profile --mode ha --threads 4 --batch 1 --columns 11 [--idle]
    python -m bench.profile --mode ha --threads 4 --batch 1 --pipeline 64   # PublishStream

Starts a local three-node cluster, publishes to one table exactly as bench.throughput does
(over the publish port, pre-built Arrow IPC payloads), and while the load runs records every node
process (and with --client this benchmark process) with `py-spy record --threads
--function --nonblocking`. Without --idle the samples are CPU time (threads on CPU); with
--idle every thread is sampled whether it runs or waits, which shows wall time: fdatasync,
polls, lock and queue waits; with --gil only the thread holding the GIL is, which is a
GIL-bound node's Python work (py-spy counts a thread waiting for the GIL as on CPU).

Writes, under bench/results/profiles/:
- <name>-<alias>.txt: py-spy's collapsed stacks ("thread;frame;frame count"), for flame
  graph tools (flamegraph.pl, speedscope, https://www.speedscope.app);
- <name>.md: per process, samples by thread, by stage of the write path, and the top
  functions by self and by inclusive samples.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench import common
from bench.throughput import _PipelinedWorker, _port_publish, _Worker
from deploy.local_cluster import LocalCluster
from proto import hastream_pb2 as pb


# Stages of the write path, matched against the frames of a stack from the innermost out:
# the first stage whose pattern matches some frame owns the sample. Order matters (an
# fdatasync inside apply counts as fsync).
def _frames(module: str, functions: str) -> re.Pattern[str]:
    """Frames of `functions` (a regex alternation; "Class." prefixes allowed) in `module`."""
    return re.compile(rf"^(?:[\w<>.]+\.)?({functions}) \({module}")


STAGES: Final[list[tuple[str, re.Pattern[str]]]] = [
    ("journal fdatasync", _frames("raftstore/storage/journal", "sync|flush")),
    ("data-file fsync", _frames("raftstore/storage/segments", "sync|_sync_oldest_sealed")),
    ("checkpoint", _frames("", "write_checkpoint|checkpoint|deleteEntriesTo|write_atomic")),
    ("journal write", _frames("raftstore/storage/journal", "add|_encode_record")),
    ("validate payload (Arrow)",
     _frames("", "validate_append|validate_payload|_check_payload|_read_stream")),
    ("apply: data files",
     _frames("raftstore/storage/(segments|format)", "append|_write_all|encode_record")),
    ("apply: IPC serialize", _frames("raftstore/tables", "append")),
    ("apply: state machine",
     _frames("raftstore/state_machine", "apply|_apply_append|_apply_item|_combine")),
    ("apply: decode", _frames("raftstore/commands", "decode")),
    ("propose: encode", _frames("raftstore/commands", "encode")),
    ("peer auth (MAC)", _frames("", "_mac|encrypt_at_time|extract_timestamp|decrypt")),
    ("peer pickle", _frames("pysyncobj/pickle", "dumps|loads")),
    ("peer TCP send", _frames("pysyncobj/tcp_connection", "send|__processSend|__trySendBuffer")),
    ("peer TCP receive",
     _frames("pysyncobj/tcp_connection", "__processRead|__processParseMessage|__tryReadBuffer")),
    ("raft poll (waiting)", _frames("pysyncobj/poller", "poll")),
    ("raft tick (other)", re.compile(r"\(pysyncobj/")),
    ("batcher", re.compile(r"\(raftstore/batcher")),
    ("local replica", re.compile(r"\(raftstore/local_replica")),
    ("gRPC publish handler", _frames("raftstore/(service|group)", "Publish|publish|_wait")),
    ("PublishStream handler", re.compile(r"\(raftstore/pipeline")),
    ("client pipeline", re.compile(r"\(api_clients/")),
    ("subscriptions", re.compile(r"\(raftstore/(subscriptions|service)")),
    ("gRPC runtime", re.compile(r"\(grpc/")),
    ("thread pool / waits",
     _frames("(threading|concurrent|queue)", "wait|_worker|get|acquire|result")),
]  # fmt: skip
THREAD_GROUPS: Final[list[tuple[str, re.Pattern[str]]]] = [
    ("tick (pysyncobj)", re.compile(r"^Thread-\d+ \(_autoTickThread\)|_autoTickThread")),
    ("grpc", re.compile(r"^grpc|\(_serve\)")),
    ("batcher", re.compile(r"^batcher")),
    ("publish-stream reader", re.compile(r"^publish-stream")),
    ("client pipeline driver", re.compile(r"^publish-pipeline")),
    ("local-replica", re.compile(r"^local-replica")),
    ("main", re.compile(r"^MainThread")),
]


@dataclass
class Profile:
    alias: str
    samples: int = 0
    by_thread: collections.Counter[str] = field(default_factory=collections.Counter)
    by_stage: collections.Counter[str] = field(default_factory=collections.Counter)
    by_thread_stage: collections.Counter[tuple[str, str]] = field(
        default_factory=collections.Counter
    )
    self_time: collections.Counter[str] = field(default_factory=collections.Counter)
    inclusive: collections.Counter[str] = field(default_factory=collections.Counter)


def _short(frame: str) -> str:
    """'func (/abs/path/site-packages/pkg/mod.py)' -> 'func (pkg/mod)'."""
    match = re.match(r"^(.*) \((.*?)(?::\d+)?\)$", frame)
    if match is None:
        return frame
    name, path = match.groups()
    for marker in ("site-packages/", "/work/main/", str(common.REPO) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    path = re.sub(r"^.*/lib/python3\.\d+/", "", path)
    return f"{name} ({path.removesuffix('.py')})"


def _thread_group(stack: list[str]) -> str:
    text = ";".join(stack[:4])
    for name, pattern in THREAD_GROUPS:
        if pattern.search(text):
            return name
    return stack[0] if stack else "?"


def _stage(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, pattern in STAGES:
            if pattern.search(frame):
                return name
    return "other"


def parse(alias: str, path: Path) -> Profile:
    profile = Profile(alias)
    for line in path.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text:
            continue
        count = int(count_text)
        _, _, rest = stack_text.partition(": ")
        parts = rest.split(";")
        thread_name, frames = parts[0], [_short(frame) for frame in parts[1:]]
        group = _thread_group([thread_name, *frames])
        stage = _stage(frames)
        profile.samples += count
        profile.by_thread[group] += count
        profile.by_stage[stage] += count
        profile.by_thread_stage[group, stage] += count
        if frames:
            profile.self_time[frames[-1]] += count
        for frame in set(frames):
            profile.inclusive[frame] += count
    return profile


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def report(profiles: list[Profile], title: str, notes: list[str], top: int = 20) -> str:
    lines = [f"# Profile: {title}", "", *notes, ""]
    for profile in profiles:
        total = profile.samples
        lines += [f"## {profile.alias} ({total} samples)", "", "| thread | share |", "|---|---:|"]
        for name, count in profile.by_thread.most_common():
            lines.append(f"| {name} | {_percent(count, total)} |")
        lines += [
            "",
            "| stage of the write path | share | of which tick thread |",
            "|---|---:|---:|",
        ]
        for stage, count in profile.by_stage.most_common():
            tick = profile.by_thread_stage.get(("tick (pysyncobj)", stage), 0)
            lines.append(f"| {stage} | {_percent(count, total)} | {_percent(tick, total)} |")
        for thread in ("tick (pysyncobj)", "local-replica", "batcher"):
            thread_total = profile.by_thread.get(thread, 0)
            if thread_total < total * 0.05:
                continue
            lines += ["", f"Thread {thread}: where its samples go", ""]
            lines += ["| stage | share of this thread |", "|---|---:|"]
            stages = [
                (stage, count)
                for (name, stage), count in profile.by_thread_stage.items()
                if name == thread
            ]
            for stage, count in sorted(stages, key=lambda item: -item[1]):
                lines.append(f"| {stage} | {_percent(count, thread_total)} |")
        lines += ["", f"Top {top} functions by self samples:", ""]
        lines += ["| function | self | inclusive |", "|---|---:|---:|"]
        for frame, count in profile.self_time.most_common(top):
            lines.append(
                f"| `{frame}` | {_percent(count, total)} "
                f"| {_percent(profile.inclusive[frame], total)} |"
            )
        lines += ["", f"Top {top} functions by inclusive samples:", ""]
        lines += ["| function | inclusive |", "|---|---:|"]
        for frame, count in profile.inclusive.most_common(top):
            lines.append(f"| `{frame}` | {_percent(count, total)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _spy(
    pid: int, duration_s: float, path: Path, args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    command = [
        shutil.which("py-spy") or "py-spy",
        "record",
        "--pid", str(pid),
        "--duration", str(max(1, round(duration_s))),
        "--rate", str(args.rate),
        "--format", "raw",
        "--threads",
        "--function",
        "--output", str(path),
    ]  # fmt: skip
    if args.idle:
        command.append("--idle")
    if args.gil:
        command.append("--gil")
    # Native frames (C: memcpy, malloc, Arrow, syscalls' wrappers) need the process paused
    # while sampled; without them sample without pausing.
    command.append("--native" if args.native else "--nonblocking")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def run(args: argparse.Namespace) -> int:
    name = args.name or (
        f"{args.mode}-t{args.threads}-b{args.batch}-c{args.columns}"
        + (f"-p{args.pipeline}" if args.pipeline else "")
        + ("-wall" if args.idle else "-gil" if args.gil else "-cpu")
        + ("-native" if args.native else "")
        + (f"-{args.tuning.replace(',', '+').replace('=', '')}" if args.tuning else "")
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    schema = common.schema_for(args.columns)
    pool = common.payloads(schema, args.batch, max(1, min(8, (64 << 20) // (args.batch * 200))))
    with common.bench_cluster(
        purge_interval_s=args.purge_interval,
        election_timeout_s=1.5,
        environment=common.tuning_environment(args.tuning),
    ) as cluster:
        leader = cluster.leader(common.HA_GROUP)
        group = common.HA_GROUP if args.mode == "ha" else common.LOCAL_GROUP
        table = f"profile_{args.mode}"
        leader = common.create_table(cluster, leader, table, schema, group=group)
        stats = _load(cluster, leader, table, pool, args, name, out)
        order = [leader] + [alias for alias in cluster.nodes if alias != leader]
    profiles = []
    for alias in [*order, "client"]:
        path = out / f"{name}-{alias}.txt"
        if path.exists():
            label = (
                alias
                if alias == "client"
                else f"{alias} ({'leader' if alias == leader else 'follower'})"
            )
            profiles.append(parse(label, path))
    kind = (
        "wall time (--idle: running and waiting threads)"
        if args.idle
        else "the thread holding the GIL (--gil)"
        if args.gil
        else "CPU (threads on CPU)"
    )
    notes = [
        f"`python -m bench.profile {' '.join(sys.argv[1:])}` (code {common.code_version()}): "
        f"{args.mode} table, "
        f"{args.threads} publisher thread(s), batch {args.batch} rows, {args.columns} columns, "
        + (
            f"pipelined (PublishStream, {args.pipeline} in flight per thread), "
            if args.pipeline
            else "unary Publish, "
        )
        + f"py-spy {args.rate} Hz for {args.duration:g} s, samples = {kind}.",
        f"Throughput while profiled: {stats['rows_per_s']:,.0f} rows/s, ack p50 "
        f"{stats['p50_ms']:.1f} ms, p99 {stats['p99_ms']:.1f} ms, CPU cores "
        + ", ".join(f"{alias} {cores:.2f}" for alias, cores in stats["cpu"].items())
        + f", load average {stats['load']:.1f}. Sampling slows the nodes; compare shares, not "
        "absolute rates. 'stage' attributes each sample to the innermost write-path stage "
        "on its stack.",
    ]
    text = report(profiles, name, notes)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(stats, indent=1))
    print(text)
    return 0


def _load(
    cluster: LocalCluster,
    leader: str,
    table: str,
    pool: list[bytes],
    args: argparse.Namespace,
    name: str,
    out: Path,
) -> dict[str, object]:
    ports = []
    warm_s = 2.0
    barrier = threading.Barrier(args.threads + 1)
    deadline = [math.inf]
    workers: list[_Worker | _PipelinedWorker] = []
    for number in range(args.threads):
        shifted = pool[number:] + pool[:number]
        if args.pipeline:
            site = f"127.0.0.1:{cluster.nodes[leader].port}"
            workers.append(
                _PipelinedWorker(
                    site, table, shifted, args.batch, args.pipeline, 10**12, barrier, deadline
                )
            )
            continue
        requests = [pb.PublishRequest(table=table, payload=p) for p in shifted]
        # Over the publish port, as the grid's unary cells and the client's waited publishes.
        publish, port = _port_publish(cluster, leader)
        ports.append(port)
        workers.append(_Worker(publish, requests, 10**12, barrier, deadline))
    for worker in workers:
        worker.start()
    pids = common.node_pids(cluster)
    if args.mode == "local":
        pids = {leader: pids[leader]}
    barrier.wait()  # the workers have warmed up
    started = time.perf_counter()
    deadline[0] = started + warm_s + args.duration + 1.0
    barrier.wait()
    time.sleep(warm_s)  # let the load reach a steady state before sampling
    targets = dict(pids)
    if args.client:
        targets["client"] = os.getpid()
    cpu_before = common.CpuSample.take(pids)
    rows_before = sum(worker.rows for worker in workers)
    sampled_at = time.perf_counter()
    spies = {
        alias: _spy(pid, args.duration, out / f"{name}-{alias}.txt", args)
        for alias, pid in targets.items()
    }
    for alias, spy in spies.items():
        _, error = spy.communicate(timeout=args.duration + 60)
        if spy.returncode != 0:
            print(f"py-spy failed on {alias}: {error.decode(errors='replace')}", file=sys.stderr)
    wall_s = time.perf_counter() - sampled_at
    rows = sum(worker.rows for worker in workers) - rows_before
    cpu = common.CpuSample.take(pids).cores_since(cpu_before, wall_s)
    for worker in workers:
        worker.join()
    for port in ports:
        port.close()
    latencies = [value for worker in workers for value in worker.latencies]
    return {
        "rows_per_s": rows / wall_s,
        "p50_ms": common.percentile(latencies, 0.5) * 1000,
        "p99_ms": common.percentile(latencies, 0.99) * 1000,
        "cpu": cpu,
        "load": common.load_average(),
        "errors": sum(len(worker.errors) for worker in workers),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=("ha", "local"), default="ha")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--columns", type=int, default=11)
    parser.add_argument(
        "--pipeline", type=int, default=0, help="PublishStream with N in flight per thread"
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds sampled")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--idle", action="store_true", help="wall time: sample waiting threads")
    parser.add_argument(
        "--gil",
        action="store_true",
        help="only the thread holding the GIL: a GIL-bound node's Python work, without the "
        "threads that wait for the GIL (py-spy counts those as running)",
    )
    parser.add_argument("--client", action="store_true", help="also profile this client")
    parser.add_argument(
        "--native", action="store_true", help="include C frames (pauses the nodes per sample)"
    )
    parser.add_argument("--purge-interval", type=float, default=60.0)
    parser.add_argument(
        "--tuning", default="", help="HASTREAM_TUNING knobs for the nodes (A/B only)"
    )
    parser.add_argument("--name", default="")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR / "profiles")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
