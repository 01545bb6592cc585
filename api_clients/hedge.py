"""The shell of `call_policy.hedge`: while an attempt on a site goes unanswered, ask the other
sites who leads, and say when they agree on another leader.

A `LeaderWatch` belongs to one attempt (a unary call, a publish stream, a subscription
stream) on one site. Its owner calls `check(waited_s)` now and then (it never blocks): the
watch asks `call_policy.hedge` what to do, sends the questions it is told to as gRPC
futures (`GetStreamingLeader` of the table's group; `GetStreamingRaftGroups` while the group
is unknown, which also tells it), records the answers as they arrive (on gRPC's threads),
and returns the leader to move to once `hedge` names one. `close()` cancels the questions
still out.

An `AttemptMonitor` runs the watches of a session's unary attempts. Those block in gRPC on
their callers' threads (gRPC's future form would let them be cancelled one by one, but
hands every answer over between threads: +0.45 ms per call, measured, on the hot path of
every publish), so the monitor's thread checks them: an attempt registers itself (a lock
and a set), and one that has waited past the delay gets a watch. When a watch says move,
the monitor closes the silent site's channel, which ends every call in flight on it (as
the keepalive would, seconds later), marks each of that site's attempts `moved`, and the
next use of the site opens a fresh channel. The thread ends after a few idle seconds and is
started again by the next attempt.

A `StreamGuard` runs a watch for a stream its caller iterates (a Read): a daemon thread
checks it while the stream goes without a message, and cancels the stream when told to
move; the caller then raises `guard.moved` (an `Unresponsive`).

Threads: `check` and `close` from the owner's thread; answers land from gRPC's threads; one
lock guards the probes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from api_clients import transport
from api_clients.call_policy import HedgeState, SiteProbe, hedge
from proto import hastream_pb2

log = logging.getLogger(__name__)

HEDGE_DELAY_S_DEFAULT: Final = 1.0
# How often one site is asked again while the attempt waits: the client notices a new
# leader within this of its election (the same as the retry backoff's cap).
PROBE_INTERVAL_S: Final = 0.25
# One question's deadline: a site that does not answer in this long is asked again.
PROBE_TIMEOUT_S: Final = 1.0
# How often the monitor looks at the attempts in flight, and how long it lingers idle.
MONITOR_TICK_S: Final = 0.05
MONITOR_IDLE_S: Final = 10.0


class ProbeHost(Protocol):
    """What a watch needs of a session (`connection.Session`)."""

    @property
    def sites(self) -> list[str]: ...

    def hold_stub(self, site: str) -> tuple[Any, Callable[[], None]]: ...

    def learn_site(self, address: str) -> str | None: ...

    def table_group(self, table: str) -> int | None: ...

    def remember_table_group(self, table: str, group: int) -> None: ...


@dataclass(slots=True)
class _Probe:
    asked_at: float
    pending: bool = True
    leader: str | None = None
    future: Any = None


class LeaderWatch:
    """Watches one attempt on `site` for a call about `table` (or raft `group`)."""

    def __init__(
        self,
        host: ProbeHost,
        site: str,
        *,
        table: str | None,
        group: int | None,
        delay_s: float,
        interval_s: float = PROBE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert table is not None or group is not None, "a watch needs a table or a group"
        self._host = host
        self.site = site
        self._table = table
        self._group = group
        self.delay_s = delay_s
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._probes: dict[str, _Probe] = {}
        self._closed = False

    def check(self, waited_s: float) -> str | None:
        """The leader (host:port) to move the attempt to, once the other sites agree on one
        that is not `site`; None: keep waiting. Sends the questions due. Never blocks."""
        now = self._clock()
        with self._lock:
            probes = {
                site: SiteProbe(now - probe.asked_at, probe.pending, probe.leader)
                for site, probe in self._probes.items()
            }
        step = hedge(
            HedgeState(
                target=self.site,
                sites=tuple(self._host.sites),
                waited_s=waited_s,
                delay_s=self.delay_s,
                interval_s=self._interval_s,
                probes=probes,
            )
        )
        for site in step.probe:
            self._ask(site, now)
        if step.move_to is not None:
            log.info(
                "leaving a silent site site=%s waited=%.2fs leader=%s",
                self.site,
                waited_s,
                step.move_to,
            )
        return step.move_to

    def poll_s(self, waited_s: float) -> float:
        """How long the owner may wait before the next `check` is useful."""
        return max(0.02, min(self.delay_s - waited_s, self._interval_s / 5))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            futures = [probe.future for probe in self._probes.values() if probe.pending]
        for future in futures:
            future.cancel()

    def _ask(self, site: str, now: float) -> None:
        group = self._group
        if group is None and self._table is not None:
            group = self._host.table_group(self._table)
        try:
            stub, release = self._host.hold_stub(site)
        except RuntimeError:  # the session closed
            return
        # The probe counts on its channel until it ends (api_clients/dials.py): a channel
        # retired meanwhile is closed only after it, not under it.
        try:
            if group is not None:
                request: Any = hastream_pb2.GroupRequest(raft_group=group)
                future = stub.GetStreamingLeader.future(request, timeout=PROBE_TIMEOUT_S)
            else:
                future = stub.GetStreamingRaftGroups.future(
                    hastream_pb2.Empty(), timeout=PROBE_TIMEOUT_S
                )
        except BaseException:
            release()
            raise
        future.add_done_callback(lambda _: release())
        probe = _Probe(asked_at=now, future=future)
        with self._lock:
            if self._closed:
                future.cancel()
                return
            previous = self._probes.get(site)
            probe.leader = previous.leader if previous is not None else None
            self._probes[site] = probe
        transport.when_done(future, lambda answer: self._answered(site, probe, answer))

    def _answered(self, site: str, probe: _Probe, answer: Any) -> None:
        """gRPC's thread: record what `site` named (None: it failed or knows no leader)."""
        leader = self._leader_in(answer) if answer is not None else None
        with self._lock:
            probe.pending = False
            probe.leader = leader
            probe.future = None

    def _leader_in(self, answer: Any) -> str | None:
        if isinstance(answer, hastream_pb2.LeaderInfo):
            address = answer.leader
        else:
            assert self._table is not None, "asked by table only"
            address = ""
            for group in answer.groups:
                if self._table in group.tables:
                    self._host.remember_table_group(self._table, group.raft_group)
                    address = group.leader
        return self._host.learn_site(address) if address else None


class StreamGuard:
    """Leaves a stream that goes silent (see the module docstring). `heard()` after every
    message; `close()` when the stream ended, whatever the way."""

    def __init__(self, watch: LeaderWatch, cancel: Callable[[], None]) -> None:
        self._watch = watch
        self._cancel = cancel
        self._lock = threading.Lock()
        self._heard_at = time.monotonic()
        self._done = threading.Event()
        self.moved: transport.Unresponsive | None = None
        threading.Thread(target=self._run, name=f"stream-guard-{watch.site}", daemon=True).start()

    def heard(self) -> None:
        with self._lock:
            self._heard_at = time.monotonic()

    def close(self) -> None:
        self._done.set()

    def _run(self) -> None:
        try:
            while not self._done.is_set():  # until the stream ends, or is left
                with self._lock:
                    waited_s = time.monotonic() - self._heard_at
                leader = self._watch.check(waited_s)
                if leader is not None:
                    self.moved = transport.Unresponsive(self._watch.site, waited_s, leader)
                    self._cancel()
                    return
                self._done.wait(self._watch.poll_s(waited_s))
        finally:
            self._watch.close()


@dataclass(slots=True, eq=False)
class Ticket:
    """One unary attempt in flight, registered with a monitor (identity-hashed)."""

    site: str
    table: str | None
    group: int | None
    started: float
    watch: LeaderWatch | None = None  # created once it has waited past the delay
    moved: transport.Unresponsive | None = None  # set when its site was left


class AttemptMonitor:
    """Watches a session's unary attempts in flight (see the module docstring).
    `drop_channel(site)` closes the site's channel and forgets it."""

    def __init__(
        self, host: ProbeHost, delay_s: float, drop_channel: Callable[[str], None]
    ) -> None:
        self._host = host
        self._delay_s = delay_s
        self._drop_channel = drop_channel
        self._lock = threading.Lock()
        self._tickets: set[Ticket] = set()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def begin(self, site: str, *, table: str | None, group: int | None) -> Ticket:
        """Registers an attempt about to be sent to `site` (the caller's thread)."""
        ticket = Ticket(site, table, group, time.monotonic())
        with self._lock:
            self._tickets.add(ticket)
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="hedge-monitor", daemon=True)
                self._thread.start()
        return ticket

    def end(self, ticket: Ticket) -> None:
        """The attempt ended (answered or failed): stop watching it."""
        with self._lock:
            self._tickets.discard(ticket)
            watch = ticket.watch
        if watch is not None:
            watch.close()

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:  # the monitor's loop: until idle for MONITOR_IDLE_S, or closed
        idle_since = time.monotonic()
        while not self._closed.wait(MONITOR_TICK_S):
            now = time.monotonic()
            with self._lock:
                tickets = [ticket for ticket in self._tickets if ticket.moved is None]
                if self._tickets:
                    idle_since = now
                elif now - idle_since > MONITOR_IDLE_S:
                    self._thread = None  # the next begin() starts another
                    return
            for ticket in tickets:
                self._check(ticket, now)
        with self._lock:
            self._thread = None

    def _check(self, ticket: Ticket, now: float) -> None:
        waited_s = now - ticket.started
        if waited_s < self._delay_s:
            return
        with self._lock:
            if ticket not in self._tickets:
                return  # it ended meanwhile (and closed no watch of ours)
            if ticket.watch is None:
                ticket.watch = LeaderWatch(
                    self._host,
                    ticket.site,
                    table=ticket.table,
                    group=ticket.group,
                    delay_s=self._delay_s,
                )
            watch = ticket.watch
        leader = watch.check(waited_s)
        if leader is None:
            return
        with self._lock:
            for other in self._tickets:
                if other.site == ticket.site and other.moved is None:
                    other.moved = transport.Unresponsive(other.site, now - other.started, leader)
        self._drop_channel(ticket.site)
