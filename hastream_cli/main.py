"""The `hastream` command (click). Each command: connect, one or a few client calls, print.

Exit codes: 0 done; 1 the cluster refused or could not be reached (the error is printed,
as JSON `{"error": ..., "message": ...}` with --json); 2 bad usage.
"""

from __future__ import annotations

import functools
import os
import queue
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

import click
import pyarrow as pa

from api_clients import Session, Subscription, TransportError
from deploy import local, local_security, rolling
from deploy.docker import tool
from deploy.docker.deployment import client_tls as docker_client_tls
from deploy.docker.deployment import load as load_deployment
from hastream import wire
from hastream.errors import ConfigError, RaftStoreError, TopicNotFound
from hastream.tls import ClientTls
from hastream_cli import render
from hastream_cli.since import since_ms

SITES_DEFAULT: Final = "127.0.0.1:8901,127.0.0.1:8902,127.0.0.1:8903"
CONFIG_DEFAULT: Final = "cluster.cfg"
# What `deploy.local up` started the nodes with (TLS, logins): preferred when present.
EFFECTIVE_CONFIG_DEFAULT: Final = ".run/cluster.cfg"
F = TypeVar("F", bound=Callable[..., Any])


class Context:
    """What every command gets from the common options."""

    def __init__(
        self,
        sites: list[str],
        config_path: str | None,
        as_json: bool,
        deadline_s: float,
        user: str | None,
        password: str | None,
        tls: ClientTls | None = None,
    ) -> None:
        self.sites = sites
        self.tls = tls
        self.config_path = config_path
        self.as_json = as_json
        self.deadline_s = deadline_s
        self.user = user
        self.password = password

    def session(self) -> Session:
        return Session(
            self.sites,
            userid=self.user,
            password=self.password,
            deadline_s=self.deadline_s,
            tls=self.tls,
        )

    def emit(self, document: Any, text: str) -> None:
        click.echo(render.to_json(document) if self.as_json else text)


def resolve_sites(sites: str | None, config_path: str | None) -> list[str]:
    """--sites, else the client sites (advertised addresses) of --config, else the default
    cluster.cfg here, else 127.0.0.1:8901..8903."""
    if sites:
        return [site.strip() for site in sites.split(",") if site.strip()]
    path = config_path or _default_config()
    if path is None:
        return SITES_DEFAULT.split(",")
    return rolling.client_sites(path)


def _default_config() -> str | None:
    """`.run/cluster.cfg` (written by deploy.local up), else `./cluster.cfg`, else None."""
    for path in (EFFECTIVE_CONFIG_DEFAULT, CONFIG_DEFAULT):
        if Path(path).exists():
            return path
    return None


def common(command: F) -> F:
    """The options every command takes, turned into a `Context` argument `ctx`."""

    @click.option(
        "--sites",
        envvar="HASTREAM_SITES",
        help="host:port[,host:port...] of nodes "
        "(default: HASTREAM_SITES, else the sites of --config)",
    )
    @click.option(
        "--config",
        "config_path",
        envvar="HASTREAM_CONFIG",
        type=click.Path(),
        help="cluster.cfg to take the sites from (default: ./cluster.cfg)",
    )
    @click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
    @click.option(
        "--timeout",
        "deadline_s",
        type=float,
        default=30.0,
        show_default=True,
        help="seconds a call may take, retries included",
    )
    @click.option("--user", envvar="HASTREAM_USER", default=None, help="user name")
    @click.option("--password", envvar="HASTREAM_PASSWORD", default=None, help="password")
    @click.option("--tls", is_flag=True, envvar="HASTREAM_TLS", help="connect over TLS")
    @click.option(
        "--ca-file",
        envvar="HASTREAM_CA_FILE",
        help="PEM of the CA that signed the nodes' certificates (implies --tls)",
    )
    @click.option(
        "--cert-file",
        envvar="HASTREAM_CERT_FILE",
        help="this client's certificate, for tlsClientAuth=require (implies --tls)",
    )
    @click.option("--key-file", envvar="HASTREAM_KEY_FILE", help="the key of --cert-file")
    @functools.wraps(command)
    def wrapper(
        sites: str | None,
        config_path: str | None,
        as_json: bool,
        deadline_s: float,
        user: str | None,
        password: str | None,
        tls: bool,
        ca_file: str | None,
        cert_file: str | None,
        key_file: str | None,
        **kwargs: Any,
    ) -> Any:
        try:
            wants_tls = tls or any(path is not None for path in (ca_file, cert_file, key_file))
            client_tls = ClientTls(ca_file, cert_file, key_file) if wants_tls else None
            config_path = config_path or _default_config()
            if config_path is not None and not sites:
                # The cluster's own cfg says how to reach it: its CA and its first admin.
                from_config, login = local_security.client_settings(config_path)
                client_tls = client_tls or from_config
                if user is None and login is not None:
                    user, password = login
            context = Context(
                resolve_sites(sites, config_path),
                config_path,
                as_json,
                deadline_s,
                user,
                password,
                client_tls,
            )
            return command(context, **kwargs)
        except ConfigError as error:
            raise click.UsageError(str(error)) from None
        except (RaftStoreError, TransportError, rolling.RollingRestartError) as error:
            _fail(as_json, error)

    return wrapper  # type: ignore[return-value]


def _fail(as_json: bool, error: Exception) -> None:
    if as_json:
        click.echo(render.to_json({"error": type(error).__name__, "message": str(error)}))
    else:
        click.echo(f"error: {error}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def cli() -> None:
    """Operate a hastream cluster: leaders, tables, offsets, status, restarts.

    \b
    Sites come from --sites, HASTREAM_SITES, or the cluster.cfg of --config (default
    ./cluster.cfg); --json prints JSON for scripts. `hastream COMMAND --help` shows an
    example of each command.
    """


@cli.command()
@click.argument("group", type=int)
@common
def leader(ctx: Context, group: int) -> None:
    """Print the leader of Raft group GROUP (exit 1 while there is none).

    \b
    Example:
      hastream leader 2 --sites 127.0.0.1:8901,127.0.0.1:8902
      group 2: 127.0.0.1:8902:node2
    """
    with ctx.session() as session:
        found = session.getStreamingLeader(group) or None
    ctx.emit({"group": group, "leader": found}, f"group {group}: {found or 'no leader'}")
    if found is None:
        sys.exit(1)


@cli.command()
@common
def groups(ctx: Context) -> None:
    """List the Raft groups: leader, members and tables.

    \b
    Example:
      hastream groups
      GROUP  LEADER                 MEMBERS              TABLES
      2      127.0.0.1:8902:node2   node1,node2,node3    ticks,quotes
    """
    with ctx.session() as session:
        found = session.getStreamingRaftGroups()
    ctx.emit(found, render.groups_table(found))


@cli.command()
@common
def stat(ctx: Context) -> None:
    """Streaming statistics of one node: tables, subscriptions (lag), groups.

    \b
    Example:
      hastream stat --sites 127.0.0.1:8901
    """
    with ctx.session() as session:
        document = session.getStreamingStat()
    ctx.emit(document, render.stat_text(document))


@cli.command()
@common
def tables(ctx: Context) -> None:
    """List the HA tables of every group: rows, key column, cache, retention, schema.

    \b
    Example:
      hastream tables --json | jq '.[] | {table, rows}'
    """
    with ctx.session() as session:
        names = [name for group in session.getStreamingRaftGroups() for name in group["tables"]]
        infos = [render.table_info_json(session.getTableInfo(name)) for name in sorted(names)]
    ctx.emit(infos, render.tables_table(infos))


def parse_schema(text: str) -> pa.Schema:
    """`name:type,...` with Arrow type names: int64, float64, string, bool,
    timestamp[ms], date32, ..."""
    fields = []
    for item in text.split(","):
        name, separator, type_name = item.strip().partition(":")
        if not separator or not name:
            raise click.BadParameter(f"{item.strip()!r} is not name:type", param_hint="--schema")
        try:
            fields.append(pa.field(name.strip(), pa.type_for_alias(type_name.strip())))
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--schema") from None
    return pa.schema(fields)


@cli.command()
@click.argument("table")
@click.option("--group", type=int, required=True, help="Raft group (>= 2); 0: a non-HA table")
@click.option("--schema", "schema_text", required=True, help="name:type,... (Arrow type names)")
@click.option(
    "--key", "key_column", default=None, help="key column: rows with a recent key are dropped"
)
@click.option("--cache-limit", type=int, default=100_000, show_default=True, help="rows in memory")
@click.option("--retention-minutes", type=int, default=1440, show_default=True)
@common
def create(
    ctx: Context,
    table: str,
    group: int,
    schema_text: str,
    key_column: str | None,
    cache_limit: int,
    retention_minutes: int,
) -> None:
    """Create stream table TABLE in a Raft group.

    \b
    Example:
      hastream create ticks --group 2 --schema id:int64,ts:timestamp[ms],price:float64 --key id
    """
    schema = parse_schema(schema_text)
    with ctx.session() as session:
        if group == 0:
            info = session.createStreamTable(
                schema, table, cache_limit, key_column, retention_minutes
            )
        else:
            info = session.haStreamTable(
                group, schema, table, cache_limit, key_column, retention_minutes
            )
    ctx.emit(render.table_info_json(info), f"created {table} in group {info.raft_group}")


@cli.command()
@click.argument("table")
@click.option("--force", is_flag=True, help="drop even while it has subscribers")
@common
def drop(ctx: Context, table: str, force: bool) -> None:
    """Drop stream table TABLE and its files on every replica.

    \b
    Example:
      hastream drop ticks --force
    """
    with ctx.session() as session:
        session.dropStreamTable(table, force=force)
    ctx.emit({"dropped": table}, f"dropped {table}")


def _offset_entry(topic: str, offset: int, rows: int) -> dict[str, Any]:
    return {"topic": topic, "offset": offset, "rows": rows, "lag": max(0, rows - 1 - offset)}


@cli.command()
@click.argument("topic")
@common
def offsets(ctx: Context, topic: str) -> None:
    """Persisted offsets and lag of TOPIC (table/actionName), or of every topic of a table.

    Lag is the rows published after the persisted (last processed) offset.

    \b
    Example:
      hastream offsets ticks            # every subscriber of ticks
      hastream offsets ticks/spark      # one topic
    """
    with ctx.session() as session:
        table = topic.rpartition("/")[0] if "/" in topic else topic
        rows = session.getTableInfo(table).row_count
        if "/" in topic:
            found = {topic: session.getTopicProcessedOffset(topic)}
        else:
            found = {
                name: int(offset)
                for name, offset in session.getStreamingStat().get("topics", {}).items()
                if name.rpartition("/")[0] == table
            }
    entries = [_offset_entry(name, offset, rows) for name, offset in sorted(found.items())]
    ctx.emit(entries, render.offsets_table(entries))


@cli.command("remove-offset")
@click.argument("topic")
@common
def remove_offset(ctx: Context, topic: str) -> None:
    """Forget the persisted offset of TOPIC (table/actionName).

    \b
    Example:
      hastream remove-offset ticks/spark
    """
    with ctx.session() as session:
        try:
            session.getTopicProcessedOffset(topic)
        except TopicNotFound:
            ctx.emit({"removed": None, "topic": topic}, f"{topic} has no persisted offset")
            return
        session.removeTopicOffset(topic)
    ctx.emit({"removed": topic}, f"removed the persisted offset of {topic}")


@cli.command("transfer-leader")
@click.argument("group", type=int)
@click.option("--to", "to_node", default=None, help="node alias (default: any caught-up follower)")
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=wire.TRANSFER_TIMEOUT_S_DEFAULT,
    show_default=True,
    help="seconds the leader tries before it gives up",
)
@common
def transfer_leader(ctx: Context, group: int, to_node: str | None, wait_s: float) -> None:
    """Hand Raft group GROUP's leadership to another node (Raft TimeoutNow).

    Writes pause for a round trip and one election; clients retry them at the new leader.

    \b
    Example:
      hastream transfer-leader 2 --to node3
      group 2: leader node1 -> node3 in 21 ms
    """
    with ctx.session() as session:
        before = session.getStreamingLeader(group) or None
        started = time.monotonic()
        after = session.transferLeadership(group, to_node, timeout_s=wait_s)
        elapsed_ms = (time.monotonic() - started) * 1000
    document = {"group": group, "from": before, "to": after, "ms": round(elapsed_ms, 1)}
    text = (
        f"group {group}: leader {render.alias_of(before) or 'none'} -> "
        f"{render.alias_of(after)} in {elapsed_ms:.0f} ms"
    )
    ctx.emit(document, text)


@cli.command()
@common
def status(ctx: Context) -> None:
    """Every node: gRPC health, readiness, and per group its role, term and indexes.

    Exit 1 unless every node answers SERVING.

    \b
    Example:
      hastream status --config cluster.cfg
    """
    nodes = []
    with ctx.session() as session:
        for site in ctx.sites:
            entry: dict[str, Any] = {"site": site, "health": session.checkHealth(site)}
            try:
                entry["status"] = session.getNodeStatus(site)
            except (RaftStoreError, TransportError) as error:
                entry["status"], entry["error"] = None, str(error)
            nodes.append(entry)
    ctx.emit(nodes, render.status_text(nodes))
    if any(node["health"] != "SERVING" for node in nodes):
        sys.exit(1)


@cli.command()
@click.argument("table")
@click.option(
    "--from",
    "offset",
    type=int,
    default=-1,
    show_default=True,
    help="first offset; -1 new rows only, -3 the earliest retained",
)
@click.option(
    "--since",
    default=None,
    help="start at the first row stamped at or after this time: 5m, 2h, 1d ago, an ISO "
    "8601 time (UTC unless it says) or ms since the epoch; instead of --from",
)
@click.option("--limit", type=int, default=0, help="stop after this many rows (0: never)")
@click.option("--action", default=None, help="action name (default: hastream-tail-<pid>)")
@common
def tail(
    ctx: Context, table: str, offset: int, since: str | None, limit: int, action: str | None
) -> None:
    """Print the rows of TABLE as they are published (Ctrl-C stops).

    Follows the leader; persists no offset. With --json, one JSON object per row.

    \b
    Example:
      hastream tail ticks --from 0 --limit 10
      hastream tail ticks --since 5m
    """
    start_ms = None
    if since is not None:
        if offset != -1:
            raise click.UsageError("give --from or --since, not both")
        try:
            start_ms = since_ms(since, time.time_ns() // 1_000_000)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--since") from None
    batches: queue.Queue[tuple[pa.Table, int]] = queue.Queue(maxsize=64)
    action_name = action or f"hastream-tail-{os.getpid()}"
    with ctx.session() as session:
        subscription = session.subscribe(
            table,
            lambda data, first: batches.put((data, first)),
            offset=offset,
            actionName=action_name,
            persistOffset=False,
            startTime=start_ms,
        )
        try:
            for line in _tail_lines(batches, subscription, limit, ctx.as_json):
                click.echo(line)
        except KeyboardInterrupt:
            pass
        finally:
            subscription.stop()


def _tail_lines(
    batches: queue.Queue[tuple[pa.Table, int]],
    subscription: Subscription,
    limit: int,
    as_json: bool,
) -> Iterator[str]:
    printed = 0
    while limit == 0 or printed < limit:  # until the limit, Ctrl-C or a failed subscription
        try:
            data, first = batches.get(timeout=0.5)
        except queue.Empty:
            if subscription.is_alive():
                continue
            error = subscription.error
            if isinstance(error, RaftStoreError):
                raise error from None
            raise RaftStoreError(f"the subscription ended: {error}") from None
        if limit:
            data = data.slice(0, limit - printed)
        lines = (
            render.rows_json(data, first)
            if as_json
            else render.rows_text(data, first, header=printed == 0)
        )
        yield from lines
        printed += data.num_rows


@cli.command("rolling-restart")
@click.option("--docker", is_flag=True, help="restart the containers of deploy.docker.tool")
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    default=Path(".run"),
    show_default=True,
    help="local processes: deploy.local's pid and log files",
)
@click.option("--name", default="hastream", show_default=True, help="docker: deployment name")
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path),
    default=Path(".run/docker"),
    show_default=True,
    help="docker: deployment state",
)
@click.option(
    "--order", default=None, help="node aliases in restart order (default: followers first)"
)
@common
def rolling_restart(
    ctx: Context, docker: bool, run_dir: Path, name: str, state_dir: Path, order: str | None
) -> None:
    """Restart every node, one at a time, without stopping writes.

    For each node: hand the groups it leads to a caught-up follower, restart it, wait until
    it has replayed, caught up and is SERVING; then the next. Local processes are those
    `python -m deploy.local up` started (--config, --run-dir); --docker restarts the
    containers of `python -m deploy.docker.tool up` (--name, --state-dir).

    \b
    Example:
      hastream rolling-restart --config cluster.cfg --run-dir .run
      node3: restarted and serving in 2.1 s
      node1: handed over group 2 -> 127.0.0.1:8903:node3 in 24 ms; restarted and ...
    """
    control = _control(ctx, docker, run_dir, name, state_dir)
    tls = ctx.tls
    if docker and tls is None:  # the deployment's own CA
        deployment = load_deployment(name, state_dir.absolute())
        tls = None if deployment is None else docker_client_tls(deployment)
    steps = []
    with Session(
        rolling.sites_of(control),
        deadline_s=ctx.deadline_s,
        tls=tls,
        userid=ctx.user,
        password=ctx.password,
    ) as session:

        def report(step: rolling.RestartStep) -> None:
            steps.append(step)
            if not ctx.as_json:
                click.echo(rolling.describe(step))

        aliases = None if order is None else [a.strip() for a in order.split(",")]
        rolling.rolling_restart(session, control, order=aliases, report=report)
    document = [
        {
            "node": s.alias,
            "handed_over": s.handed_over,
            "transfer_s": s.transfer_s,
            "restart_s": s.restart_s,
        }
        for s in steps
    ]
    ctx.emit(document, "rolling restart done")


def _control(
    ctx: Context, docker: bool, run_dir: Path, name: str, state_dir: Path
) -> rolling.NodeControl:
    if docker:
        return _docker_control(name, state_dir)
    return local.local_nodes(ctx.config_path or CONFIG_DEFAULT, run_dir)


def _docker_control(name: str, state_dir: Path) -> rolling.NodeControl:
    import docker  # the Docker SDK only for --docker

    deployment = load_deployment(name, state_dir.absolute())
    if deployment is None:
        raise rolling.RollingRestartError(f"no docker deployment {name!r} in {state_dir}")
    return tool.DockerNodes(docker.from_env(), deployment)


def main() -> None:
    """Console entry point (`hastream`, `python -m hastream_cli`)."""
    cli(prog_name="hastream")
