"""The key window's cost per batch (`raftstore.dedup.KeyWindow.admit`), of one checkout or
two side by side.

    python -m bench.key_window [--a <checkout>] [--b .] [--rounds 5]

A keyed table's every append goes through `admit` on every replica, on the apply path. For
each case (key type and order x window rows) it fills a window, then times `admit` of
10,000-row batches of new keys, in a child process per checkout and round (so two versions
of `raftstore` never share a process), alternating A and B. Prints the median us per batch
of each, and B/A.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CASES = [
    ("rising int64", 10_000),
    ("rising int64", 1_000_000),
    ("random int64", 10_000),
    ("random int64", 1_000_000),
    ("rising timestamp[ms]", 1_000_000),
    ("two writers' rising int64", 1_000_000),
    ("random string", 100_000),
]
BATCH_ROWS = 10_000
BATCHES = 60

_CHILD = """
import json, sys, time
sys.path.insert(0, {code!r})
import numpy as np, pyarrow as pa
from raftstore.dedup import KeyWindow

kind, window_rows, batch_rows, batches = {kind!r}, {window_rows}, {batch_rows}, {batches}
rng = np.random.default_rng(1)
made = 0

def keys(count):
    global made
    if kind.startswith("two writers"):  # batches alternate between two id ranges
        start = made // 2 + (made // count % 2) * 2**40
        values = np.arange(start, start + count, dtype=np.int64)
    elif kind.startswith("rising"):
        values = np.arange(made, made + count, dtype=np.int64)
    else:
        values = rng.integers(0, 2**62, count, dtype=np.int64)
    made += count
    if kind.endswith("timestamp[ms]"):  # one row per millisecond
        return pa.array(values + 1_700_000_000_000, pa.timestamp("ms"))
    if kind.endswith("string"):
        return pa.array(values.astype(str))
    return pa.array(values)

window = KeyWindow(window_rows)
for _ in range(window_rows // batch_rows + 2):  # a full window first
    window.admit(keys(batch_rows), window.offset_to)
prepared = [keys(batch_rows) for _ in range(batches)]
started = time.perf_counter()
for batch in prepared:
    window.admit(batch, window.offset_to)
print(json.dumps((time.perf_counter() - started) / batches * 1e6))
"""


def measure(code: Path, kind: str, window_rows: int) -> float:
    """us per `admit` of one batch, in a fresh process importing `code`'s raftstore."""
    script = _CHILD.format(
        code=str(code), kind=kind, window_rows=window_rows, batch_rows=BATCH_ROWS, batches=BATCHES
    )
    output = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True
    ).stdout
    return float(json.loads(output.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.key_window")
    parser.add_argument("--a", type=Path, help="a checkout to compare with (git worktree add)")
    parser.add_argument("--b", type=Path, default=Path())
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    checkouts = {"B": args.b.resolve()}
    if args.a is not None:
        checkouts = {"A": args.a.resolve(), **checkouts}
    header = " | ".join(f"{name} us/batch" for name in checkouts)
    print(f"| keys | window rows | {header} |" + (" B/A |" if len(checkouts) == 2 else ""))
    print("|---|---:|" + "---:|" * (len(checkouts) + (len(checkouts) == 2)))
    for kind, window_rows in CASES:
        runs: dict[str, list[float]] = {name: [] for name in checkouts}
        for _ in range(args.rounds):
            for name, code in checkouts.items():
                runs[name].append(measure(code, kind, window_rows))
        medians = {name: statistics.median(values) for name, values in runs.items()}
        cells = " | ".join(f"{value:,.0f}" for value in medians.values())
        ratio = f" x{medians['B'] / medians['A']:.2f} |" if "A" in medians else ""
        print(f"| {kind} | {window_rows:,} | {cells} |{ratio}", flush=True)


if __name__ == "__main__":
    main()
