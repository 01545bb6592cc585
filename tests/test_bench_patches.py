"""bench/patches.py stands in for private names of the node: each patch must still find
what it replaces (a stale patch fails here, not in the middle of a benchmark)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_bench_patch_applies_to_the_current_code() -> None:
    # In a child process: the patches change process-wide state (the authenticator, the
    # journal class) that the rest of the suite relies on.
    script = (
        "import bench.patches as p\n"
        "for name in p.names():\n"
        "    if '=' not in name:\n"
        "        p.apply([name])\n"
        "p.apply(['inflight=8'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
