"""hastream.grpc_engine: importing the client or the node picks gRPC's polling engine before
grpc is imported, and never overrides the user's own choice. Each case runs in a fresh
interpreter: gRPC reads the variable once, at its import."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hastream import grpc_engine

REPO = Path(__file__).resolve().parents[1]


def _experiments_after(code: str, environment: dict[str, str]) -> str | None:
    env = {key: value for key, value in os.environ.items() if key != "GRPC_EXPERIMENTS"}
    env.update(environment)
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"{code}\nimport os\nprint(repr(os.environ.get('GRPC_EXPERIMENTS')))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    value: str | None = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    return value


@pytest.mark.parametrize("package", ["api_clients", "raftstore", "spark_publisher", "bench"])
def test_importing_the_client_the_node_or_the_benchmarks_first_picks_the_polling_engine(
    package: str,
) -> None:
    assert _experiments_after(f"import {package}", {}) == grpc_engine.POLLING


def test_grpc_imported_first_is_left_as_it_is() -> None:
    # Too late to matter: gRPC has read its configuration, so nothing pretends otherwise.
    assert _experiments_after("import grpc\nimport api_clients", {}) is None


@pytest.mark.parametrize("chosen", ["", "-event_engine_client"])
def test_the_users_own_setting_wins(chosen: str) -> None:
    assert _experiments_after("import api_clients", {"GRPC_EXPERIMENTS": chosen}) == chosen


def test_a_unary_call_works_on_the_polling_engine() -> None:
    # The cluster tests run every call on it; this is the smallest call that shows it.
    code = (
        "import api_clients, grpc\n"
        "from concurrent import futures\n"
        "server = grpc.server(futures.ThreadPoolExecutor(1))\n"
        "handler = grpc.method_handlers_generic_handler(\n"
        "    'e', {'E': grpc.unary_unary_rpc_method_handler(lambda request, context: request)})\n"
        "server.add_generic_rpc_handlers((handler,))\n"
        "port = server.add_insecure_port('127.0.0.1:0')\n"
        "server.start()\n"
        "channel = grpc.insecure_channel(f'127.0.0.1:{port}')\n"
        "assert channel.unary_unary('/e/E')(b'ping', timeout=30) == b'ping'\n"
    )
    assert _experiments_after(code, {}) == grpc_engine.POLLING
