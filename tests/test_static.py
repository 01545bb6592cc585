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
