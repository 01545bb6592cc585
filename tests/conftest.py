from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The repo root on sys.path: tests import raftstore, api_clients, proto and tests.harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, settings

from deploy.ports import PORT_BAND_VARIABLE
from tests import workers

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


# --- two workers (pytest-xdist, `-n 2`: the README's test command) --------------------
# tests/workers.py says what must not meet and how; these hooks apply it.


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(workers.Scheduler(), "hastream-workers")
    worker = workers.this_worker()
    if worker is not None:
        band = workers.port_band(*worker)
        os.environ[PORT_BAND_VARIABLE] = f"{band.start}-{band.stop - 1}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Around setup, call and teardown: a module's cluster starts in its first test's setup.
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:
        yield
        return
    # The run's base temp directory (xdist gives each worker one inside it), else a
    # directory named after the run.
    basetemp = item.config.option.basetemp
    directory = (
        Path(basetemp).parent
        if basetemp
        else Path(tempfile.gettempdir()) / f"hastream-xdist-{workerinput['testrunuid']}"
    )
    path = item.path.relative_to(item.config.rootpath).as_posix()
    with workers.alone_lock(directory, alone=workers.runs_alone(path, item.name)):
        yield
