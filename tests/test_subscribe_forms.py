"""subscribe() takes DolphinDB's forms, a one-argument handler and a list filter, and
checks everything before it returns: a wrong handler, filter or table fails at the call,
never later in the background."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from api_clients import Session
from api_clients.publisher import Publisher
from api_clients.subscriber import subscription_filter, subscription_handler
from api_clients.types import TableInfo
from hastream.errors import InvalidArgument, TableNotFound
from tests.harness import LocalCluster, wait_until

SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string())])


def _info(key_column: str | None) -> TableInfo:
    return TableInfo(
        table="t",
        raft_group=2,
        schema=SCHEMA,
        cache_limit=1,
        key_column=key_column,
        retention_minutes=1,
        row_count=0,
        earliest_offset=0,
    )


@pytest.mark.unit
def test_handlers_of_one_or_two_arguments_are_accepted_and_others_refused() -> None:
    seen: list[Any] = []
    subscription_handler(lambda msg: seen.append(("one", msg)))("m", 5)
    subscription_handler(lambda msg, first: seen.append(("two", msg, first)))("m", 5)
    subscription_handler(lambda *args: seen.append(("var", args)))("m", 5)

    class Handler:
        def __call__(self, msg: Any) -> None:
            seen.append(("method", msg))

    subscription_handler(Handler())("m", 5)
    assert seen == [("one", "m"), ("two", "m", 5), ("var", ("m", 5)), ("method", "m")]
    for wrong in (lambda: None, lambda a, b, c: None, "not callable"):
        with pytest.raises(InvalidArgument, match="handler"):
            subscription_handler(wrong)


@pytest.mark.unit
def test_a_list_filter_keeps_rows_by_key_and_bad_filters_are_refused() -> None:
    keep = subscription_filter([2, 4], _info("id"))
    assert keep is not None
    table = pa.table({"id": [1, 2, 3, 4], "sym": list("abcd")}, schema=SCHEMA)
    assert table.filter(keep(table)).column("id").to_pylist() == [2, 4]
    with pytest.raises(InvalidArgument, match="has none"):
        subscription_filter([1], _info(None))
    with pytest.raises(InvalidArgument, match="int64"):
        subscription_filter(["x"], _info("id"))
    with pytest.raises(InvalidArgument, match="callable"):
        subscription_filter(42, _info("id"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("forms") / "cluster")
    yield cluster.start()
    cluster.stop()


@pytest.mark.cluster
def test_dolphindb_forms_deliver_and_wrong_calls_fail_at_once(cluster: LocalCluster) -> None:
    sites = [node.site for node in cluster.nodes.values()]
    with Session(sites, deadline_s=10) as session:
        session.haStreamTable(2, SCHEMA, "forms", 10_000, keyColumn="id")
        with pytest.raises(TableNotFound):
            session.subscribe("no_such_table", lambda msg: None)
        with pytest.raises(InvalidArgument, match="handler"):
            session.subscribe("forms", lambda: None)
        with pytest.raises(InvalidArgument, match="filter"):
            session.subscribe("forms", lambda msg: None, filter=["not an int"])
        got: list[int] = []
        done = threading.Event()

        def handler(msg: pa.Table) -> None:  # DolphinDB's one-argument form
            got.extend(msg.column("id").to_pylist())
            if 7 in got:
                done.set()

        subscription = session.subscribe(
            "forms",
            handler,
            offset=0,
            actionName="dolphin",
            filter=[3, 7],
            persistOffset=False,
            resub=True,
        )
        assert session.getSubscriptionTopics() == ["forms/dolphin"]
        Publisher(session, "forms").append(
            pa.table({"id": range(10), "sym": ["s"] * 10}, schema=SCHEMA)
        )
        wait_until(done.is_set, timeout_s=30, message="filtered rows delivered")
        assert got == [3, 7]
        assert subscription.error is None
        assert subscription.is_alive()
        session.unsubscribe("forms", "dolphin")
        assert session.getSubscriptionTopics() == []
