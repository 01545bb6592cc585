"""What one gRPC message costs in Python: an echo PublishStream, K requests per message.

    python -m bench.grpc_stream [--requests 20000] [--per-message 1 4 16 64]

A server process answers every PublishBatch with one PublishAcks (one answer per request,
no Raft, no Arrow) with the same threading as raftstore/pipeline.py (a reader thread per
stream, the handler thread yields the answers); this client runs 4 streams with up to 64
requests in flight each, packing K 1.4 KB requests per message. Prints requests/s and the
CPU per request of the server process and of this client: the floor of PublishStream's
per-request cost, and why requests are packed into messages.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from bench import common
from deploy.local_cluster import free_ports, wait_until
from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc

STREAMS = 4
WINDOW = 64
PAYLOAD = b"x" * 1368  # an 11-column 1-row Arrow IPC stream is 1,368 bytes


class _Echo(hastream_pb2_grpc.StreamTableServicer):
    def PublishStream(self, messages: Iterator[pb.PublishBatch], context: Any) -> Iterator[Any]:
        answers: collections.deque[int] = collections.deque()
        condition = threading.Condition()
        reading = [True]

        def read() -> None:
            for message in messages:
                with condition:
                    answers.extend(request.sequence for request in message.requests)
                    condition.notify()
            with condition:
                reading[0] = False
                condition.notify()

        threading.Thread(target=read, daemon=True).start()
        while True:  # until the client half-closes and everything is answered
            with condition:
                while not answers and reading[0]:
                    condition.wait()
                if not answers:
                    return
                ready = list(answers)
                answers.clear()
            yield pb.PublishAcks(
                responses=[pb.PublishResponse(sequence=s, row_count=1) for s in ready]
            )


def serve(port: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    hastream_pb2_grpc.add_StreamTableServicer_to_server(_Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def _stream(port: int, requests: int, per_message: int) -> None:
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
    )
    stub = hastream_pb2_grpc.StreamTableStub(channel)
    condition = threading.Condition()
    acked = [0]

    def outgoing() -> Iterator[pb.PublishBatch]:
        sent = 0
        while sent < requests:
            with condition:
                while sent - acked[0] + per_message > WINDOW:
                    condition.wait()
            count = min(per_message, requests - sent)
            yield pb.PublishBatch(
                requests=[
                    pb.PublishRequest(table="t", payload=PAYLOAD, producer_id=b"p" * 16, sequence=n)
                    for n in range(sent + 1, sent + count + 1)
                ]
            )
            sent += count

    for acks in stub.PublishStream(outgoing()):
        with condition:
            acked[0] += len(acks.responses)
            condition.notify()
    channel.close()


def measure(port: int, server_pid: int, requests: int, per_message: int) -> dict[str, float]:
    threads = [
        threading.Thread(target=_stream, args=(port, requests, per_message)) for _ in range(STREAMS)
    ]
    server_before = common.cpu_seconds(server_pid)
    client_before = time.process_time()
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall_s = time.perf_counter() - started
    total = requests * STREAMS
    return {
        "requests_per_s": total / wall_s,
        "server_us_per_request": (common.cpu_seconds(server_pid) - server_before) / total * 1e6,
        "client_us_per_request": (time.process_time() - client_before) / total * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_stream", description=__doc__)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=5_000, help="per stream")
    parser.add_argument("--per-message", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_stream", "--serve", str(port)],
        cwd=common.REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        wait_until(lambda: server.stdout.readline().startswith("ready"), timeout_s=30)
        print(f"load average {os.getloadavg()[0]:.1f}")
        print("| requests per message | requests/s | server CPU us/req | client CPU us/req |")
        print("|---:|---:|---:|---:|")
        for per_message in args.per_message:
            result = measure(port, server.pid, args.requests, per_message)
            print(
                f"| {per_message} | {result['requests_per_s']:,.0f} "
                f"| {result['server_us_per_request']:.0f} | {result['client_us_per_request']:.0f} |"
            )
        print(f"load average {os.getloadavg()[0]:.1f}")
    finally:
        server.kill()
        server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
