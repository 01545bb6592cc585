"""What a small piece of Python work costs right after its thread slept: the "cold" price
that every wake-up of a node or client thread pays on this machine.

    python -m bench.cold_code [--seconds 1.5] [--spinners 2]

Each workload runs in a loop for --seconds per pause: back to back ("tight"), and after a
`time.sleep` of 0.2 ms and of 3 ms (a waited publish's client sleeps about that long for
its answer). Reported: the median thread CPU of one call (`time.thread_time`, so the sleep
and any wait for a CPU are not in it). Where the three differ, the work pays for caches,
TLBs and branch predictors that other processes, or the host while this VM's CPU halted,
took over. `--spinners N` starts N busy loops at nice 19 beside it (vCPUs that never halt,
whose time a nice-0 process takes first): what is left of the difference is the other
process's cache pollution, what goes away is the halt's.

Workloads: a pure-Python loop (`sum(range(2000))`), one 11-column row packed with `struct`
(what a NATS client does per row), and one row through the public client's encoders
(`row_path.rows_batch` + `batches.encode_batch`, a waited one-row `Publisher.append`'s
conversion).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Final

from api_clients.batches import encode_batch
from api_clients.row_path import rows_batch
from bench.publish_rows import SCHEMA, one_row, one_row_bytes

PAUSES_S: Final = (0.0, 0.0002, 0.003)


def _python_loop(_: int) -> object:
    return sum(range(2000))


def _arrow_row(number: int) -> object:
    return encode_batch(rows_batch(one_row(number), SCHEMA), SCHEMA)


WORKLOADS: Final[dict[str, Callable[[int], object]]] = {
    "sum(range(2000))": _python_loop,
    "struct-packed row": one_row_bytes,
    "rows_batch + encode_batch, 1 row": _arrow_row,
}


def call_costs_us(work: Callable[[int], object], pause_s: float, seconds: float) -> list[float]:
    """Thread CPU of each call of `work`, each after a sleep of `pause_s` (none: tight)."""
    costs, number = [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.thread_time()
        work(number)
        costs.append((time.thread_time() - started) * 1e6)
        number += 1
        if pause_s:
            time.sleep(pause_s)
    return costs


@contextlib.contextmanager
def spinners(count: int) -> Iterator[None]:
    loop = [sys.executable, "-c", "while True: pass"]
    processes = [subprocess.Popen(["nice", "-n", "19", *loop]) for _ in range(count)]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


def table(seconds: float) -> list[str]:
    head = " | ".join(["tight" if not p else f"after {p * 1000:g} ms sleep" for p in PAUSES_S])
    lines = [f"| workload | {head} |", "|---|" + "---:|" * len(PAUSES_S)]
    for name, work in WORKLOADS.items():
        work(0)  # imports and caches made once
        medians = [statistics.median(call_costs_us(work, p, seconds)) for p in PAUSES_S]
        lines.append(f"| {name} | " + " | ".join(f"{m:,.1f} us" for m in medians) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_code", description=__doc__)
    parser.add_argument("--seconds", type=float, default=1.5, help="per workload and pause")
    parser.add_argument("--spinners", type=int, default=0, help="nice-19 busy loops beside")
    args = parser.parse_args(argv)
    with spinners(args.spinners):
        print("\n".join(table(args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
