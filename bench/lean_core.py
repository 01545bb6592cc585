"""The ceiling of a lean replication core in Python, beside NATS JetStream and hastream.

    python -m bench.lean_core [--reps 3] [--seconds 3] [--only wait-1 async-100 ...]
                              [--no-hastream] [--markdown PATH] [--json PATH]

A question for whoever plans the next replication work, not a product path: hastream's
waited publishes are bound by CPU (docs/benchmark.md). How fast would the same durable write
be with the least Python a replication core can have, and how much of the gap is the
replication and how much the product's apply? This module runs such a core: three processes
on loopback, a fixed leader (no elections, no catch-up, no checkpoints: the steady state
only), and per publish the work durability cannot drop:

- the client turns the rows into one Arrow IPC stream with the public client's own
  encoders (`api_clients.row_path`, `api_clients.batches`) and sends it in a length-prefixed
  frame over TCP;
- the leader checks the payload, appends the entry to its journal (one `os.write` of a
  record with a CRC-32), seals the entries one poll read brought in ONE AES-GCM frame sent
  unchanged to both followers, then fdatasyncs its journal;
- a follower opens the frame, writes its entries to its journal, fdatasyncs once per read
  and answers with a sealed 8-byte index;
- the leader commits what its own fdatasync and one follower's cover, applies the committed
  entries and answers each client frame with its LSN; the next frame (or a heartbeat 10 ms
  later) carries the commit index, and the followers apply theirs.

One thread per node, one `selectors` loop, no pickle, no dicts per message, no thread
hand-offs. Two systems run on it (`LEAN_SYSTEMS`):
- `lean`: the bare ceiling. The leader reads the IPC stream back and compares its schema;
  the apply writes the payloads to a data file (page cache).
- `lean-apply`: the product's own apply. The leader validates as `Group.start_publish`
  does and proposes the product's Append command (producer id and sequence, as the
  Publisher sends); every node applies it with raftstore's `Applier` (data file, LSN index,
  producer dedup, row cache). Only the replication differs from hastream's.
Left out of both: gRPC, client authentication, term/vote handling, flow control, the
group commit's queue. If `lean` is not above NATS here, no Python rewrite reaches NATS;
`lean-apply` against `hastream` is what replacing pysyncobj's path alone would give.

Every rep runs every (system, shape) cell once, as bench.vs_nats orders them (the shapes in
a seeded random order, each shape's cells back to back); the NATS and hastream cells are
bench.vs_nats's. Reported per shape: medians of rows/s, the ratios to
NATS, the p50 of the waited shapes, and the servers' CPU per publish. The lean client has
no coalescing of 1-row appends (hastream's Publisher has), so its async cells say little.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from api_clients.batches import encode, encode_batch
from api_clients.row_path import rows_batch
from bench import common
from bench.publish_rows import SCHEMA, RowPool, cpu_meter, hastream_builder
from bench.vs_nats import (
    SHAPES,
    CellResult,
    HastreamSide,
    NatsSide,
    PublisherStats,
    Shape,
    Side,
    cell_result,
    run_reps,
)
from deploy.local_cluster import free_ports
from hastream.errors import RaftStoreError
from raftstore import commands
from raftstore.apply import REPAIR_DIR, Applier, ApplierSettings
from raftstore.catch_up import Repairer
from raftstore.retention import Retention
from raftstore.state_machine import AppendResult, CommandResult
from raftstore.storage.segments import DataRecord
from raftstore.threads import Threads

_LENGTH: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_ENTRY: Final = struct.Struct("<QI")  # index, payload length
_RECORD: Final = struct.Struct("<IIQ")  # journal record: length, crc32, index
_NONCE_BYTES: Final = 12
_READ_BYTES: Final = 4 << 20
_COMMIT_NOTICE_S: Final = 0.010
_KEY: Final = bytes(range(32))  # a benchmark's key: the cost is what is measured
_START_TIMEOUT_S: Final = 20.0
# The lean systems: the bare ceiling, and the same replication with the product's apply.
LEAN_SYSTEMS: Final = {"lean": "bytes", "lean-apply": "product"}
_GROUP: Final = 2
DEFAULT_SHAPES: Final = ("wait-1", "wait-100", "wait-1000", "async-1", "async-100")


# --- frames -------------------------------------------------------------------------------


class Sealer:
    """AES-GCM frames: length, nonce (sender id + counter), ciphertext and tag."""

    def __init__(self, sender: int) -> None:
        self._aead = AESGCM(_KEY)
        self._prefix = struct.pack("<I", sender)
        self._counter = 0

    def seal(self, body: bytes) -> bytes:
        self._counter += 1
        nonce = self._prefix + _U64.pack(self._counter)
        sealed = self._aead.encrypt(nonce, body, None)
        return _LENGTH.pack(_NONCE_BYTES + len(sealed)) + nonce + sealed

    def open(self, frame: bytes) -> bytes:
        return self._aead.decrypt(frame[:_NONCE_BYTES], frame[_NONCE_BYTES:], None)


class FrameReader:
    """Whole length-prefixed frames out of what a socket's reads brought."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        frames, start = [], 0
        while len(self._buffer) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer, start)
            end = start + _LENGTH.size + length
            if end > len(self._buffer):
                break
            frames.append(bytes(self._buffer[start + _LENGTH.size : end]))
            start = end
        del self._buffer[:start]
        return frames


def frame(body: bytes) -> bytes:
    return _LENGTH.pack(len(body)) + body


def entries_body(commit: int, entries: Sequence[tuple[int, bytes]]) -> bytes:
    parts = [_U64.pack(commit)]
    for index, payload in entries:
        parts += [_ENTRY.pack(index, len(payload)), payload]
    return b"".join(parts)


def read_entries(body: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    (commit,) = _U64.unpack_from(body, 0)
    entries, at = [], _U64.size
    while at < len(body):
        index, length = _ENTRY.unpack_from(body, at)
        at += _ENTRY.size
        entries.append((index, body[at : at + length]))
        at += length
    return commit, entries


class Journal:
    """Records appended with one write each; `sync` is one fdatasync."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the new file is in its directory before anything is acked
        finally:
            os.close(directory)

    def add(self, entries: Sequence[tuple[int, bytes]]) -> None:
        records = []
        for index, payload in entries:
            records += [_RECORD.pack(len(payload), zlib.crc32(payload), index), payload]
        os.write(self._fd, b"".join(records))

    def sync(self) -> None:
        os.fdatasync(self._fd)


class BytesApply:
    """The bare ceiling's apply: the leader checks an IPC stream's schema, every node writes
    the committed payloads to a data file (page cache; no index, no key window)."""

    def __init__(self, directory: Path) -> None:
        self._fd = os.open(directory / "data", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def first_entries(self) -> list[bytes]:
        return []

    def command(self, payload: bytes) -> bytes | None:
        """The entry for a client's payload; None when the product would refuse it."""
        try:
            table = pa.ipc.open_stream(payload).read_all()
        except pa.ArrowInvalid:
            return None
        return payload if table.schema.equals(SCHEMA) else None

    def apply(self, entries: Sequence[tuple[int, bytes]]) -> None:
        os.write(self._fd, b"".join(payload for _, payload in entries))


class ProductApply:
    """The product's own apply: the leader validates a publish as `Group.start_publish`
    does and proposes the product's Append command (with a producer id and sequence, as
    the Publisher sends); every node applies it with raftstore's `Applier` (data file,
    LSN index, producer dedup, row cache). Entry 1 creates the table."""

    TABLE: Final = "lean"

    def __init__(self, directory: Path) -> None:
        data_dir = directory / "persistence"
        threads = Threads()
        repairer = Repairer(_GROUP, data_dir / REPAIR_DIR, _no_peers, (), spawn=threads.start)
        settings = ApplierSettings(group_id=_GROUP, data_dir=data_dir)
        self._applier = Applier(settings, repairer, Retention())
        self._producer = os.urandom(commands.PRODUCER_ID_BYTES)
        self._sequence = 0

    def first_entries(self) -> list[bytes]:
        schema = SCHEMA.serialize().to_pybytes()
        return [commands.encode(commands.CreateTable(self.TABLE, schema, 100_000, None, 1440))]

    def command(self, payload: bytes) -> bytes | None:
        try:
            self._applier.machine.validate_append(self.TABLE, payload)
        except RaftStoreError:
            return None
        self._sequence += 1
        item = commands.AppendItem(self.TABLE, self._producer, self._sequence, payload)
        return commands.encode(commands.Append(int(time.time() * 1000), (item,)))

    def apply(self, entries: Sequence[tuple[int, bytes]]) -> None:
        for index, command in entries:
            result = self._applier.apply(index, memoryview(command))
            if isinstance(result, AppendResult):
                failed = any(item.error for item in result.items)
            else:  # the table's creation, or STALLED
                failed = not isinstance(result, CommandResult) or result.error is not None
            if failed:
                raise RuntimeError(f"entry {index} not applied: {result}")


def _no_peers(*_: Any) -> Iterator[DataRecord]:
    raise RuntimeError("the lean core has no catch-up")


Apply = BytesApply | ProductApply
APPLIES: Final[dict[str, type[BytesApply] | type[ProductApply]]] = {
    "bytes": BytesApply,
    "product": ProductApply,
}


# --- the nodes ----------------------------------------------------------------------------


def _listener(port: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(16)
    return server


def _tuned(conn: socket.socket) -> socket.socket:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _connect(port: int, timeout_s: float = _START_TIMEOUT_S) -> socket.socket:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _tuned(socket.create_connection(("127.0.0.1", port), timeout=timeout_s))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def run_follower(directory: Path, port: int, node: int, apply: Apply) -> None:
    journal = Journal(directory / "journal")
    server = _listener(port)
    leader, _ = server.accept()
    _tuned(leader)
    sealer, reader = Sealer(node), FrameReader()
    held: dict[int, bytes] = {}
    applied = 0
    while chunk := leader.recv(_READ_BYTES):
        last, commit = 0, 0
        for sealed in reader.feed(chunk):
            commit, entries = read_entries(sealer.open(sealed))
            if entries:
                journal.add(entries)
                held.update(entries)
                last = entries[-1][0]
        if last:
            journal.sync()
            leader.sendall(sealer.seal(_U64.pack(last)))
        if commit > applied:
            apply.apply([(index, held.pop(index)) for index in range(applied + 1, commit + 1)])
            applied = commit


@dataclass
class _Waiting:
    conn: socket.socket
    request: bytes  # the client's 8-byte request id


def run_leader(directory: Path, port: int, followers: Sequence[int], apply: Apply) -> None:
    journal = Journal(directory / "journal")
    peers = [_connect(follower) for follower in followers]
    selector = selectors.DefaultSelector()
    readers: dict[socket.socket, FrameReader] = {peer: FrameReader() for peer in peers}
    for peer in peers:
        selector.register(peer, selectors.EVENT_READ, "peer")
    sealer = Sealer(0)
    matched = dict.fromkeys(peers, 0)
    waiting: dict[int, _Waiting] = {}
    payloads: dict[int, bytes] = {}
    last = durable = commit = sent_commit = 0
    notice_at = math.inf

    def answer_committed() -> None:
        nonlocal commit, notice_at
        reach = sorted([durable, *matched.values()])[1]  # a majority of three
        if reach <= commit:
            return
        apply.apply([(index, payloads.pop(index)) for index in range(commit + 1, reach + 1)])
        for index in range(commit + 1, reach + 1):
            client = waiting.pop(index, None)
            if client is None:
                continue  # an entry of the leader's own (the table's creation)
            with contextlib.suppress(OSError):
                client.conn.sendall(frame(client.request + _U64.pack(index)))
        commit = reach
        notice_at = min(notice_at, time.monotonic() + _COMMIT_NOTICE_S)

    def replicate(entries: list[tuple[int, bytes]]) -> None:
        nonlocal durable, sent_commit, notice_at
        sealed = sealer.seal(entries_body(commit, entries))  # once, for every follower
        for peer in peers:
            peer.sendall(sealed)
        sent_commit, notice_at = commit, math.inf
        if entries:
            journal.sync()  # beside the followers' own writes and fdatasyncs
            durable = entries[-1][0]

    def take_acknowledgements(peer: socket.socket) -> None:
        chunk = peer.recv(_READ_BYTES)
        if not chunk:
            raise SystemExit(0)  # a follower is gone: the run is over
        for body in readers[peer].feed(chunk):
            matched[peer] = max(matched[peer], _U64.unpack(sealer.open(body))[0])

    for command in apply.first_entries():
        last += 1
        payloads[last] = command
        journal.add([(last, command)])
        replicate([(last, command)])
    while commit < last:  # the table exists before a client can publish to it
        for key, _ in selector.select():
            assert isinstance(key.fileobj, socket.socket)
            take_acknowledgements(key.fileobj)
        answer_committed()
    server = _listener(port)  # listens once its own entries are committed: the parent's signal
    selector.register(server, selectors.EVENT_READ, None)
    while True:
        timeout = None if notice_at == math.inf else max(0.0, notice_at - time.monotonic())
        events = selector.select(timeout)
        incoming: list[tuple[int, bytes]] = []
        for key, _ in events:
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            if conn is server:
                client, _ = server.accept()
                selector.register(_tuned(client), selectors.EVENT_READ, "client")
                readers[client] = FrameReader()
                continue
            if key.data == "peer":
                take_acknowledgements(conn)
                continue
            chunk = conn.recv(_READ_BYTES)
            if not chunk:
                selector.unregister(conn)
                conn.close()
                continue
            for body in readers[conn].feed(chunk):
                request, entry = body[:8], apply.command(body[8:])
                if entry is None:
                    conn.sendall(frame(request + _U64.pack(0)))
                    continue
                last += 1
                waiting[last] = _Waiting(conn, request)
                payloads[last] = entry
                incoming.append((last, entry))
        if incoming:
            journal.add(incoming)
            replicate(incoming)
        answer_committed()
        if commit > sent_commit and time.monotonic() >= notice_at:
            replicate([])


def node_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lean_core node")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--followers", type=int, nargs="*", default=[])
    parser.add_argument("--apply", choices=sorted(APPLIES), default="bytes")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    apply = APPLIES[args.apply](args.dir)
    if args.node == 0:
        run_leader(args.dir, args.port, args.followers, apply)
    else:
        run_follower(args.dir, args.port, args.node, apply)
    return 0


class LeanCluster:
    """The three node processes; node 0 leads for the whole run."""

    def __init__(self, root: Path, apply: str) -> None:
        self.root = root  # node<i>/journal, node<i>/data or node<i>/persistence
        ports = free_ports(3)
        self.leader_port = ports[0]
        self.processes: list[subprocess.Popen[bytes]] = []
        for node, port in enumerate(ports):
            followers = [str(p) for p in ports[1:]] if node == 0 else []
            command = [sys.executable, "-m", "bench.lean_core", "node", "--dir"]
            command += [str(root / f"node{node}"), "--port", str(port), "--node", str(node)]
            command += ["--followers", *followers, "--apply", apply]
            self.processes.append(subprocess.Popen(command))
        _connect(self.leader_port).close()  # the leader reached its followers

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


@contextlib.contextmanager
def lean_cluster(apply: str) -> Iterator[LeanCluster]:
    with tempfile.TemporaryDirectory(prefix="lean-core-") as root:
        cluster = LeanCluster(Path(root), apply)
        try:
            yield cluster
        finally:
            cluster.close()


# --- the client side ----------------------------------------------------------------------


class LeanPublisher:
    """A publisher over one connection: `append` waits for its LSN, `append_async` keeps up
    to `window` frames in flight (their answers are read as the window needs room)."""

    def __init__(self, port: int, window: int) -> None:
        self._conn = _connect(port)
        self._reader = FrameReader()
        self._window = window
        self._sent = 0
        self._answered = 0
        self._failed = 0

    def _send(self, data: object) -> None:
        if isinstance(data, list):
            payload = encode_batch(rows_batch(data, SCHEMA), SCHEMA)
            assert payload is not None
        else:
            assert isinstance(data, pa.Table)
            payload = encode(data)
        self._sent += 1
        self._conn.sendall(frame(_U64.pack(self._sent) + payload))

    def _read_answers(self) -> None:
        chunk = self._conn.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the leader closed the connection")
        for body in self._reader.feed(chunk):
            self._answered += 1
            if _U64.unpack_from(body, 8)[0] == 0:
                self._failed += 1

    def append(self, data: object) -> None:
        self._send(data)
        while self._answered < self._sent:
            self._read_answers()

    def append_async(self, data: object) -> None:
        while self._sent - self._answered >= self._window:
            self._read_answers()
        self._send(data)

    def flush(self) -> int:
        """Waits for every answer; the number of rejected frames."""
        while self._answered < self._sent:
            self._read_answers()
        return self._failed

    def close(self) -> None:
        self._conn.close()


@dataclass
class LeanSide:
    cluster: LeanCluster
    build: dict[int, Callable[[int], object]]
    window: int
    name: str
    # shape -> one (leader, follower, follower, client) CPU us per publish for each cell
    process_us: dict[str, list[tuple[float, ...]]] = field(default_factory=dict)

    def run(self, shape: Shape, seconds: float, rep: int, order: int) -> CellResult:
        if shape.publishers != 1:
            raise ValueError("the lean core's cells have one publisher")
        build, clock = self.build[shape.rows], time.perf_counter
        publisher = LeanPublisher(self.cluster.leader_port, self.window)
        stats, number = PublisherStats(), 1 << 40 | rep << 32 | order << 24
        try:
            publisher.append(build(number))  # warm-up
            nodes_before = [common.cpu_seconds(pid) for pid in self.cluster.pids()]
            with cpu_meter(self.cluster.pids()) as cpu:
                started = clock()
                deadline = started + seconds
                while True:
                    data = build(number)
                    sent = clock()
                    if shape.wait:
                        publisher.append(data)
                        stats.latencies_s.append(clock() - sent)
                    else:
                        publisher.append_async(data)
                    stats.messages += 1
                    number += 1
                    if sent >= deadline:
                        break
                stats.errors = publisher.flush()
                stats.finished_at = clock()
            nodes = [common.cpu_seconds(pid) for pid in self.cluster.pids()]
        finally:
            publisher.close()
        stats.rows = (stats.messages - stats.errors) * shape.rows
        spent = [after - before for after, before in zip(nodes, nodes_before, strict=True)]
        per_publish = 1e6 / max(1, stats.messages)
        self.process_us.setdefault(shape.key, []).append(
            tuple(value * per_publish for value in [*spent, cpu[1]])
        )
        return cell_result(self.name, shape, rep, order, [stats], started, (cpu[0], cpu[1]))


# --- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    shape: str
    label: str
    rows_per_s: dict[str, float]
    p50_ms: dict[str, float]
    server_ms_per_publish: dict[str, float]


def summarize(
    results: list[CellResult], shapes: Sequence[Shape], systems: Sequence[str]
) -> list[Summary]:
    summaries = []
    for shape in shapes:
        cells = {s: [r for r in results if r.shape == shape.key and r.system == s] for s in systems}
        summaries.append(
            Summary(
                shape.key,
                shape.label,
                {s: common.median([r.rows_per_s for r in cells[s]]) for s in systems},
                {s: common.median([r.p50_ms for r in cells[s]]) for s in systems},
                {
                    s: common.median([r.server_cpu_s * 1000 / max(1, r.messages) for r in cells[s]])
                    for s in systems
                },
            )
        )
    return summaries


def process_lines(summaries: list[Summary], lean: dict[str, LeanSide]) -> list[str]:
    """The lean systems' CPU per publish by process: where a core of this shape spends."""
    lines = [
        "",
        "CPU per publish by process, us (medians over the reps; the client is this process):",
        "",
        "| shape | system | leader | follower 1 | follower 2 | client |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for summary in summaries:
        for name, side in lean.items():
            cells = side.process_us.get(summary.shape, [])
            if cells:
                medians = [common.median([cell[k] for cell in cells]) for k in range(4)]
                values = " | ".join(f"{value:,.0f}" for value in medians)
                lines.append(f"| {summary.label} | {name} | {values} |")
    return lines


def markdown(summaries: list[Summary], systems: Sequence[str], meta: dict[str, Any]) -> str:
    others = [s for s in systems if s != "nats"]
    head = ["shape", *(f"{s} rows/s" for s in systems), *(f"{s} / NATS" for s in others)]
    head += [f"{s} p50 ms" for s in systems] + [f"{s} server CPU ms / publish" for s in systems]
    lines = [
        f"# A lean Python replication core beside NATS and hastream ({meta['date']})",
        "",
        f"Command: `{meta['command']}` (seed {meta['seed']}); load {meta['loadavg_start']} -> "
        f"{meta['loadavg_end']}; steal {meta['steal']}; {meta['machine']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" + "---:|" * (len(head) - 1),
    ]
    for summary in summaries:
        nats = summary.rows_per_s["nats"]
        cells = [summary.label, *(f"{summary.rows_per_s[s]:,.0f}" for s in systems)]
        cells += [f"{summary.rows_per_s[s] / nats:.2f}" if nats else "-" for s in others]
        cells += [
            f"{summary.p50_ms[s]:.2f}" if not math.isnan(summary.p50_ms[s]) else "-"
            for s in systems
        ]
        cells += [f"{summary.server_ms_per_publish[s]:.2f}" for s in systems]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.lean_core", description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--only", nargs="*", default=list(DEFAULT_SHAPES))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--no-hastream", action="store_true")
    parser.add_argument("--markdown", type=Path, default=Path("bench/results/lean-core.md"))
    parser.add_argument("--json", type=Path, default=Path("bench/results/lean-core.json"))
    return parser.parse_args(argv)


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["node"]:
        return node_main(argv[1:])
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    shapes = [shape for shape in SHAPES if shape.key in args.only and shape.publishers == 1]
    systems = ["nats", *LEAN_SYSTEMS, *([] if args.no_hastream else ["hastream"])]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    command = "python -m bench.lean_core " + shlex.join(argv)
    meta: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "seed": seed,
        "machine": common.machine(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"# {command}\n# seed {seed}", flush=True)
    cpu_times = common.CpuTimes.now()
    pool = RowPool.make()
    builders = {shape.rows: hastream_builder(pool, shape.rows) for shape in SHAPES}
    from bench.nats_cluster import nats_cluster  # needs bench/requirements.txt

    with contextlib.ExitStack() as stack:
        nats_nodes = stack.enter_context(nats_cluster())
        sides: dict[str, Side] = {
            "nats": NatsSide.make(nats_nodes, pool, args.window),
        }
        for name, apply in LEAN_SYSTEMS.items():
            cluster = stack.enter_context(lean_cluster(apply))
            sides[name] = LeanSide(cluster, builders, args.window, name)
        if "hastream" in systems:
            ha = stack.enter_context(
                common.bench_cluster(purge_interval_s=60.0, election_timeout_s=1.5)
            )
            hastream = HastreamSide.make(ha, pool, args.window)
            stack.callback(hastream.close)
            sides["hastream"] = hastream
        results = run_reps(sides, shapes, args.reps, args.seconds, seed, systems)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["steal"] = round(common.CpuTimes.now().steal_share_since(cpu_times), 3)
    summaries = summarize(results, shapes, systems)
    lean = {name: side for name, side in sides.items() if isinstance(side, LeanSide)}
    text = markdown(summaries, systems, meta) + "\n".join(process_lines(summaries, lean)) + "\n"
    args.markdown.write_text(text)
    args.json.write_text(
        json.dumps(
            {
                "meta": meta,
                "summaries": [asdict(s) for s in summaries],
                "cells": [asdict(r) for r in results],
            },
            indent=1,
            default=str,
        )
    )
    print()
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
