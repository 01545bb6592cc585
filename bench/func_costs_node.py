"""The node side of bench.func_costs: CPU time and calls of chosen functions, in a node.

Loaded by `bench/func_costs_hook/sitecustomize.py` in every node process that
bench.func_costs starts (nothing else imports it; a node started without its environment
variables never runs it). A daemon thread watches the directory named by
`HASTREAM_FUNC_COSTS_DIR` for the harness's requests (a file `request` holding a number):
at the first it wraps the functions listed in `HASTREAM_FUNC_COSTS`, then at every request
N it writes `<pid>-<N>.json` with each function's calls and thread CPU time so far.

Wrapping at the first request, not at start, lets the node install its own patches first
(pysyncobj_patches replaces pysyncobj's methods at start-up): what is wrapped is what runs
then. A target is `module:Class.method` or `module:function`, looked up again at every call
by its callers (a method, or a function its callers reach through its module); a function
imported by name elsewhere, a callback bound before the wrapping and the body of a
generator are not counted. Times are inclusive (a wrapped function called by another is
counted in both) and summed over the node's threads: `time.thread_time_ns()` around each
call, ~1 us of the wrapped node's own CPU per call.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Final

DIRECTORY_VARIABLE: Final = "HASTREAM_FUNC_COSTS_DIR"
TARGETS_VARIABLE: Final = "HASTREAM_FUNC_COSTS"
REQUEST_FILE: Final = "request"
_POLL_S: Final = 0.02


class _Counter:
    __slots__ = ("calls", "ns")

    def __init__(self) -> None:
        self.calls = 0
        self.ns = 0


def _owner_and_name(target: str) -> tuple[Any, str]:
    module_name, _, path = target.partition(":")
    if not module_name or not path:
        raise ValueError(f"target {target!r} is not module:name")
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name


def wrap(target: str) -> _Counter:
    """Replace `target` by a timed call of it; its counter. Raises AttributeError,
    ImportError or ValueError for a target that is not there or not a plain function."""
    owner, name = _owner_and_name(target)
    original = getattr(owner, name)
    if isinstance(owner, type):
        original = owner.__dict__.get(name, original)  # not a bound or inherited wrapper
    if not callable(original) or isinstance(original, (staticmethod, classmethod, type)):
        raise ValueError(f"{target} is not a plain function")
    counter = _Counter()
    clock = time.thread_time_ns

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return original(*args, **kwargs)
        finally:
            counter.ns += clock() - started
            counter.calls += 1

    setattr(owner, name, timed)
    return counter


class _Watcher:
    def __init__(self, directory: Path, targets: list[str]) -> None:
        self._directory = directory
        self._targets = targets
        self._counters: dict[str, _Counter] = {}
        self._missing: dict[str, str] = {}
        self._answered = 0

    def run(self) -> None:
        request = self._directory / REQUEST_FILE
        while True:
            time.sleep(_POLL_S)
            try:
                number = int(request.read_text() or "0")
            except (OSError, ValueError):
                continue  # not written yet, or being written
            if number > self._answered:
                self._answer(number)

    def _answer(self, number: int) -> None:
        if not self._counters and not self._missing:
            for target in self._targets:
                try:
                    self._counters[target] = wrap(target)
                except (AttributeError, ImportError, ValueError) as error:
                    self._missing[target] = f"{type(error).__name__}: {error}"
        document = {
            "pid": os.getpid(),
            "request": number,
            "functions": {t: [c.calls, c.ns] for t, c in self._counters.items()},
            "missing": self._missing,
        }
        path = self._directory / f"{os.getpid()}-{number}.json"
        partial = path.with_suffix(".part")
        partial.write_text(json.dumps(document))
        partial.rename(path)
        self._answered = number


def start_from_environment() -> None:
    """Start the watcher if this process was started by bench.func_costs."""
    directory = os.environ.get(DIRECTORY_VARIABLE)
    targets = [t for t in os.environ.get(TARGETS_VARIABLE, "").split(",") if t]
    if not directory or not targets:
        return
    watcher = _Watcher(Path(directory), targets)
    threading.Thread(target=watcher.run, name="func-costs", daemon=True).start()
