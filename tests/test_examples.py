"""The examples run as a user runs them: a script outside the checkout's working directory,
against a real cluster, twice (a tour must be re-runnable)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import LocalCluster

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.cluster


def test_the_tour_runs_and_runs_again(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", groups=(2, 3))
    cluster.start()
    try:
        cluster.leader(2)
        sites = ",".join(node.site for node in cluster.nodes.values())
        environment = {**os.environ, "PYTHONPATH": str(REPO)}
        for _ in range(2):
            run = subprocess.run(
                [sys.executable, str(REPO / "examples" / "tour.py"), "--sites", sites],
                cwd=tmp_path,
                env=environment,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert run.returncode == 0, run.stdout + run.stderr
            assert "appended rows [0, 100)" in run.stdout
            assert "appended 10 new rows, 10 duplicates dropped" in run.stdout
            assert "subscriber received 110 rows, ids 0..109" in run.stdout
            assert "group 2 is led by 127.0.0.1:" in run.stdout
    finally:
        cluster.stop()
