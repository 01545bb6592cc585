"""Candidate write-path changes, applied to a node process at start for A/B measurement.

Nothing here is used by the product. `python -m bench.patched_node --patches a,b -- <raftstore
args>` applies the named patches and then runs the unmodified node (`raftstore.__main__`), so
bench.experiment can measure what a proposed change to raftstore/ would gain before anyone
writes it. Each patch names the file and function it stands in for.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

PATCHES: dict[str, Callable[[], None]] = {}
# Taken into raftstore/replication.py and removed from here: "leader-overlap-fsync",
# "follower-group-ack", "no-rewind" (docs/benchmark.md has their measurements).


def patch(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(function: Callable[[], None]) -> Callable[[], None]:
        PATCHES[name] = function
        return function

    return register


# Environment variables a patch sets for the node process (applied by the launcher, since
# they must be in place before the interpreter starts).
ENVIRONMENT: Final[dict[str, dict[str, str]]] = {
    # glibc: serve allocations below 64 MiB from the heap and never trim it, so the
    # multi-MB buffers of every entry (pickle, MAC token, framing, journal and data-file
    # copies) reuse memory instead of mmap-ing and page-faulting fresh pages each time.
    "malloc-keep": {
        "MALLOC_MMAP_THRESHOLD_": str(64 << 20),
        "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
        "MALLOC_TOP_PAD_": str(64 << 20),
    },
}


def environment(names: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for name in names:
        result.update(ENVIRONMENT.get(name, {}))
    return result


def apply(names: list[str]) -> None:
    for name in names:
        if name in ENVIRONMENT:
            continue  # set by the launcher (bench.experiment.PatchedCluster)
        if name.startswith("inflight="):
            _in_flight(int(name.split("=", 1)[1]))
        else:
            PATCHES[name]()


def _in_flight(count: int) -> None:
    """raftstore/limits.py PROPOSALS_IN_FLIGHT_MAX (read by batcher.Batcher.__init__): fewer
    entries in flight make concurrent publishes wait in the batcher's queue and share an
    entry (group commit) instead of each taking its own entry."""
    from raftstore import limits

    limits.PROPOSALS_IN_FLIGHT_MAX = count  # type: ignore[misc]


def _authenticator_class() -> Any:
    """The class the node plugs into pysyncobj as its encryptor (AES-GCM)."""
    from raftstore import pysyncobj_patches

    return pysyncobj_patches.AesGcmEncryptor


@patch("no-auth")
def no_auth() -> None:
    """Measurement only, NOT a proposal: the peer encryptor (pysyncobj_patches.py) keeps its
    framing (an 8-byte timestamp) but neither encrypts nor checks a tag, so the cost of
    encrypting and authenticating every peer message shows as the difference."""
    stamp = struct.Struct("<q")
    authenticator = _authenticator_class()
    authenticator.encrypt_at_time = lambda self, data, now: stamp.pack(now) + data
    authenticator.extract_timestamp = lambda self, token: stamp.unpack_from(token, 0)[0]
    authenticator.decrypt = lambda self, token: token[stamp.size :]


@patch("switch-interval")
def switch_interval() -> None:
    """sys.setswitchinterval(0.5 ms) in the node (default 5 ms): a thread waiting for the GIL
    (the batcher, a gRPC handler woken by a commit) gets it sooner from a thread running
    Python code (the tick thread applying or sending)."""
    import sys

    sys.setswitchinterval(0.0005)


def names() -> list[str]:
    return [*sorted(PATCHES), "inflight=<n>"]


# --- tracing: where the latency of one entry goes ------------------------------------------

TRACE_ENV: Final = "HASTREAM_BENCH_TRACE"
_TRACE_SAMPLES_MAX: Final = 200_000


class _Trace:
    """Per-stage durations (seconds) of the write path in this node process."""

    def __init__(self) -> None:
        self.stages: dict[str, list[float]] = {}
        self.proposed: dict[int, float] = {}  # id(command bytes) -> time handed to pysyncobj
        self.added: dict[int, float] = {}  # log index -> time added to the journal
        self.synced_to = 0  # highest index known durable here
        self.acked_to = 0  # highest index acknowledged by some follower (leader)
        self.applied: dict[int, float] = {}  # log index -> time its apply finished
        self.counters: dict[str, int] = {}

    def note(self, stage: str, seconds: float) -> None:
        samples = self.stages.setdefault(stage, [])
        if len(samples) < _TRACE_SAMPLES_MAX:
            samples.append(seconds)

    def count(self, name: str, value: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    def summary(self) -> dict[str, dict[str, float]]:
        result: dict[str, dict[str, float]] = {
            name: {"count": value} for name, value in self.counters.items()
        }
        for stage, samples in self.stages.items():
            ordered = sorted(samples)
            result[stage] = {
                "count": len(ordered),
                "p50_ms": ordered[len(ordered) // 2] * 1000,
                "p90_ms": ordered[int(len(ordered) * 0.9)] * 1000,
                "mean_ms": sum(ordered) / len(ordered) * 1000,
                "total_s": sum(ordered),
            }
        return result


@patch("trace")
def trace() -> None:
    """Instrumentation, not a proposal: time stamps at each hand-off of an entry (propose ->
    journal add -> leader fdatasync -> first follower ack -> apply -> gRPC answer; on a
    follower: message handling, add, fdatasync), written as JSON to $HASTREAM_BENCH_TRACE at
    exit. Costs a few microseconds per entry."""
    import atexit
    import json
    import os
    import time

    from raftstore import replication, service
    from raftstore.storage.journal import DurableJournal

    clock = time.perf_counter
    state = _Trace()
    sync_obj = replication._SyncObj

    apply_command = sync_obj._applyCommand

    def traced_apply_command(self: Any, command: Any, callback: Any, *args: Any) -> Any:
        state.proposed[id(command)] = clock()
        return apply_command(self, command, callback, *args)

    add = DurableJournal.append

    def traced_add(self: Any, command: Any, idx: int, term: int) -> None:
        started = clock()
        add(self, command, idx, term)
        finished = clock()
        state.note("journal add (write)", finished - started)
        proposed = state.proposed.pop(id(command), None)
        if proposed is not None:
            state.note("leader: propose -> journal add (queue, tick wake-up)", started - proposed)
        state.added[idx] = finished

    sync = DurableJournal.sync

    def traced_sync(self: Any) -> None:
        if not self._dirty:
            return
        started = clock()
        sync(self)
        finished = clock()
        state.note("fdatasync (journal)", finished - started)
        last = self._entries[-1][1] if self._entries else 0
        for idx in range(state.synced_to + 1, last + 1):
            added = state.added.get(idx)
            if added is not None:
                state.note("journal add -> durable (this node)", finished - added)
        state.synced_to = max(state.synced_to, last)

    on_message = sync_obj._SyncObj__onMessageReceived

    def traced_on_message(self: Any, node: Any, message: Any) -> Any:
        started = clock()
        kind = message.get("type") if isinstance(message, dict) else None
        entries = message.get("entries") if kind == "append_entries" else None
        if entries:
            journal = self._journal
            held = journal[-1][1] if len(journal) else 0
            state.count("follower: entries received", len(entries))
            again = held - int(message["prevLogIdx"])
            if again > 0:  # the follower truncates them and writes them again
                state.count("follower: entries received again (already held)", again)
        result = on_message(self, node, message)
        finished = clock()
        if entries:
            state.note("follower: handle append_entries (add+fsync+ack)", finished - started)
        if kind == "next_node_idx" and message.get("success"):
            covered = int(message["next_node_idx"]) - 1
            for idx in range(state.acked_to + 1, covered + 1):
                added = state.added.get(idx)
                if added is not None:
                    state.note("leader: journal add -> first follower ack", started - added)
            state.acked_to = max(state.acked_to, covered)
        return result

    do_apply = sync_obj._SyncObj__doApplyCommand

    def traced_do_apply(self: Any, command: Any) -> Any:
        idx = self.raftLastApplied + 1
        started = clock()
        added = state.added.pop(idx, None)
        if added is not None and self._isLeader():
            state.note("leader: journal add -> apply start (commit)", started - added)
        result = do_apply(self, command)
        finished = clock()
        state.note("apply (decode, state machine, data file, cache)", finished - started)
        if self._isLeader():
            state.applied[idx] = finished
            if len(state.applied) > 10_000:
                state.applied.clear()
        return result

    publish = service.StreamTableService.Publish

    def traced_publish(self: Any, request: Any, context: Any) -> Any:
        started = clock()
        response = publish(self, request, context)
        finished = clock()
        state.note("gRPC Publish handler (total)", finished - started)
        applied = state.applied.get(response.lsn)
        if applied is not None:
            state.note("leader: apply end -> Publish handler returns", finished - applied)
        return response

    sync_obj._applyCommand = traced_apply_command
    DurableJournal.append = traced_add
    DurableJournal.sync = traced_sync
    sync_obj._SyncObj__onMessageReceived = traced_on_message
    sync_obj._SyncObj__doApplyCommand = traced_do_apply
    service.StreamTableService.Publish = traced_publish

    def dump() -> None:
        path = os.environ.get(TRACE_ENV)
        if path:
            with open(path, "w") as file:
                json.dump(state.summary(), file, indent=1)

    atexit.register(dump)


@patch("tcp-recv")
def tcp_recv() -> None:
    """pysyncobj.tcp_connection.TcpConnection, receive side only (wrapped from
    replication.py): the read buffer is a bytearray (`+=` extends in place, amortized
    linear) consumed with `del buffer[:n]`. pysyncobj keeps it as `bytes` and does
    `buffer += recv(...)`, which copies everything buffered so far on every recv: quadratic
    in the recv calls a message takes, which shows when a follower has several multi-MB
    entries queued (4 publishers x 10,000 rows). The send side is left as it is (its
    `bytes +=` is free when the buffer is empty, the usual case)."""
    import pysyncobj.tcp_connection as tcp  # bench-only stand-in (bench/ may import it)

    connection = tcp.TcpConnection
    original_read = connection._TcpConnection__processRead

    def process_read(self: Any) -> bool:
        buffer = self._TcpConnection__readBuffer
        if type(buffer) is not bytearray:
            self._TcpConnection__readBuffer = bytearray(buffer)
        # pysyncobj's own code then runs `self.__readBuffer += incoming` on the bytearray.
        result: bool = original_read(self)
        return result

    def process_parse_message(self: Any) -> Any:
        buffer = self._TcpConnection__readBuffer
        if len(buffer) < 4:
            return None
        (length,) = struct.unpack_from("i", buffer, 0)
        if len(buffer) - 4 < length:
            return None
        data = bytes(memoryview(buffer)[4 : 4 + length])
        try:
            if self.encryptor:
                timestamp = self.encryptor.extract_timestamp(data)
                assert timestamp >= self.recvLastTimestamp
                self.recvLastTimestamp = timestamp
                data = self.encryptor.decrypt(data)
            message = tcp.pickle.loads(tcp.zlib.decompress(data))
            if self.recvRandKey:
                rand_key, message = message
                assert rand_key == self.recvRandKey
        except Exception:
            self.disconnect()
            return None
        if type(buffer) is bytearray:
            del buffer[: 4 + length]
        else:
            self._TcpConnection__readBuffer = buffer[4 + length :]
        return message

    connection._TcpConnection__processRead = process_read
    connection._TcpConnection__processParseMessage = process_parse_message
