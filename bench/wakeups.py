"""What waking a thread costs on this machine: the floor under every hand-off of the write path.

    python -m bench.wakeups [--rounds 2000]

A waited one-row append crosses threads and processes about forty times on the way (gRPC's
server thread, a worker, the Raft tick thread, the journal's helper, the followers' tick
threads, the client). On some VMs a wake-up from an idle core costs tens of microseconds
of CPU, as much as the Python of a whole stage. Prints, per operation, the wall time and
the CPU time (this process's, all threads) it takes:

  poll timeout 10 ms / 1 ms   a thread that sleeps in poll until its timeout
  thread ping-pong            two threads handing a token back and forth (Events)
  process ping-pong           two processes over a socket pair, one byte each way

Compare runs of it across machines before comparing their benchmark figures.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    name: str
    wall_us: float  # per operation
    cpu_us: float  # per operation: this process's CPU, every thread


def _cpu_s() -> float:
    return time.process_time()  # every thread of this process, at the clock's resolution


def poll_timeout(timeout_ms: int, rounds: int) -> Cost:
    """A poll on an idle socket that returns at its timeout, `rounds` times."""
    mine, other = socket.socketpair()
    poller = select.poll()
    poller.register(mine, select.POLLIN)
    try:
        cpu, wall = _cpu_s(), time.perf_counter()
        for _ in range(rounds):
            poller.poll(timeout_ms)
        wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
    finally:
        mine.close()
        other.close()
    return Cost(f"poll timeout {timeout_ms} ms", wall / rounds * 1e6, cpu / rounds * 1e6)


def thread_ping_pong(rounds: int) -> Cost:
    """Two threads: each round trip wakes the other thread and then this one (2 wake-ups)."""
    ping, pong = threading.Event(), threading.Event()

    def answer() -> None:
        for _ in range(rounds):
            if not ping.wait(timeout=10):
                return
            ping.clear()
            pong.set()

    other = threading.Thread(target=answer, daemon=True)
    other.start()
    cpu, wall = _cpu_s(), time.perf_counter()
    for _ in range(rounds):
        ping.set()
        if not pong.wait(timeout=10):
            raise RuntimeError("the other thread stopped answering")
        pong.clear()
    wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
    other.join(timeout=10)
    return Cost("thread ping-pong", wall / rounds * 1e6, cpu / rounds * 1e6)


def process_ping_pong(rounds: int) -> Cost:
    """Two processes over a socket pair; the CPU is both processes'."""
    mine, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:  # the child answers every byte, then leaves without Python's cleanup
        mine.close()
        for _ in range(rounds):
            theirs.recv(1)
            theirs.sendall(b"x")
        os._exit(0)
    theirs.close()
    try:
        cpu, wall = _cpu_s(), time.perf_counter()
        for _ in range(rounds):
            mine.sendall(b"x")
            if not mine.recv(1):
                raise RuntimeError("the child process closed its end")
        wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
    finally:
        mine.close()
        _, _, usage = os.wait4(child, 0)
    cpu += usage.ru_utime + usage.ru_stime
    return Cost("process ping-pong", wall / rounds * 1e6, cpu / rounds * 1e6)


def measure(rounds: int) -> list[Cost]:
    """Every operation; the timed polls take `rounds` / 10 and / 2 rounds (they sleep)."""
    return [
        poll_timeout(10, max(1, rounds // 10)),
        poll_timeout(1, max(1, rounds // 2)),
        thread_ping_pong(rounds),
        process_ping_pong(rounds),
    ]


def table(costs: list[Cost]) -> str:
    lines = ["| operation | wall us | CPU us |", "|---|---:|---:|"]
    lines += [f"| {cost.name} | {cost.wall_us:,.0f} | {cost.cpu_us:,.1f} |" for cost in costs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.wakeups",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    print(table(measure(args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
