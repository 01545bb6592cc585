"""bench.client_ab end to end with tiny settings: one cluster, the client of a checkout (here
the same one twice) in a child process per cell, the medians and ratios printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import client_ab

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("client", "shape"), [("threaded", "wait:1"), ("threaded", "async:100"), ("asyncio", "wait:10")]
)
def test_both_clients_publish_and_the_ratios_are_printed(
    capsys: pytest.CaptureFixture[str], client: str, shape: str
) -> None:
    argv = ["--a", str(REPO), "--b", str(REPO), "--shape", shape, "--client", client]
    assert client_ab.main([*argv, "--rounds", "1", "--seconds", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "round 0 A:" in out
    assert "round 0 B:" in out
    assert "rows_per_s: A " in out
    assert "cpu_us_per_append: A " in out
    assert ("p50_ms: A " in out) == shape.startswith("wait"), out


def test_a_directory_that_is_not_a_checkout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        client_ab.main(["--a", str(REPO), "--b", str(tmp_path)])


def test_the_asyncio_client_takes_waited_shapes_only() -> None:
    with pytest.raises(SystemExit):
        client_ab.main(
            ["--a", str(REPO), "--b", str(REPO), "--client", "asyncio", "--shape", "async:10"]
        )


def test_the_summary_pairs_each_round_with_its_own() -> None:
    a = [client_ab.Cell(1000, 200, 1.0), client_ab.Cell(2000, 100, 2.0)]
    b = [client_ab.Cell(1100, 180, 1.0), client_ab.Cell(2200, 90, 2.0)]
    lines = client_ab.summary(a, b)
    assert lines[0] == "rows_per_s: A 1,500.00, B 1,650.00, B/A x1.100 (round by round x1.100)"
    assert lines[1].endswith("B/A x0.900 (round by round x0.900)")
    assert lines[2] == "p50_ms: A 1.50, B 1.50, B/A x1.000 (round by round x1.000)"
