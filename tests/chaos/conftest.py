"""Fixtures of the chaos tests: the seed and whether tmpfs data disks can be mounted here.

The seed: --chaos-seed N, else $CHAOS_SEED (a number, or `random` for a fresh one that every
failure message names), else CI_SEED. The suite replays a fixed seed so that its verdict
is about the code, not about the draw; new seeds are explored by `CHAOS_SEED=random` and by
the long runs (`python -m tests.chaos.run`, docs/chaos.md), and a seed they find failing
becomes a regression test."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.chaos import faults

CI_SEED = 826808


@pytest.fixture
def chaos_seed(request: pytest.FixtureRequest) -> int:
    option = request.config.getoption("--chaos-seed")
    if option is not None:
        return int(option)
    chosen = os.environ.get("CHAOS_SEED", "")
    if chosen == "random":
        return random.SystemRandom().randrange(1_000_000)
    return int(chosen) if chosen else CI_SEED


@pytest.fixture(scope="session")
def tmpfs_refusal(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """Why a tmpfs cannot be mounted here (None when it can)."""
    return faults.tmpfs_refusal(Path(tmp_path_factory.mktemp("mount-probe")))
