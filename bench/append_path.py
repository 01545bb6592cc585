"""Whole-process cost of the publish path through one group, for A/B runs of two checkouts.

    PYTHONPATH=<checkout> python bench/append_path.py [--publishes 20000] [--threads 4]

Builds a node's local (non-HA) group in a temporary directory under --dir (default
/dev/shm, where fsync costs nothing, so the Python work of the path is what is timed),
creates one table and sends --publishes 10-row publishes through `Group.publish` from
--threads threads: validation, group commit, the journal, apply and the data files, and
whatever the checkout adds (the per-table publish counters and acknowledgement histogram).
Compare two checkouts whole-process, e.g. with `/usr/bin/time -v` run by turns; the
figures in docs/benchmark.md were taken that way. Uses only the API both sides share.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import pyarrow as pa

from raftstore import commands, config
from raftstore.node import Node

SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float64())])


def payload(first: int, rows: int) -> bytes:
    table = pa.table({"id": range(first, first + rows), "value": [0.5] * rows}, schema=SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, SCHEMA) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/append_path.py")
    parser.add_argument("--publishes", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        cfg = Path(root, "cluster.cfg")
        cfg.write_text(
            "streamingHAMode=raft\nstreamingRaftGroups=2:n1:n2:n3\nstreamingRaftSecret=s\n"
            f"persistenceDir={root}/<ALIAS>/p\nstreamingHADir={root}/<ALIAS>/r\n"
            + "".join(
                f"n{i}.host=127.0.0.1\nn{i}.port={8000 + i}\nn{i}.raftPorts=2:{9000 + i}\n"
                for i in (1, 2, 3)
            )
        )
        node = Node(config.load(cfg), "n1")
        node._start_local_group()
        group = node.group(0)
        schema_ipc = SCHEMA.serialize().to_pybytes()
        group.create_table(commands.CreateTable("ab", schema_ipc, 1000, None, 1440))
        payloads = [payload(i * 10, 10) for i in range(64)]
        per_thread = args.publishes // args.threads

        def publish(thread: int) -> None:
            for number in range(per_thread):
                item = commands.AppendItem("ab", b"", 0, payloads[(thread + number) % 64])
                group.publish(item)

        threads = [threading.Thread(target=publish, args=(t,)) for t in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        rows = group.table_view("ab").row_count
        group.close()
    print(f"published {per_thread * args.threads} batches, {rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
