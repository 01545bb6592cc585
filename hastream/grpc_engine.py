"""gRPC's I/O for this project's processes: its polling engine, not its EventEngine threads.

Importing this module (the node's `raftstore` and the client's `api_clients` packages do it
first thing) sets `GRPC_EXPERIMENTS` to `POLLING` unless the variable is already set, before
grpc itself is imported. From grpcio 1.6x on, client calls and server listeners run on the
EventEngine: its own threads take each socket event and wake the Python thread waiting for
it, so every call is one more hand-off between threads on each side. With these two
experiments off, the thread that waits (a caller's, or the server's polling thread) reads the
socket itself, as gRPC did before.

Measured here (2 cores, grpcio 1.85): a unary echo call with client and server in one process,
4,000 calls, 8 paired runs: x0.87 CPU and x0.86 wall time per call; a three-node cluster,
`bench.checkouts_ab`, node CPU per row x0.96 and context switches per append x0.89 (waited
one-row publishes), x0.96 and x0.76 (async 100 rows), x1.01 and x0.84 (async 10,000 rows).

gRPC reads the variable once, when it is imported: after that, setting it changes nothing,
so nothing is set then. A user's own setting wins; `GRPC_EXPERIMENTS=""` keeps gRPC's
defaults. gRPC means to remove these experiments once its EventEngine has settled (it became
Python's default in grpcio 1.80); an experiment a grpcio no longer knows is only logged by
gRPC ("Unknown experiment"), never an error. `bench.thread_costs` and `bench.checkouts_ab`
show whether the setting still pays after a grpcio upgrade.
"""

from __future__ import annotations

import os
import sys
from typing import Final

ENVIRONMENT_VARIABLE: Final = "GRPC_EXPERIMENTS"
POLLING: Final = "-event_engine_client,-event_engine_listener"


def use_polling_engine() -> bool:
    """Ask for gRPC's polling engine unless grpc is already imported or the user chose;
    True if the variable was set here."""
    if "grpc" in sys.modules or ENVIRONMENT_VARIABLE in os.environ:
        return False
    os.environ[ENVIRONMENT_VARIABLE] = POLLING
    return True


use_polling_engine()
