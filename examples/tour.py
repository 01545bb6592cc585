"""A short tour of the Python client, against a running cluster (`python -m deploy.local up`).

    python examples/tour.py [--sites host:port,...] [--config .run/cluster.cfg]

`deploy.local up` starts the nodes with TLS and logins, from `.run/cluster.cfg`: the tour
takes the CA and the admin's login from there (`--config`), as the `hastream` command
does. Against a plaintext cluster without logins, give `--sites` alone.

Creates a keyed HA table, publishes to it (a retried key is dropped by the cluster),
subscribes with a DolphinDB-style handler, reads it back, asks who leads, and drops the
table again, so the tour can be run any number of times. tests/test_examples.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from api_clients import Publisher, TableNotFound, connect
from deploy import local_security, rolling

TABLE = "haDevSt"
SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("temp", pa.float64())])


def readings(first_id: int, count: int) -> pa.Table:
    ids = list(range(first_id, first_id + count))
    return pa.table(
        {
            "id": ids,
            "ts": [1_700_000_000_000 + i for i in ids],
            "temp": [20.0 + i / 10 for i in ids],
        },
        schema=SCHEMA,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a short tour of the Python client")
    parser.add_argument("--sites", help="default: the sites of --config")
    parser.add_argument("--config", help="a cluster.cfg (default: .run/cluster.cfg if any)")
    args = parser.parse_args(argv)
    config_path = args.config
    if config_path is None and args.sites is None and Path(".run/cluster.cfg").exists():
        config_path = ".run/cluster.cfg"
    tls, login = (None, None)
    sites = args.sites
    if config_path is not None:
        tls, login = local_security.client_settings(config_path)
        sites = sites or ",".join(rolling.client_sites(config_path))
    first, *others = (sites or "127.0.0.1:8901,127.0.0.1:8902,127.0.0.1:8903").split(",")
    host, port = first.rsplit(":", 1)
    userid, password = login if login is not None else (None, None)

    # A session follows the leader by itself: any node of the cluster is a good start.
    session = connect(
        host,
        int(port),
        userid,
        password,
        highAvailabilitySites=others,
        caFile=None if tls is None else tls.ca_file,
        certFile=None if tls is None else tls.cert_file,
        keyFile=None if tls is None else tls.key_file,
    )
    with contextlib.suppress(TableNotFound):
        session.dropStreamTable(TABLE, force=True)  # left over from an earlier tour
    # Raft group 2 holds the table on three nodes; `id` is the key: a row whose id the
    # table already holds (in its dedup window) is dropped, so retries cannot duplicate.
    session.haStreamTable(2, SCHEMA, TABLE, cacheLimit=100_000, keyColumn="id")

    publisher = Publisher(session, TABLE)
    result = publisher.append(readings(0, 100))  # returns once committed on a majority
    print(f"appended rows [{result.first_offset}, {result.first_offset + result.row_count})")
    again = publisher.append(readings(90, 20))  # ids 90..99 are already there
    print(f"appended {again.row_count} new rows, {again.duplicates} duplicates dropped")

    # A subscriber gets every row from `offset`, in order, in batches (a pyarrow Table).
    received: list[int] = []
    all_in = threading.Event()

    def handler(msg: pa.Table) -> None:  # DolphinDB's one-argument form
        received.extend(msg.column("id").to_pylist())
        if len(received) >= 110:
            all_in.set()

    session.subscribe(TABLE, handler, offset=0, actionName="tour", persistOffset=True)
    if not all_in.wait(timeout=30):
        print(f"the subscriber got {len(received)} rows of 110", file=sys.stderr)
        return 1
    session.unsubscribe(TABLE, "tour")
    print(f"subscriber received {len(received)} rows, ids {received[0]}..{received[-1]}")

    table = session.read(TABLE, 0)  # any replica serves reads
    print(f"read {table.num_rows} rows; mean temp {pc.mean(table['temp']).as_py():.2f}")
    print(f"group 2 is led by {session.getStreamingLeader(2)}")

    session.dropStreamTable(TABLE, force=True)
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
