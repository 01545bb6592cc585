from __future__ import annotations

import sys
from pathlib import Path

# The repo root on sys.path: tests import raftstore, api_clients, proto and tests.harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
