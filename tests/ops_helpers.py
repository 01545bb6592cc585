"""Helpers of the operations tests: a steady publisher that measures acknowledgement gaps,
a subscriber that checks it sees every row once and in order, metrics scraping, the CLI."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from api_clients import Publisher, Session

REPO = Path(__file__).resolve().parents[1]
SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float64())])


def batch(first_id: int, rows: int) -> pa.Table:
    ids = list(range(first_id, first_id + rows))
    return pa.table({"id": ids, "value": [i * 0.5 for i in ids]}, schema=SCHEMA)


class SteadyPublisher:
    """Publishes `rows` rows every `interval_s` through the real client (which follows the
    leader and retries with an idempotency token) and records every acknowledgement.

    `failures` counts appends that raised (each is a failed publish); `longest_gap_s` is
    the longest time between two consecutive acknowledgements (the publish stall)."""

    def __init__(
        self, session: Session, table: str, *, rows: int = 10, interval_s: float = 0.02
    ) -> None:
        self._publisher = Publisher(session, table)
        self._rows = rows
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.acked: list[int] = []
        self.ack_times: list[float] = []
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._run, name="steady-publisher", daemon=True)

    def start(self) -> SteadyPublisher:
        self._thread.start()
        return self

    def _run(self) -> None:
        next_id = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._publisher.append(batch(next_id, self._rows))
            except Exception as error:  # a failed publish: recorded, the test asserts none
                self.failures.append(repr(error))
            else:
                self.acked.extend(range(next_id, next_id + self._rows))
                self.ack_times.append(time.monotonic())
            next_id += self._rows
            self._stop.wait(max(0.0, self._interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "publisher did not stop"

    def gaps_since(self, since: float) -> float:
        times = [t for t in self.ack_times if t >= since]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    @property
    def longest_gap_s(self) -> float:
        return self.gaps_since(0.0)


@dataclass
class OrderedSubscriber:
    """Collects what a subscription hands over; checks the offsets it is handed chain."""

    ids: list[int] = field(default_factory=list)
    gaps: list[tuple[int, int]] = field(default_factory=list)  # (expected, got)
    next_offset: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, data: pa.Table, first_offset: int) -> None:
        with self.lock:
            if first_offset != self.next_offset:
                self.gaps.append((self.next_offset, first_offset))
            self.next_offset = first_offset + data.num_rows
            self.ids.extend(data.column("id").to_pylist())

    def count(self) -> int:
        with self.lock:
            return len(self.ids)


def scrape(port: int) -> dict[str, Any]:
    """`/metrics` of the node on `port`, parsed by prometheus_client's own parser:
    family name -> family."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], name: str, **labels: str) -> float | None:
    """The value of the sample `name` (a family's sample name) with `labels`, or None."""
    for family in families.values():
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                return float(found.value)
    return None


def run_cli_raw(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m hastream_cli ARGS` (the real entry point, as `hastream` runs it)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "hastream_cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def run_cli(*args: str, timeout_s: float = 120) -> Any:
    """`run_cli_raw(ARGS --json)`, which must succeed; its JSON output."""
    result = run_cli_raw(*args, "--json", timeout_s=timeout_s)
    message = f"{args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, message
    return json.loads(result.stdout)
