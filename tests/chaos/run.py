"""Long chaos runs from the command line (the CI runs short ones through pytest).

    python -m tests.chaos.run random --minutes 30 --seed 7
    python -m tests.chaos.run random --minutes 30 --seeds 5          # 5 runs, seeds 1..5
    python -m tests.chaos.run random --minutes 10 --faults kill stop restart low-fd
    python -m tests.chaos.run campaign --rounds 20 --nodes 3 5       # every class, both sizes
    python -m tests.chaos.run campaign --rounds 20 --class flip-data kill-leader

Each run logs its events as they happen (stderr), then prints its report (problems, then
the events with their times) and the seed that reproduces it; the exit code is 1 if any
run found a problem. `--verbose` adds the clients' own log lines. Needs root for the tmpfs
data disks (`--no-disks` leaves the disk-full faults out).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from tests.chaos import faults
from tests.chaos.campaign import PURGE_INTERVAL_S, FaultClass, run_campaign
from tests.chaos.randomized import FAULTS, run_random


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--no-disks", action="store_true", help="no tmpfs, no disk-full faults")
    parser.add_argument("--verbose", action="store_true", help="log the clients (INFO)")
    sub = parser.add_subparsers(dest="mode", required=True)
    random_run = sub.add_parser("random", help="the seeded randomised run")
    random_run.add_argument("--minutes", type=float, default=30.0)
    random_run.add_argument("--seed", type=int, default=None, help="default: from the clock")
    random_run.add_argument("--seeds", type=int, default=1, help="runs, seeds seed..seed+N-1")
    random_run.add_argument(
        "--faults",
        nargs="+",
        default=None,
        choices=sorted(FAULTS),
        help="only these faults (default: all)",
    )
    _add_log_knobs(random_run, "1, 2 or 5, drawn from the seed")
    campaign = sub.add_parser("campaign", help="rounds of each fault class")
    campaign.add_argument("--rounds", type=int, default=20)
    campaign.add_argument("--nodes", type=int, nargs="+", default=[3, 5])
    campaign.add_argument("--seed", type=int, default=1)
    campaign.add_argument(
        "--class",
        dest="classes",
        nargs="+",
        default=None,
        choices=[fault.value for fault in FaultClass],
    )
    _add_log_knobs(campaign, f"{PURGE_INTERVAL_S:g}")
    return parser.parse_args(argv)


def _add_log_knobs(parser: argparse.ArgumentParser, default_interval: str) -> None:
    parser.add_argument(
        "--purge-interval",
        type=float,
        default=None,
        help=f"the checkpoint interval, s (default: {default_interval}); 600: checkpoints "
        "only when the Raft log reaches its size limit (not with the campaign's "
        "flip-checkpoint, which waits for a checkpoint file, nor mix, which may choose it)",
    )
    parser.add_argument(
        "--resident-bytes",
        type=int,
        default=None,
        help="the nodes' Raft journals hold this many command bytes in memory (default 96 "
        "MiB); e.g. 1048576: replays and lagging followers read entries back from the files",
    )


def _random(args: argparse.Namespace, disks: bool) -> bool:
    first = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    passed = True
    for seed in range(first, first + args.seeds):
        result = run_random(
            seed,
            duration_s=args.minutes * 60,
            disks=disks,
            fault_names=args.faults,
            purge_interval_s=args.purge_interval,
            journal_resident_bytes=args.resident_bytes,
        )
        print(result.report, flush=True)
        print(
            f"RESULT random seed={seed} {'PASS' if result.passed else 'FAIL'} "
            f"faults={result.faults} acked_rows={result.acked_rows} "
            f"elapsed_s={result.elapsed_s:.0f}  (reproduce: python -m tests.chaos.run "
            f"random --minutes {args.minutes:g} --seed {seed}{_knob_flags(args)})",
            flush=True,
        )
        passed &= result.passed
    return passed


def _knob_flags(args: argparse.Namespace) -> str:
    flags = "" if args.purge_interval is None else f" --purge-interval {args.purge_interval:g}"
    if args.resident_bytes is not None:
        flags += f" --resident-bytes {args.resident_bytes}"
    return flags


def _campaign(args: argparse.Namespace, disks: bool) -> bool:
    classes = [FaultClass(value) for value in args.classes] if args.classes else list(FaultClass)
    summary: list[str] = []
    for nodes in args.nodes:
        for fault in classes:
            if not fault.fits(nodes) or (fault.needs_disks and not disks):
                continue
            result = run_campaign(
                fault,
                nodes=nodes,
                rounds=args.rounds,
                seed=args.seed,
                disks=disks,
                purge_interval_s=args.purge_interval,
                journal_resident_bytes=args.resident_bytes,
            )
            print(result.report, flush=True)
            line = (
                f"{fault.value:20} nodes={nodes} {'PASS' if result.passed else 'FAIL'} "
                f"rounds={result.rounds_done}/{args.rounds} acked_rows={result.acked_rows} "
                f"elapsed_s={result.elapsed_s:.0f} seed={args.seed}{_knob_flags(args)}"
            )
            print(f"RESULT {line}", flush=True)
            summary.append(line)
    print("\n".join(["SUMMARY", *summary]))
    return all(" PASS " in line for line in summary)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    # The run's events as they happen, not only in the report at its end: a run that takes
    # far longer than --minutes (a stuck group, a wait that does not end) shows where it is.
    logging.getLogger("tests.chaos.scenario").setLevel(logging.INFO)
    disks = not args.no_disks
    if disks:
        refusal = faults.tmpfs_refusal(faults.scratch_dir())
        if refusal is not None:
            print(f"{refusal}; running without disk-full faults", file=sys.stderr)
            disks = False
    passed = _random(args, disks) if args.mode == "random" else _campaign(args, disks)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
