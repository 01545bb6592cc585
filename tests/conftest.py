from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The repo root on sys.path: tests import raftstore, api_clients, proto and tests.harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, settings

# CI runs bounded examples; `--hypothesis-profile long` searches for much longer (docs).
settings.register_profile(
    "default",
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("default")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-seed",
        type=int,
        default=None,
        help="seed of the chaos tests (tests/chaos); default: $CHAOS_SEED, else a new one",
    )
