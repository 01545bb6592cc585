"""A session's channels (api_clients/dials.py) over real gRPC channels: a retired channel
stays open for the calls on it and closes after the last, a dropped one closes at once, and
retired channels are bounded. Most channels dial a loopback port nothing listens on, and
their open or closed state is what is checked; a stream's end is checked against a real
node, and a hedge probe against a real node held by SIGSTOP. `DialsModel`
runs random sequences of it all against a plain model."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import grpc
import pyarrow as pa
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from api_clients import dials as dials_module
from api_clients import transport
from api_clients.connection import Session
from api_clients.dials import Dial, Dials, SessionClosed
from api_clients.hedge import PROBE_TIMEOUT_S, LeaderWatch
from api_clients.publisher import Publisher
from deploy.local_cluster import LocalCluster, free_ports, wait_until
from proto import hastream_pb2, hastream_pb2_grpc


@pytest.fixture
def site() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"


@pytest.fixture
def dials() -> Iterator[Dials]:
    def dial(site: str) -> Dial:
        channel = grpc.insecure_channel(site)
        return Dial(site, channel, hastream_pb2_grpc.StreamTableStub(channel))

    made = Dials(dial)
    yield made
    made.close()


def closes(dial: Dial) -> bool:
    """Waits for `dial`'s channel to close: a channel whose last call ended is closed on a
    thread of its own (`dials.close_aside`)."""
    return bool(wait_until(lambda: is_closed(dial), timeout_s=10, message="the channel closed"))


def is_closed(dial: Dial) -> bool:
    """A closed gRPC channel refuses new calls at once, before any network."""
    try:
        dial.stub.GetStreamingRaftGroups(hastream_pb2.Empty(), timeout=0.001)
    except ValueError:  # "Cannot invoke RPC on closed channel!"
        return True
    except grpc.RpcError:
        return False
    return False


def test_a_retired_channel_stays_open_until_its_last_call_ends(dials: Dials, site: str) -> None:
    first, release_first = dials.hold(site)
    second, release_second = dials.hold(site)
    assert first is second
    dials.retire(first)
    fresh = dials.current(site)
    assert fresh is not first  # new calls dial anew
    assert dials.counts() == (1, 1)
    release_first()
    release_first()  # a second release is a no-op, not a second decrement
    assert not is_closed(first)  # one call still runs on it
    release_second()
    assert closes(first)
    assert not is_closed(fresh)
    assert dials.counts() == (1, 0)


def test_a_retired_channel_without_calls_closes_at_once(dials: Dials, site: str) -> None:
    with dials.call(site) as dial:
        pass
    dials.retire(dial)
    assert closes(dial)
    assert dials.counts() == (0, 0)


def test_retiring_twice_or_retiring_a_replaced_channel_changes_nothing(
    dials: Dials, site: str
) -> None:
    old, release = dials.hold(site)
    dials.retire(old)
    fresh = dials.current(site)
    dials.retire(old)  # another thread's attempt on the old channel failed too
    assert dials.current(site) is fresh
    release()
    assert closes(old)
    assert not is_closed(fresh)


def test_retired_channels_are_bounded(dials: Dials, site: str) -> None:
    held = []
    for _ in range(dials_module.RETIRED_MAX + 2):
        dial, release = dials.hold(site)
        held.append((dial, release))
        dials.retire(dial)
    assert dials.counts() == (0, dials_module.RETIRED_MAX)
    # The two oldest were closed with calls still on them (they fail CANCELLED).
    assert closes(held[0][0])
    assert closes(held[1][0])
    assert not is_closed(held[2][0])
    for _, release in held:
        release()
    assert dials.counts() == (0, 0)
    assert all(closes(dial) for dial, _ in held)


def test_a_dropped_channel_closes_at_once_and_the_next_use_dials_anew(
    dials: Dials, site: str
) -> None:
    dial, release = dials.hold(site)
    assert dials.drop(site)
    assert is_closed(dial)  # a silent site's calls are ended, not waited for
    assert not dials.drop(site)
    assert dials.current(site) is not dial
    release()


def test_a_closed_set_closes_every_channel_and_refuses_new_ones(dials: Dials, site: str) -> None:
    retired, _release = dials.hold(site)
    dials.retire(retired)
    current = dials.current(site)
    dials.close()
    assert is_closed(retired)
    assert is_closed(current)
    with pytest.raises(SessionClosed):
        dials.current(site)
    with pytest.raises(SessionClosed):
        dials.hold(site)


class DialsModel(RuleBasedStateMachine):
    """Random sequences of calls, streams, retirements and drops on two sites against a
    plain model: which channels are current, which retired ones stay open, and that every
    channel is closed once, exactly when the model says (the close hook records it)."""

    SITES = ("127.0.0.1:1", "127.0.0.1:2")  # never dialled for real: no call is made
    RETIRED_MAX = 2

    def __init__(self) -> None:
        super().__init__()
        self.closes: list[Dial] = []

        def dial(site: str) -> Dial:
            channel = grpc.insecure_channel(site)
            return Dial(site, channel, hastream_pb2_grpc.StreamTableStub(channel))

        def close(dial: Dial) -> None:
            self.closes.append(dial)
            dial.channel.close()

        # Two retired channels at most: short sequences reach the bound and go past it.
        self.dials = Dials(dial, close, close, retired_max=self.RETIRED_MAX)
        self.calls: dict[int, int] = {}  # id(dial) -> calls the model counts on it
        self.known: dict[int, Dial] = {}  # in the order they were dialled
        self.current: dict[str, Dial] = {}
        self.retired: list[Dial] = []  # retired and open, oldest first
        self.closed: set[int] = set()
        self.releases: list[tuple[Dial, Callable[[], None], bool]] = []  # dial, release, done

    def _close(self, dial: Dial) -> None:
        assert id(dial) not in self.closed
        self.closed.add(id(dial))

    @rule(site=st.sampled_from(SITES))
    def hold(self, site: str) -> None:
        dial, release = self.dials.hold(site)
        if site in self.current:
            assert dial is self.current[site]
        else:
            assert id(dial) not in self.known  # a new channel, never an old one again
            self.current[site] = dial
            self.known[id(dial)] = dial
            self.calls[id(dial)] = 0
        self.calls[id(dial)] += 1
        self.releases.append((dial, release, False))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.releases:
            return
        index = data.draw(st.integers(0, len(self.releases) - 1))
        dial, release, done = self.releases[index]
        release()
        if done:
            return  # a second release changes nothing
        self.releases[index] = (dial, release, True)
        self.calls[id(dial)] -= 1
        if self.calls[id(dial)] == 0 and dial in self.retired:
            self.retired.remove(dial)
            self._close(dial)

    @rule(site=st.sampled_from(SITES))
    def retire_current(self, site: str) -> None:
        """An attempt on the site's current channel could not connect."""
        if site in self.current:
            self._retire(self.current[site])

    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        """An attempt on some channel, current or not, could not connect (a late one)."""
        if self.known:
            self._retire(data.draw(st.sampled_from(list(self.known.values()))))

    def _retire(self, dial: Dial) -> None:
        self.dials.retire(dial)
        if self.current.get(dial.site) is not dial:
            return
        del self.current[dial.site]
        if self.calls[id(dial)] == 0:
            self._close(dial)
            return
        self.retired.append(dial)
        while len(self.retired) > self.RETIRED_MAX:
            self._close(self.retired.pop(0))

    @rule(site=st.sampled_from(SITES))
    def drop(self, site: str) -> None:
        dropped = self.dials.drop(site)
        assert dropped == (site in self.current)
        if dropped:
            self._close(self.current.pop(site))

    @invariant()
    def closes_match_the_model(self) -> None:
        assert {id(dial) for dial in self.closes} == self.closed
        assert len(self.closes) == len(self.closed)  # each closed once
        assert self.dials.counts() == (len(self.current), len(self.retired))

    def teardown(self) -> None:
        self.dials.close()
        assert {id(dial) for dial in self.closes} == set(self.known)
        assert len(self.closes) == len(self.known)


TestDialsModel = DialsModel.TestCase
TestDialsModel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


ROWS: Final = 1_000  # what the real node's Read streams back before it ends


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A real three-node cluster whose group 2 has a leader."""
    cluster = LocalCluster(tmp_path / "cluster")
    cluster.start()
    try:
        cluster.leader()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.cluster
def test_a_stream_that_ends_by_itself_closes_its_retired_channel(
    dials: Dials, cluster: LocalCluster
) -> None:
    """The end of a stream is reported on gRPC's own thread for the channel, and its
    release closes the retired channel. Closed right there, with another call still on it
    (one not counted, as the hedge's probes were not), the close waited for that very thread
    to end the other call, and every call on the channel hung (a pipelined publisher, in a
    full test run). On a real node: a Read of the table's rows ends by itself, a Subscribe
    stays open waiting for new rows."""
    site = cluster.nodes[cluster.leader()].site
    cluster.create_table("ends", pa.schema([("id", pa.int64())]))
    with Session([site]) as session:
        Publisher(session, "ends").append(pa.table({"id": list(range(ROWS))}))
    dial, release = dials.hold(site)
    other = dial.stub.Subscribe(
        hastream_pb2.SubscribeRequest(table="ends", action_name="held", offset=0), timeout=10
    )
    next(other)  # in flight, uncounted, until the channel closes
    read = hastream_pb2.ReadRequest(table="ends", offset_from=0, offset_to=ROWS)
    stream = transport.Stream(dial.stub.Read(read, timeout=10), site, 10)
    stream.when_ended(release)
    dials.retire(dial)
    received: list[hastream_pb2.RowBatch] = []
    reader = threading.Thread(target=received.extend, args=(stream,), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the stream hung"
    assert sum(batch.row_count for batch in received) == ROWS
    assert closes(dial)
    with pytest.raises(grpc.RpcError) as ended:
        for _ in other:  # heartbeats, until the close ends the call
            pass
    assert ended.value.code() == grpc.StatusCode.CANCELLED  # by the close


@pytest.mark.cluster
def test_a_hedge_probe_keeps_its_retired_channel_open_until_it_ends(cluster: LocalCluster) -> None:
    """The hedge asks the other sites who leads with gRPC futures. Uncounted, a probe in
    flight on a channel retired meanwhile had the channel closed under it (CANCELLED), and
    the watch lost that site's answer. The asked site is a real node, stopped (SIGSTOP) so
    that the probe stays in flight until its timeout (hedge.PROBE_TIMEOUT_S)."""
    alias = next(iter(cluster.nodes))
    session: Session | None = None
    try:
        asked = cluster.nodes[alias].site
        silent = f"127.0.0.1:{free_ports(1)[0]}"
        session = Session([silent, asked], hedge_delay_s=None)  # the watch below is the test's
        dials = session._dials
        dials.current(asked).stub.GetStreamingRaftGroups(hastream_pb2.Empty(), timeout=10)
        cluster.signal(alias, signal.SIGSTOP)
        for _ in range(3):  # a try whose steps took near the probe's timeout says nothing
            watch = LeaderWatch(session, silent, table=None, group=2, delay_s=0)
            asked_at = time.monotonic()
            assert watch.check(waited_s=1.0) is None  # asks `asked` who leads
            dial = dials.current(asked)
            dials.retire(dial)
            closed = is_closed(dial)
            in_time = time.monotonic() - asked_at < PROBE_TIMEOUT_S / 2
            if in_time:
                assert not closed, "the channel closed under the probe in flight"
            assert closes(dial)  # once the probe ended (its timeout), its channel goes
            watch.close()
            if in_time:
                break
        else:
            pytest.fail("no try retired the channel within half the probe's timeout")
    finally:
        cluster.signal(alias, signal.SIGCONT)
        if session is not None:
            session.close()
