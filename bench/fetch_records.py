"""Fetching a table of one-row records from a real node, as a repair or catch-up does:
FetchRecords (one gRPC message per record: what nodes before FetchRecordBatches serve)
against FetchRecordBatches (records packed up to limits.FETCH_BATCH_BYTES_MAX).

    python -m bench.fetch_records [--records 50000] [--repeat 2]

A three-node local cluster, one HA table filled with `--records` one-row publishes, one
after the other (each its own Raft entry, so its own data-file record). Then, `--repeat`
times each, a follower's records [0, records) through this node's `PeerClient`, as the
Repairer asks them: FetchRecords by PeerClient's fallback path (a peer of an earlier
version), FetchRecordBatches by `fetch_records`. Prints the wall time and the CPU seconds
of the fetching process (the client's gRPC threads included) and of the serving node.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator

import pyarrow as pa

from bench import common
from deploy.local_cluster import LocalCluster, ipc_stream, wait_until
from hastream.model import NodeAddress
from proto import hastream_pb2 as pb
from raftstore.peer_auth import PeerSigner, peer_key
from raftstore.peers import PeerClient
from raftstore.storage.segments import DataRecord

TABLE = "fetch_ticks"
SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("temp", pa.float64())])
# deploy/local_cluster.py's cluster.cfg secret: this process signs as a node would.
CLUSTER_SECRET = "test-cluster-secret"

Fetch = Callable[[], Iterator[DataRecord]]


def fill(cluster: LocalCluster, records: int) -> float:
    """`records` one-row publishes to the leader, one at a time; their rate."""
    stub = cluster.stub(cluster.leader(common.HA_GROUP))
    started = time.perf_counter()
    for key in range(records):
        rows = pa.table({"id": [key], "ts": [key], "temp": [key * 0.5]}, schema=SCHEMA)
        request = pb.PublishRequest(table=TABLE, payload=ipc_stream(rows))
        stub.Publish(request, timeout=60)
    return records / (time.perf_counter() - started)


def measure(name: str, fetch: Fetch, node_pid: int, records: int) -> dict[str, float]:
    node_before, client_before = common.cpu_seconds(node_pid), time.process_time()
    started = time.perf_counter()
    fetched = sum(1 for _ in fetch())
    wall = time.perf_counter() - started
    client = time.process_time() - client_before
    node = common.cpu_seconds(node_pid) - node_before
    assert fetched == records, f"{name}: {fetched} records, want {records}"
    return {"wall_s": wall, "client_cpu_s": client, "node_cpu_s": node}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with common.bench_cluster(purge_interval_s=300.0, election_timeout_s=1.0) as cluster:
        common.create_table(cluster, None, TABLE, SCHEMA, group=common.HA_GROUP)
        rate = fill(cluster, args.records)
        print(f"filled {args.records} one-row records at {rate:.0f}/s", flush=True)
        wait_until(
            lambda: all(cluster.row_count(a, TABLE) == args.records for a in cluster.nodes),
            timeout_s=120,
            message="every replica holds the rows",
        )
        leader = cluster.leader(common.HA_GROUP)
        source = next(alias for alias in sorted(cluster.nodes) if alias != leader)
        node = cluster.nodes[source]
        peer = NodeAddress(node.host, node.port, source)
        assert node.process is not None
        peers = PeerClient(PeerSigner(peer_key(CLUSTER_SECRET), "bench"))
        request = pb.FetchRecordsRequest(
            raft_group=common.HA_GROUP, table=TABLE, offset_from=0, offset_to=args.records
        )
        fetches: dict[str, Fetch] = {
            # The path PeerClient takes for a peer that answered UNIMPLEMENTED.
            "FetchRecords": lambda: peers._fetch_one_by_one(peer, request),
            "FetchRecordBatches": lambda: peers.fetch_records(
                peer, common.HA_GROUP, TABLE, 0, args.records, 0
            ),
        }
        print(f"{os.cpu_count()} cores; {args.records} records from {source} (a follower)")
        print("| RPC | wall s | fetching process CPU s | serving node CPU s |")
        print("|---|---|---|---|")
        try:
            for _ in range(args.repeat):
                for name, fetch in fetches.items():
                    result = measure(name, fetch, node.process.pid, args.records)
                    print(
                        f"| {name} | {result['wall_s']:.2f} | {result['client_cpu_s']:.2f} "
                        f"| {result['node_cpu_s']:.2f} |",
                        flush=True,
                    )
        finally:
            peers.close()


if __name__ == "__main__":
    main()
