"""Static checks as part of the suite: the style and type gates CI enforces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *command], cwd=REPO, capture_output=True, text=True, timeout=600
    )


def test_ruff_lint_and_format_are_clean() -> None:
    lint = _run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    formatted = _run("ruff", "format", "--check", ".")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr


def test_mypy_strict_is_clean() -> None:
    # Files and settings: [tool.mypy] in pyproject.toml (generated proto code excluded).
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


# Working notes kept outside the repository: the project's files stand alone, so none names
# them (a reader of the code or the docs could not follow the reference).
OUTSIDE_NOTES = ("PYSPARK-FACTS", "PYSYNCOBJ-FACTS", "../shared", "MISSION.md", "STYLE.md")


def test_no_file_refers_to_notes_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout.split(b"\0")
    found = []
    for name in filter(None, tracked):
        path = REPO / name.decode()
        if path.suffix not in {".py", ".md", ".txt", ".toml", ".cfg", ".sh", ".yaml", ".yml"}:
            continue
        if path == Path(__file__):
            continue
        text = path.read_text(errors="replace")
        found += [f"{name.decode()}: {note}" for note in OUTSIDE_NOTES if note in text]
    assert not found, found
