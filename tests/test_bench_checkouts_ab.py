"""bench.checkouts_ab end to end with tiny settings: one cluster per checkout (here the same
checkout twice), a cell on each in turn, and the medians and their ratio printed."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from bench import checkouts_ab

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.cluster
@pytest.mark.parametrize("columns", ["11", "211"])
def test_both_arms_publish_and_the_ratio_is_printed(
    capsys: pytest.CaptureFixture[str],
    columns: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = ["--a", str(REPO), "--b", str(REPO), "--shape", "async:100", "--columns", columns]
    assert checkouts_ab.main([*argv, "--rounds", "1", "--seconds", "0.3"]) == 0
    assert list(tmp_path.iterdir()) == []  # both clusters' directories are gone
    out = capsys.readouterr().out
    assert "round 0 A:" in out
    assert "round 0 B:" in out
    assert "B/A: rows/s x" in out
    assert "node CPU per row x" in out
    assert "context switches per append x" in out
    switches = re.findall(r"([0-9.]+) node context switches per append", out)
    assert len(switches) == 4, out  # the round's two lines and the two medians
    assert all(float(count) > 0 for count in switches), out


def test_a_directory_that_is_not_a_checkout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        checkouts_ab.main(["--a", str(REPO), "--b", str(tmp_path)])


@pytest.mark.parametrize("text", ["wait", "sync:10", "async:0", "async:x"])
def test_a_bad_shape_is_refused(text: str) -> None:
    with pytest.raises(SystemExit):
        checkouts_ab.main(["--a", str(REPO), "--b", str(REPO), "--shape", text])
