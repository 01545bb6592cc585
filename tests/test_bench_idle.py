"""bench.idle: a real idle cluster, measured node by node, and its directory removed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import idle


@pytest.mark.cluster
def test_every_node_is_measured_and_the_cluster_is_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "clusters").mkdir()
    idle.main(["--groups", "2", "--seconds", "1", "--dir", str(tmp_path / "clusters")])
    assert list((tmp_path / "clusters").iterdir()) == []
    out = capsys.readouterr().out
    assert out.startswith("idle cluster, 2 Raft group(s), 1 s, code ")
    rows = re.findall(r"^\| (node\d) \| ([0-9.]+) \| ([0-9,]+) \|$", out, re.MULTILINE)
    assert [alias for alias, _, _ in rows] == ["node1", "node2", "node3"], out
    # Every node's tick threads woke at least for the leaders' heartbeats.
    assert all(int(wakeups.replace(",", "")) > 0 for _, _, wakeups in rows), out
