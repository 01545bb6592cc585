"""Operations against a real three-node cluster: the `hastream` command through its entry
point, /metrics scraped and parsed during a load, the lag metrics moving, gRPC health, the
status page in a headless browser, leadership transfer and hand-over at SIGTERM under a
publish load, and a preferred leader taking its group back.

One cluster for the module (groups 2 and 3, group 3 prefers node1); each test makes its own
tables. Measured stalls are printed (`-s`) and recorded as test properties.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_clients import Publisher, Session
from deploy.local_cluster import LocalCluster
from tests.harness import assert_replicas_hold_exactly, wait_replicas_settled, wait_until
from tests.ops_helpers import (
    REPO,
    SCHEMA,
    OrderedSubscriber,
    SteadyPublisher,
    batch,
    run_cli,
    run_cli_raw,
    sample,
    scrape,
)

pytestmark = pytest.mark.cluster

GROUP = 2
PREFERRED_GROUP = 3  # prefers node1 (streamingPreferredLeaders)
# Longest publish stall accepted for a planned leadership change; the measured figures are
# in docs/benchmark.md (the target is 0.5 s; this bound leaves room for a loaded machine).
STALL_MAX_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("ops"), groups=(GROUP, PREFERRED_GROUP))
    local.enable_metrics()
    local.add_config_lines(f"streamingPreferredLeaders={PREFERRED_GROUP}:node1")
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def sites(cluster: LocalCluster) -> str:
    return ",".join(f"127.0.0.1:{node.port}" for node in cluster.nodes.values())


@pytest.fixture
def session(sites: str) -> Iterator[Session]:
    with Session(sites.split(",")) as opened:
        yield opened


def create(session: Session, table: str, group: int = GROUP) -> None:
    session.haStreamTable(group, SCHEMA, table, cacheLimit=100_000, keyColumn="id")


def metrics_of(cluster: LocalCluster, alias: str) -> dict[str, object]:
    return scrape(cluster.metrics_ports[alias])


# --- the command line ----------------------------------------------------------------------


def test_cli_commands_through_the_entry_point(cluster: LocalCluster, sites: str) -> None:
    on = ("--sites", sites)
    created = run_cli(
        "create", "cli_t", "--group", "2", "--schema", "id:int64,value:float64", "--key", "id", *on
    )
    assert (created["table"], created["group"], created["key_column"]) == ("cli_t", 2, "id")
    assert created["schema"] == "id:int64,value:double"
    with Session(sites.split(",")) as session:
        Publisher(session, "cli_t").append(batch(0, 100))
        session.commit_offset("cli_t", "agg", 49)

    tables = {entry["table"]: entry for entry in run_cli("tables", *on)}
    assert (tables["cli_t"]["rows"], tables["cli_t"]["group"]) == (100, 2)
    leader = cluster.leader(GROUP)
    groups = {entry["id"]: entry for entry in run_cli("groups", *on)}
    assert "cli_t" in groups[GROUP]["tables"]
    assert groups[GROUP]["leader"].endswith(f":{leader}")
    assert run_cli("leader", "2", *on)["leader"].endswith(f":{leader}")
    stat = run_cli("stat", *on)
    assert stat["topics"]["cli_t/agg"] == 49
    assert {"topic": "cli_t/agg", "offset": 49, "rows": 100, "lag": 50} in run_cli(
        "offsets", "cli_t", *on
    )
    assert run_cli("offsets", "cli_t/agg", *on)[0]["lag"] == 50

    target = next(alias for alias in cluster.nodes if alias != leader)
    moved = run_cli("transfer-leader", "2", "--to", target, *on)
    assert moved["to"].endswith(f":{target}")
    assert cluster.leader(GROUP) == target

    nodes = run_cli("status", *on)
    assert [node["health"] for node in nodes] == ["SERVING"] * 3
    assert {node["status"]["alias"] for node in nodes} == set(cluster.nodes)

    tailed = run_cli_raw("tail", "cli_t", "--from", "0", "--limit", "5", "--json", *on)
    assert tailed.returncode == 0, tailed.stderr
    rows = [json.loads(line) for line in tailed.stdout.splitlines()]
    assert [(row["_offset"], row["id"]) for row in rows] == [(i, i) for i in range(5)]
    since = run_cli_raw("tail", "cli_t", "--since", "1d", "--limit", "5", "--json", *on)
    assert since.returncode == 0, since.stderr
    assert [json.loads(line)["_offset"] for line in since.stdout.splitlines()] == list(range(5))
    refused = run_cli_raw("tail", "cli_t", "--since", "last week", *on)
    assert refused.returncode == 2
    assert "is not a time" in refused.stderr

    assert run_cli("remove-offset", "cli_t/agg", *on) == {"removed": "cli_t/agg"}
    assert run_cli("offsets", "cli_t", *on) == []
    assert run_cli("drop", "cli_t", "--force", *on) == {"dropped": "cli_t"}
    assert "cli_t" not in {entry["table"] for entry in run_cli("tables", *on)}


def test_cli_prints_tables_for_people_and_typed_errors(sites: str) -> None:
    readable = run_cli_raw("groups", "--sites", sites)
    assert readable.returncode == 0, readable.stderr
    assert readable.stdout.split()[:4] == ["GROUP", "LEADER", "MEMBERS", "TABLES"]
    refused = run_cli_raw("leader", "9", "--sites", sites, "--json")
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["error"] == "UnknownGroup"
    usage = run_cli_raw("create", "x", "--sites", sites)
    assert usage.returncode == 2, usage.stdout


# --- metrics -------------------------------------------------------------------------------


def test_metrics_are_scraped_and_parsed_during_a_publish_load(
    cluster: LocalCluster, session: Session
) -> None:
    create(session, "m_load")
    publisher = SteadyPublisher(session, "m_load").start()
    try:
        wait_until(lambda: len(publisher.acked) >= 300, timeout_s=30, message="load running")
        leader = cluster.leader(GROUP)
        scraped = {alias: metrics_of(cluster, alias) for alias in cluster.nodes}
    finally:
        publisher.stop()
    assert publisher.failures == []
    for families in scraped.values():
        assert families["hastream_publish_rows"].type == "counter"
        assert families["hastream_publish_ack_seconds"].type == "histogram"
        assert families["hastream_raft_fsync_seconds"].type == "histogram"
        assert (sample(families, "hastream_raft_fsync_seconds_count", group="2") or 0) > 0
        assert (sample(families, "process_resident_memory_bytes") or 0) > 10_000_000
        assert (sample(families, "process_open_fds") or 0) > 10
        assert sample(families, "hastream_node_serving") == 1
        assert sample(families, "hastream_replica_health", group="2", state="healthy") == 1
        assert (sample(families, "hastream_table_rows", table="m_load") or 0) >= 300
    leaders = [
        a
        for a, f in scraped.items()
        if sample(f, "hastream_raft_role", group="2", role="leader") == 1
    ]
    assert leaders == [leader]
    on_leader = scraped[leader]
    requests = sample(on_leader, "hastream_publish_requests_total", table="m_load")
    assert requests is not None
    assert requests >= 30
    assert sample(on_leader, "hastream_publish_ack_seconds_count", table="m_load") == requests
    assert (sample(on_leader, "hastream_publish_rows_total", table="m_load") or 0) >= 300
    assert (sample(on_leader, "hastream_publish_bytes_total", table="m_load") or 0) > 0
    # Read while rows arrive: the window and the row count are sampled moments apart.
    assert (sample(on_leader, "hastream_dedup_window_rows", table="m_load") or 0) >= 300
    terms = {sample(f, "hastream_raft_term", group="2") for f in scraped.values()}
    assert len(terms) == 1


def test_follower_lag_metric_moves_when_a_follower_is_stopped(
    cluster: LocalCluster, session: Session
) -> None:
    create(session, "m_lag")
    leader = cluster.leader(GROUP)
    follower = next(alias for alias in sorted(cluster.nodes, reverse=True) if alias != leader)

    def lag() -> float:
        families = metrics_of(cluster, leader)
        found = sample(
            families, "hastream_raft_follower_match_lag_entries", group="2", follower=follower
        )
        assert found is not None, "the leader exports a lag per follower"
        return found

    publisher = SteadyPublisher(session, "m_lag").start()
    cluster.signal(follower, signal.SIGSTOP)
    try:
        wait_until(lambda: lag() >= 20, timeout_s=30, message="follower lag grows")
    finally:
        cluster.signal(follower, signal.SIGCONT)
        publisher.stop()
    wait_until(lambda: lag() == 0, timeout_s=30, message="follower caught up")
    assert publisher.failures == []


def test_subscriber_lag_metric_moves_when_the_subscriber_stops_reading(
    cluster: LocalCluster, session: Session
) -> None:
    create(session, "m_sub")
    publisher = Publisher(session, "m_sub")
    publisher.append(batch(0, 100))
    received = OrderedSubscriber()
    session.subscribe("m_sub", received, offset=0, actionName="reader", throttle=0.1)

    def lag(alias: str) -> float | None:
        return sample(
            metrics_of(cluster, alias), "hastream_subscriber_lag_rows", topic="m_sub/reader"
        )

    wait_until(lambda: received.count() == 100, timeout_s=30, message="subscriber read")
    session.unsubscribe("m_sub", "reader")  # commits its offset, then reads no more
    wait_until(lambda: lag(cluster.leader(GROUP)) == 0, timeout_s=30, message="lag 0")
    publisher.append(batch(100, 300))
    for alias in cluster.nodes:
        wait_until(lambda alias=alias: lag(alias) == 300, timeout_s=30, message=f"{alias} lag")


# --- health --------------------------------------------------------------------------------


def test_grpc_health_says_serving_only_while_leaders_are_known(
    cluster: LocalCluster, session: Session, sites: str
) -> None:
    for site in sites.split(","):
        # The node's watch loop sets the status every _WATCH_S: a cluster this test is the
        # first of its module to use may not have said SERVING yet.
        wait_until(
            lambda site=site: session.checkHealth(site) == "SERVING",
            timeout_s=30,
            message=f"{site} serving",
        )
    alone, *others = sorted(cluster.nodes)
    alone_site = f"127.0.0.1:{cluster.nodes[alone].port}"
    healthz = f"http://127.0.0.1:{cluster.metrics_ports[alone]}/healthz"
    assert urllib.request.urlopen(healthz, timeout=5).status == 200
    for other in others:
        cluster.signal(other, signal.SIGSTOP)
    try:
        wait_until(
            lambda: session.checkHealth(alone_site) == "NOT_SERVING",
            timeout_s=30,
            message="a node without a majority stops serving",
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(healthz, timeout=5)
        assert refused.value.code == 503
    finally:
        for other in others:
            cluster.signal(other, signal.SIGCONT)
    wait_until(
        lambda: all(session.checkHealth(site) == "SERVING" for site in sites.split(",")),
        timeout_s=30,
        message="serving again",
    )


# --- leadership ----------------------------------------------------------------------------


def test_leadership_transfer_under_publish_load_fails_no_publish(
    cluster: LocalCluster, session: Session, sites: str, record_property: object
) -> None:
    create(session, "m_transfer")
    publisher = SteadyPublisher(session, "m_transfer").start()
    transfers_ms: list[float] = []
    try:
        for round_number in range(4):
            wait_until(
                lambda n=round_number: len(publisher.acked) >= (n + 1) * 200,
                timeout_s=30,
                message="publishing between transfers",
            )
            before = cluster.leader(GROUP)
            started = time.monotonic()
            if round_number == 3:  # the command reports the transfer's own duration
                transfers_ms.append(run_cli("transfer-leader", "2", "--sites", sites)["ms"])
            else:
                session.transferLeadership(GROUP)
                transfers_ms.append((time.monotonic() - started) * 1000)
            assert cluster.leader(GROUP) != before
        wait_until(lambda: len(publisher.acked) >= 1000, timeout_s=30, message="after")
    finally:
        publisher.stop()
    assert publisher.failures == []
    gap = publisher.longest_gap_s
    print(f"\ntransfers ms={[round(ms) for ms in transfers_ms]} longest ack gap={gap:.3f}s")
    record_property("longest_ack_gap_s", round(gap, 3))  # type: ignore[operator]
    assert gap < STALL_MAX_S
    wait_replicas_settled(cluster, "m_transfer")
    assert_replicas_hold_exactly(cluster, "m_transfer", publisher.acked)


def test_sigterm_on_the_leader_hands_leadership_over_first(
    cluster: LocalCluster, session: Session, record_property: object
) -> None:
    create(session, "m_term")
    publisher = SteadyPublisher(session, "m_term").start()
    try:
        wait_until(lambda: len(publisher.acked) >= 200, timeout_s=30, message="load running")
        leader = cluster.leader(GROUP)
        stopped_at = time.monotonic()
        cluster.signal(leader, signal.SIGTERM)
        process = cluster.nodes[leader].process
        assert process is not None
        assert process.wait(timeout=30) == 0
        wait_until(lambda: len(publisher.acked) >= 600, timeout_s=30, message="after stop")
        gap = publisher.gaps_since(stopped_at - 1.0)
        cluster.start_node(leader)
    finally:
        publisher.stop()
    log = cluster.log_tail(leader, lines=400)
    assert f"handed over group={GROUP}" in log
    assert publisher.failures == []
    print(f"\nSIGTERM of the leader: longest ack gap={gap:.3f}s")
    record_property("sigterm_longest_ack_gap_s", round(gap, 3))  # type: ignore[operator]
    assert gap < STALL_MAX_S
    wait_replicas_settled(cluster, "m_term")
    assert_replicas_hold_exactly(cluster, "m_term", publisher.acked)


def test_preferred_leader_takes_its_group_back(cluster: LocalCluster, session: Session) -> None:
    wait_until(
        lambda: cluster.leader(PREFERRED_GROUP) == "node1",
        timeout_s=60,
        message="node1 leads its preferred group",
    )
    moved = session.transferLeadership(PREFERRED_GROUP, "node2")
    assert moved.endswith(":node2")
    started = time.monotonic()
    wait_until(
        lambda: cluster.leader(PREFERRED_GROUP) == "node1",
        timeout_s=30,
        message="leadership moved back to node1",
    )
    # It waits until node1 has been a settled, caught-up follower for a while.
    assert time.monotonic() - started >= 3.0


# --- the status page -----------------------------------------------------------------------


def chromium_or_skip() -> str:
    """Debian's chromium, installed by tests/browser/install_chromium.sh when missing."""
    found = shutil.which("chromium")
    if found is None:
        script = REPO / "tests" / "browser" / "install_chromium.sh"
        result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900)
        found = shutil.which("chromium")
        if found is None:
            pytest.skip(f"chromium cannot be installed here: {result.stderr.strip()[-300:]}")
    return found


def headless(chromium: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--disable-dev-shm-usage",
        "--user-data-dir=/tmp/hastream-chromium",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_status_page_renders_and_refreshes_in_a_headless_browser(
    cluster: LocalCluster, session: Session, tmp_path: Path
) -> None:
    chromium = chromium_or_skip()
    create(session, "page_ticks")
    Publisher(session, "page_ticks").append(batch(0, 500))
    session.commit_offset("page_ticks", "dashboard", 399)
    url = f"http://127.0.0.1:{cluster.metrics_ports['node1']}/"
    # Virtual time runs the page's 2 s refresh timer several times: the script fetches the
    # fragment and stamps the time it refreshed.
    dom = headless(chromium, "--virtual-time-budget=7000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    assert "hastream node node1" in page
    assert "page_ticks" in page
    assert "page_ticks/dashboard" in page
    assert "serving" in page
    assert "healthy" in page
    assert "refreshed " in page, "the page's script refreshed it"
    shot = tmp_path / "status-page.png"
    taken = headless(chromium, "--window-size=1100,900", f"--screenshot={shot}", url)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
