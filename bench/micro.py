"""The write path taken apart: the cost of each stage for one batch, in one process.

    python -m bench.micro [--batch 1 100 1000 10000] [--columns 11 211]

Calls the project's own functions (raftstore is imported, never modified) with the same
payloads bench.throughput sends, and times each stage a publish goes through:

  client/gRPC  PublishRequest serialize (client) + parse (server)
  leader       validate_append (Arrow IPC parse + full validation + schema check)
  batcher      commands.encode of a one-item Append
  tick thread  DurableJournal.add, DurableJournal.sync (fdatasync), per follower the
               pysyncobj message send (pickle protocol 5 + peer MAC + framing), apply
               (commands.decode + state machine + Arrow IPC serialize + data-file append)
  follower     the pysyncobj receive path (read-buffer concatenation + MAC check +
               unpickle) over a real loopback TCP socket, as pysyncobj does it and with a
               preallocated buffer for comparison

Medians of repeated calls on this machine (noisy: other work shares the 2 cores). The
`entry budget` line divides by the rows per batch to give the rows/s each stage alone
would allow on one core.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import select
import socket
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pysyncobj.pickle as pysyncobj_pickle  # measures pysyncobj's wire format

from bench import common
from proto import hastream_pb2 as pb
from raftstore import commands
from raftstore.pysyncobj_patches import AesGcmEncryptor
from raftstore.state_machine import AppendRecords, GroupStateMachine
from raftstore.storage.journal import DurableJournal
from raftstore.tables import TableStore

RECV_BUFFER_BYTES: Final = 4 << 20  # limits.RAFT_SOCKET_BUFFER_BYTES
_REGULAR_TAG: Final = b"\x00"


def timed(function: Callable[[], Any], *, seconds: float = 0.4, runs_min: int = 5) -> float:
    """Median seconds per call."""
    samples = []
    deadline = time.perf_counter() + seconds
    while len(samples) < runs_min or time.perf_counter() < deadline:
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
        if len(samples) >= 2000:
            break
    return statistics.median(samples)


# --- the pysyncobj wire, as tcp_connection.py does it ----------------------------------------


def _message(command: bytes, idx: int) -> dict[str, Any]:
    return {
        "type": "append_entries",
        "term": 1,
        "commit_index": idx - 1,
        "entries": [(_REGULAR_TAG + command, idx, 1)],
        "prevLogIdx": idx - 1,
        "prevLogTerm": 1,
    }


def wire_frame(authenticator: Any, command: bytes, idx: int) -> bytes:
    """tcp_connection.send: pickle, (zlib patched out), MAC token, 4-byte length."""
    data = pysyncobj_pickle.dumps((b"k" * 32, _message(command, idx)))
    data = authenticator.encrypt_at_time(data, 1)
    return struct.pack("i", len(data)) + data


def _sender(port: int, frame: bytes, count: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RECV_BUFFER_BYTES)
        for _ in range(count):
            connection.sendall(frame)
            connection.recv(1)  # like a follower's ack: one message in flight at a time


def receive_cost(authenticator: Any, frame: bytes, *, preallocated: bool) -> float:
    """CPU seconds (this thread) per message to receive and decode `frame` from a real
    loopback socket, sent by another process: pysyncobj's `readBuffer += incoming` loop, or
    recv_into a preallocated buffer."""
    count = max(3, min(200, (64 << 20) // len(frame)))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    process = multiprocessing.get_context("fork").Process(target=_sender, args=(port, frame, count))
    process.start()
    connection, _ = listener.accept()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER_BYTES)
    connection.setblocking(False)
    poller = select.poll()
    poller.register(connection, select.POLLIN)
    received = 0
    cpu = 0.0
    buffer = bytearray(len(frame)) if preallocated else None
    view = memoryview(buffer) if buffer is not None else None
    filled = 0
    read_buffer = b""
    while received < count:
        poller.poll(1000)
        started = time.thread_time()
        while True:
            try:
                if view is not None:
                    got = connection.recv_into(view[filled:])
                    if got == 0:
                        break
                    filled += got
                else:
                    incoming = connection.recv(RECV_BUFFER_BYTES)
                    if not incoming:
                        break
                    read_buffer += incoming
            except BlockingIOError:
                break
            if view is not None and filled == len(frame):
                _decode(authenticator, bytes(view[4:]))
                filled = 0
                received += 1
                connection.send(b"a")
        while view is None and len(read_buffer) >= 4:
            (length,) = struct.unpack("i", read_buffer[:4])
            if len(read_buffer) - 4 < length:
                break
            data = read_buffer[4 : 4 + length]
            _decode(authenticator, data)
            read_buffer = read_buffer[4 + length :]
            received += 1
            connection.send(b"a")
        cpu += time.thread_time() - started
    process.join()
    connection.close()
    listener.close()
    return cpu / count


def _decode(authenticator: Any, data: bytes) -> None:
    authenticator.extract_timestamp(data)
    pysyncobj_pickle.loads(authenticator.decrypt(data))


def send_cost_pysyncobj(frame: bytes) -> float:
    """pysyncobj's __processSend on a socket whose peer reads slowly: `buffer =
    buffer[sent:]` after every partial send. CPU seconds of this thread per frame."""
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, RECV_BUFFER_BYTES)
    left.setblocking(False)
    right.setblocking(False)
    started = time.thread_time()
    write_buffer = frame
    while write_buffer:
        try:
            sent = left.send(write_buffer)
            write_buffer = write_buffer[sent:]
        except BlockingIOError:
            pass
        try:
            while right.recv(1 << 20):
                pass
        except BlockingIOError:
            pass
    cost = time.thread_time() - started
    left.close()
    right.close()
    return cost


# --- stages ---------------------------------------------------------------------------------


def stages(columns: int, batch_rows: int, directory: Path, wire: bool) -> dict[str, float]:
    schema = common.schema_for(columns)
    payload = common.payloads(schema, batch_rows, 1)[0]
    table = "micro"
    create = commands.CreateTable(table, schema.serialize().to_pybytes(), 1000, None, 1440)
    machine = GroupStateMachine(2)  # for apply with effects performed
    machine.apply(1, create)
    machine_alone = GroupStateMachine(2)  # for the state machine alone
    machine_alone.apply(1, create)
    meta = machine.table(table).meta
    store = TableStore(meta, directory / f"table-{columns}-{batch_rows}")
    journal = DurableJournal(directory / f"journal-{columns}-{batch_rows}")
    authenticator = AesGcmEncryptor("bench-secret")
    item = commands.AppendItem(table, b"", 0, payload)
    command = commands.encode(commands.Append(1, (item,)))
    request = pb.PublishRequest(table=table, payload=payload)
    wire_bytes = request.SerializeToString()
    lsn = [1]

    def journal_add() -> None:
        lsn[0] += 1
        journal.append(_REGULAR_TAG + command, lsn[0], 1)

    def journal_add_sync() -> None:
        journal_add()
        journal.sync()

    def apply() -> None:
        lsn[0] += 1
        effects, _ = machine.apply(lsn[0], commands.decode(memoryview(command)))
        for effect in effects:
            assert isinstance(effect, AppendRecords)
            store.append(effect.lsn, effect.first_offset, effect.batch, effect.timestamp_ms)

    def apply_state_machine_only() -> None:
        lsn[0] += 1
        machine_alone.apply(lsn[0], commands.decode(memoryview(command)))

    batch = pa.ipc.open_stream(payload).read_next_batch()
    results = {
        "client: PublishRequest serialize": timed(request.SerializeToString),
        "server: PublishRequest parse": timed(lambda: pb.PublishRequest.FromString(wire_bytes)),
        "leader: validate_append": timed(lambda: machine.validate_append(table, payload)),
        "batcher: commands.encode": timed(lambda: commands.encode(commands.Append(1, (item,)))),
        "tick: journal add (write)": timed(journal_add),
        "tick: journal add + fdatasync": timed(journal_add_sync),
        "tick: wire send, per follower": timed(lambda: wire_frame(authenticator, command, 7)),
        "tick: apply (decode+state machine)": timed(apply_state_machine_only),
        "tick: apply incl. IPC serialize + data file": timed(apply),
        "  of which RecordBatch.serialize": timed(batch.serialize),
    }
    if wire:
        frame = wire_frame(authenticator, command, 7)
        results["follower: wire receive, pysyncobj"] = receive_cost(
            authenticator, frame, preallocated=False
        )
        results["follower: wire receive, recv_into"] = receive_cost(
            authenticator, frame, preallocated=True
        )
        results["leader: socket send, pysyncobj slicing"] = statistics.median(
            send_cost_pysyncobj(frame) for _ in range(3)
        )
    results["payload bytes"] = float(len(payload))
    store.close()
    journal.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 100, 1_000, 10_000])
    parser.add_argument("--columns", type=int, nargs="*", default=[11, 211])
    parser.add_argument("--no-wire", action="store_true", help="skip the socket stages")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    setattr(pysyncobj_pickle, "__protocol", 5)  # as pysyncobj_patches.install does
    columns_results: dict[tuple[int, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="hastream-micro-") as directory:
        for columns in args.columns:
            for batch_rows in args.batch:
                columns_results[columns, batch_rows] = stages(
                    columns, batch_rows, Path(directory), not args.no_wire
                )
                print(f"measured {columns} columns x {batch_rows} rows", flush=True)
    keys = list(next(iter(columns_results.values())))
    header = [f"{c} cols x {b:,}" for c, b in columns_results]
    lines = [
        "# Write-path stages, one batch, microseconds (median)",
        "",
        f"`python -m bench.micro {' '.join(argv or [])}` on code {common.code_version()}; "
        "load average "
        f"{common.load_average():.1f} at the end; 2 cores shared with other work.",
        "",
        "| stage | " + " | ".join(header) + " |",
        "|---|" + "---:|" * len(header),
    ]
    for key in keys:
        if key == "payload bytes":
            cells = [f"{r[key]:,.0f} B" for r in columns_results.values()]
        else:
            cells = [f"{r[key] * 1e6:,.0f}" for r in columns_results.values()]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "micro.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
