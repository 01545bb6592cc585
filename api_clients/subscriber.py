"""A background subscription to one topic (`table/actionName`) that follows the leader.

Delivery is at-least-once: the handler sees every row from the start offset on, in offset
order, and may see a row again after a reconnect or a restart (resume is from the last
*processed* offset, which is only advanced after the handler returns). With a key column on
the consumer side (an upsert keyed on it, or a sink keyed on the table's key) the end result
is exactly-once. Within one Subscription, rows at or below the processed offset are never
handed to the handler twice, even if a new leader resends them.

Threads: one worker thread per subscription runs the handler, the filter and offset commits;
one reader thread per open stream decodes messages into a small bounded queue, so the
worker can flush on `throttle` even while the stream is idle.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, cast

import pyarrow as pa
import pyarrow.compute as pc

from api_clients import batches
from api_clients.call_policy import untried_site
from api_clients.hedge import LeaderWatch
from api_clients.transport import Stream, StreamBroken, StreamIdle, Unresponsive
from api_clients.types import Filter, Handler, StreamOpener, TableInfo
from hastream import wire
from hastream.errors import InvalidArgument, RaftStoreError, TableNotFound
from hastream.model import OFFSET_EARLIEST, OFFSET_LATEST, topic_name
from proto import hastream_pb2

log = logging.getLogger(__name__)

# Decoded messages waiting for the worker, per stream (each at most
# SUBSCRIBE_BATCH_BYTES_MAX): the reader blocks when the handler is slower than the stream.
QUEUE_MESSAGES_MAX: Final = 4
# Rows buffered for one handler call are flushed early beyond this many bytes.
PENDING_BYTES_MAX: Final = 64 * wire.MIB
BATCH_SIZE_MAX: Final = wire.BATCH_ROWS_MAX
# How often the worker looks at the stop flag and the throttle timer while idle.
POLL_S: Final = 0.1
# Without any message received for this long, a reconnecting subscription gives up.
RECONNECT_DEADLINE_S_DEFAULT: Final = 600.0
COMMIT_DEADLINE_S: Final = 5.0
READER_JOIN_TIMEOUT_S: Final = 5.0
# A leader sends an empty message every SUBSCRIBE_HEARTBEAT_S (1 s) on an idle stream: this
# long without any message means the node is frozen, cut off or overloaded past use, and the
# subscription moves on (the next site, or the leader it names) instead of waiting for TCP.
STREAM_IDLE_TIMEOUT_S: Final = 6 * wire.SUBSCRIBE_HEARTBEAT_S
# Sooner than that, silence past one and a half heartbeats asks the other sites who leads
# (the session's `LeaderWatch`), and the subscription moves as soon as they agree on another
# leader: a cut-off or frozen leader is left about when its followers have elected a new
# one. STREAM_IDLE_TIMEOUT_S stays the backstop when they cannot say (the client is the
# one cut off, say).
SILENCE_HEDGE_DELAY_S: Final = 1.5 * wire.SUBSCRIBE_HEARTBEAT_S
STOP_TIMEOUT_S_DEFAULT: Final = 30.0


@dataclass(frozen=True, slots=True)
class _Message:
    first_offset: int
    table: pa.Table
    table_row_count: int


@dataclass(frozen=True, slots=True)
class _End:
    """The stream ended: normally (error None), with its typed failure, or with bad bytes."""

    error: RaftStoreError | None


_Item = _Message | _End


def _decode(message: hastream_pb2.RowBatch) -> _Message:
    table = batches.decode(message.payload) if message.row_count else pa.table({})
    if table.num_rows != message.row_count:
        raise InvalidArgument(
            "payload", f"row_count={message.row_count} but the payload holds {table.num_rows}"
        )
    return _Message(message.first_offset, table, message.table_row_count)


class _StreamReader(threading.Thread):
    """Iterates one server stream, decoding each message into `items`; ends with an `_End`."""

    def __init__(self, call: Stream, items: queue.Queue[_Item], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._call = call
        self._items = items
        self._closed = threading.Event()

    def close(self) -> None:
        """The consumer left: drop whatever comes next."""
        self._closed.set()

    def run(self) -> None:
        end = _End(None)
        try:
            for message in self._call:
                if not self._put(_decode(message)):
                    return
        except RaftStoreError as error:  # typed by the stream, or InvalidArgument (_decode)
            end = _End(error)
        self._put(end)

    def _put(self, item: _Item) -> bool:
        while not self._closed.is_set():  # Bounded: the consumer closes the reader on leaving.
            try:
                self._items.put(item, timeout=POLL_S)
            except queue.Full:
                continue
            return True
        return False


def subscription_handler(handler: Any) -> Handler:
    """`handler` as the subscriber calls it, `(message, first_offset)`: a one-argument
    handler (DolphinDB's `handler(msg)`) is wrapped. Raises InvalidArgument for anything
    that takes neither form."""
    if not callable(handler):
        raise InvalidArgument("handler", f"must be callable, got {type(handler).__name__}")
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return cast(Handler, handler)  # a builtin without a signature: trust the caller
    for arguments in ((None, 0), (None,)):
        try:
            signature.bind(*arguments)
        except TypeError:
            continue
        if len(arguments) == 2:
            return cast(Handler, handler)
        return lambda message, first_offset: handler(message)
    raise InvalidArgument("handler", f"must take (msg) or (msg, first_offset), not {signature}")


def subscription_filter(filter: Any, info: TableInfo) -> Filter | None:
    """`filter` as the subscriber calls it: a callable as given; a list, tuple or set of
    values (DolphinDB's list filter) keeps the rows whose key column is one of them.
    Raises InvalidArgument (a list filter on a table without a key column, values of the
    wrong type, anything else)."""
    if filter is None or callable(filter):
        return cast("Filter | None", filter)
    if not isinstance(filter, list | tuple | set | frozenset):
        raise InvalidArgument(
            "filter", f"must be a callable or a list of key values, not {type(filter).__name__}"
        )
    key = info.key_column
    if key is None:
        raise InvalidArgument(
            "filter",
            f"a list filter keeps rows by the key column, and table {info.table} has none; "
            "pass a callable",
        )
    key_type = info.schema.field(key).type
    try:
        values = pa.array(list(filter), type=key_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as error:
        raise InvalidArgument("filter", f"values are not {key_type} ({key}): {error}") from None

    def keep(table: pa.Table) -> pa.Array | pa.ChunkedArray:
        return pc.is_in(table.column(key), value_set=values)

    return keep


class Subscription:
    """One topic's subscription; created and started by `Session.subscribe`.

    Offsets: `offset` is where to start (-1 only new rows, 0 the first row, N that row, -2
    after the topic's persisted offset, -3 the earliest retained row). On a stream end,
    NotLeader or any retryable error (with `reconnect`), it resubscribes after a backoff, to
    the named leader or else the next site, from the last processed offset + 1 (or from the
    start it was given, if nothing was processed yet). A stream silent for
    SILENCE_HEDGE_DELAY_S while the other sites agree on another leader ends as
    `Unresponsive` and moves there; one silent for STREAM_IDLE_TIMEOUT_S ends as
    `StreamIdle` and moves on. A non-retryable error, an exception
    from the handler or filter, or `reconnect_deadline_s` without a message ends it, with the
    reason in `.error`. With `persist_offset`, the processed offset is committed to the
    cluster at most every `throttle_s` seconds and once more when it stops.
    """

    def __init__(
        self,
        session: StreamOpener,
        table: str,
        handler: Handler,
        *,
        offset: int = OFFSET_LATEST,
        action_name: str = "default",
        batch_size: int = 0,
        throttle_s: float = 1.0,
        filter: Filter | None = None,  # DolphinDB's parameter name, shadowing the builtin.
        reconnect: bool = True,
        persist_offset: bool = True,
        msg_as_table: bool = True,
        batch_rows: int = 0,
        reconnect_deadline_s: float = RECONNECT_DEADLINE_S_DEFAULT,
        on_exit: Callable[[Subscription], object] | None = None,
    ) -> None:
        if offset < OFFSET_EARLIEST:
            raise InvalidArgument("offset", f"must be >= {OFFSET_EARLIEST}, got {offset}")
        if not 0 < len(action_name.encode()) <= wire.ACTION_NAME_BYTES_MAX:
            raise InvalidArgument(
                "actionName", f"must be 1..{wire.ACTION_NAME_BYTES_MAX} bytes, got {action_name!r}"
            )
        if not 0 <= batch_size <= BATCH_SIZE_MAX:
            raise InvalidArgument("batchSize", f"must be in [0, {BATCH_SIZE_MAX}]")
        if throttle_s < 0:
            raise InvalidArgument("throttle", f"must be >= 0, got {throttle_s}")
        if reconnect_deadline_s <= 0:
            raise InvalidArgument(
                "reconnect_deadline_s", f"must be > 0, got {reconnect_deadline_s}"
            )
        if not 0 <= batch_rows <= wire.SUBSCRIBE_BATCH_ROWS_MAX:
            raise InvalidArgument("batch_rows", f"must be in [0, {wire.SUBSCRIBE_BATCH_ROWS_MAX}]")
        self._session = session
        self._table = table
        self._action_name = action_name
        self._handler = handler
        self._filter = filter
        self._requested_offset = offset
        self._batch_size = batch_size
        self._throttle_s = throttle_s
        self._reconnect = reconnect
        self._persist_offset = persist_offset
        self._msg_as_table = msg_as_table
        self._batch_rows = batch_rows
        self._reconnect_deadline_s = reconnect_deadline_s
        self._on_exit = on_exit
        self._lock = threading.Lock()  # Guards the fields read by other threads.
        self._stop_event = threading.Event()
        self._processed = -1
        self._committed = -1
        self._table_row_count = -1
        self._connections = 0
        self._error: BaseException | None = None
        self._call: Stream | None = None
        # Worker-thread only: the rows waiting for the next handler call, [first, last].
        self._latest_floor: int | None = None
        self._pending: list[pa.Table] = []
        self._pending_first = -1
        self._pending_last = -1
        self._pending_rows = 0
        self._pending_bytes = 0
        self._pending_since = 0.0
        self._last_commit_at = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"subscribe-{self.topic}", daemon=True
        )

    # -- public state ----------------------------------------------------------------

    @property
    def topic(self) -> str:
        return topic_name(self._table, self._action_name)

    @property
    def processed_offset(self) -> int:
        """Offset of the last row the handler has returned for; -1 before the first."""
        with self._lock:
            return self._processed

    @property
    def committed_offset(self) -> int:
        """Offset last committed to the cluster by this subscription; -1 before the first."""
        with self._lock:
            return self._committed

    @property
    def lag_rows(self) -> int:
        """Rows in the table beyond the processed offset, as of the last message (-1 unknown)."""
        with self._lock:
            if self._table_row_count < 0:
                return -1
            return max(0, self._table_row_count - (self._processed + 1))

    @property
    def connections(self) -> int:
        """How many streams this subscription has opened (1 + reconnects)."""
        with self._lock:
            return self._connections

    @property
    def error(self) -> BaseException | None:
        """Why the subscription ended on its own; None while it runs or after stop()."""
        with self._lock:
            return self._error

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S_DEFAULT) -> None:
        """Stops the subscription: the open stream is cancelled, rows not yet handed to the
        handler are dropped, and the processed offset is committed. Waits up to `timeout_s`
        for the worker (a running handler call finishes first). Callable from the handler."""
        self._stop_event.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.ident is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("subscription did not stop in time topic=%s", self.topic)

    # -- worker thread ---------------------------------------------------------------

    def _run(self) -> None:
        log.info("subscription started topic=%s offset=%d", self.topic, self._requested_offset)
        try:
            self._run_connections()
        except Exception as error:  # The handler's or filter's: end, surfaced via .error.
            log.exception("subscription failed topic=%s", self.topic)
            self._set_error(error)
        finally:
            self._commit(force=True)
            log.info("subscription ended topic=%s processed=%d", self.topic, self.processed_offset)
            if self._on_exit is not None:
                self._on_exit(self)

    def _set_error(self, error: BaseException) -> None:
        with self._lock:
            self._error = error

    def _run_connections(self) -> None:
        backoff = self._session.new_backoff(self._reconnect_deadline_s, sleep=self._stop_event.wait)
        self._resolve_latest_floor()
        site = self._session.route(table=self._table)
        not_found: set[str] = set()  # Sites that answered TableNotFound since the last rows.
        # The subscription's event loop: one stream per turn. It ends on stop, on a
        # non-retryable error, or when the reconnect budget is spent.
        while not self._stop_event.is_set():
            error, received = self._consume(site)
            if self._stop_event.is_set():
                return
            if received:
                not_found.clear()
                backoff = self._session.new_backoff(
                    self._reconnect_deadline_s, sleep=self._stop_event.wait
                )
            if isinstance(error, TableNotFound):
                # A follower that has not applied the table's creation answers this before
                # it looks at leadership: believe it once every known site said so.
                not_found.add(site)
                untried = untried_site(self._session.sites, not_found)
                if untried is not None and self._reconnect:
                    site = untried
                    continue
            reason = error if error is not None else StreamBroken(site, "the stream ended")
            if not reason.retryable or not self._reconnect:
                self._set_error(reason)
                return
            log.info("resubscribing topic=%s site=%s reason=%s", self.topic, site, reason)
            hint = self._session.redirect_target(reason, site)
            self._session.forget_leader(site, table=self._table, group=None)
            if not backoff.wait():
                if not self._stop_event.is_set():
                    self._set_error(reason)
                return
            site = hint if hint is not None else self._next_site(site)

    def _next_site(self, failed: str) -> str:
        routed = self._session.route(table=self._table)
        return routed if routed != failed else self._session.next_site(failed)

    def _resolve_latest_floor(self) -> None:
        """For offset -1: the table's row count now, so a reconnect before the first row
        resumes from here instead of skipping rows appended while disconnected."""
        if self._requested_offset != OFFSET_LATEST:
            return
        try:
            info = self._session.getTableInfo(self._table, deadline_s=COMMIT_DEADLINE_S)
        except RaftStoreError as error:
            log.warning("no row count for offset -1 topic=%s error=%s", self.topic, error)
            return
        self._latest_floor = info.row_count

    def _start_offset(self) -> int:
        with self._lock:
            processed = self._processed
        if processed >= 0:
            return processed + 1
        if self._connections > 0 and self._latest_floor is not None:
            return self._latest_floor
        return self._requested_offset

    def _consume(self, site: str) -> tuple[RaftStoreError | None, bool]:
        """One stream from `site` until it ends. Returns (why it ended, any message seen)."""
        request = hastream_pb2.SubscribeRequest(
            table=self._table,
            action_name=self._action_name,
            offset=self._start_offset(),
            batch_rows=self._batch_rows,
        )
        log.info("subscribing topic=%s site=%s offset=%d", self.topic, site, request.offset)
        items: queue.Queue[_Item] = queue.Queue(maxsize=QUEUE_MESSAGES_MAX)
        watch = self._session.leader_watch(site, table=self._table, delay_s=SILENCE_HEDGE_DELAY_S)
        call = self._session.open_stream(site, "Subscribe", request)
        reader = _StreamReader(call, items, name=f"subscribe-read-{self.topic}")
        with self._lock:
            self._call = call
            self._connections += 1
        if self._stop_event.is_set():
            call.cancel()  # stop() ran before the call was visible to it.
        reader.start()
        try:
            return self._pump(items, site, watch)
        finally:
            if watch is not None:
                watch.close()
            reader.close()
            call.cancel()
            reader.join(READER_JOIN_TIMEOUT_S)
            with self._lock:
                self._call = None

    def _pump(
        self, items: queue.Queue[_Item], site: str, watch: LeaderWatch | None
    ) -> tuple[RaftStoreError | None, bool]:
        received = False
        heard_at = time.monotonic()  # the last message, rows or heartbeat
        while not self._stop_event.is_set():  # Bounded by the stream: its _End returns.
            try:
                item = items.get(timeout=self._poll_timeout_s())
            except queue.Empty:
                self._flush_if_due()
                self._commit()
                silent_s = time.monotonic() - heard_at
                leader = watch.check(silent_s) if watch is not None else None
                if leader is not None:
                    self._flush()
                    log.warning(
                        "no message for %.1fs topic=%s site=%s; the others name leader=%s",
                        silent_s,
                        self.topic,
                        site,
                        leader,
                    )
                    return Unresponsive(site, silent_s, leader), received
                if silent_s > STREAM_IDLE_TIMEOUT_S:
                    self._flush()
                    log.warning("no message for %.1fs topic=%s site=%s", silent_s, self.topic, site)
                    return StreamIdle(site, silent_s, STREAM_IDLE_TIMEOUT_S), received
                continue
            heard_at = time.monotonic()
            if isinstance(item, _End):
                self._flush()
                return item.error, received
            if not received:
                # The node that streams the table leads it: send offset commits there too.
                self._session.remember_leader(site, table=self._table, group=None)
                received = True
            self._add(item)
            self._flush_if_due()
            self._commit()
        return None, received

    def _poll_timeout_s(self) -> float:
        if not self._pending:
            return POLL_S
        due_in_s = self._pending_since + self._throttle_s - time.monotonic()
        return max(0.0, min(POLL_S, due_in_s))

    def _add(self, message: _Message) -> None:
        with self._lock:
            self._table_row_count = max(self._table_row_count, message.table_row_count)
            seen_last = max(self._processed, self._pending_last)
        table = message.table
        first = message.first_offset
        last = first + table.num_rows - 1
        if table.num_rows == 0 or last <= seen_last:
            return  # A heartbeat, or rows already handled (a new leader resent them).
        if first <= seen_last:
            table = table.slice(seen_last + 1 - first)
            first = seen_last + 1
        if seen_last >= 0 and first > seen_last + 1:
            log.warning("offset gap topic=%s expected=%d got=%d", self.topic, seen_last + 1, first)
        if not self._pending:
            self._pending_first = first
            self._pending_since = time.monotonic()
        self._pending.append(table)
        self._pending_last = last
        self._pending_rows += table.num_rows
        self._pending_bytes += table.nbytes

    def _flush_if_due(self) -> None:
        if not self._pending:
            return
        if (
            self._batch_size == 0
            or self._pending_rows >= self._batch_size
            or self._pending_bytes >= PENDING_BYTES_MAX
            or time.monotonic() - self._pending_since >= self._throttle_s
        ):
            self._flush()

    def _flush(self) -> None:
        """Hands the pending rows to the handler, then marks them processed."""
        if not self._pending:
            return
        table = self._pending[0] if len(self._pending) == 1 else pa.concat_tables(self._pending)
        first, last = self._pending_first, self._pending_last
        self._pending = []
        self._pending_rows = 0
        self._pending_bytes = 0
        self._pending_last = -1
        if self._filter is not None:
            table = self._apply_filter(table)
        if table.num_rows > 0:
            self._handler(table if self._msg_as_table else table.to_pylist(), first)
        with self._lock:
            self._processed = last

    def _apply_filter(self, table: pa.Table) -> pa.Table:
        assert self._filter is not None
        kept = self._filter(table)
        if isinstance(kept, pa.Table):
            return kept
        if isinstance(kept, pa.Array | pa.ChunkedArray):
            return table.filter(kept)
        raise TypeError(f"filter must return a pyarrow Table or mask, got {type(kept).__name__}")

    def _commit(self, *, force: bool = False) -> None:
        """Commits the processed offset through Raft, at most every throttle seconds."""
        if not self._persist_offset:
            return
        with self._lock:
            processed, committed = self._processed, self._committed
        if processed < 0 or processed == committed:
            return
        now = time.monotonic()
        if not force and now - self._last_commit_at < self._throttle_s:
            return
        self._last_commit_at = now
        try:
            self._session.commit_offset(
                self._table, self._action_name, processed, deadline_s=COMMIT_DEADLINE_S
            )
        except (RaftStoreError, RuntimeError) as error:  # RuntimeError: the session closed
            # Not fatal: delivery is at-least-once; the next commit carries a later offset.
            log.warning(
                "offset commit failed topic=%s offset=%d error=%s", self.topic, processed, error
            )
            return
        with self._lock:
            self._committed = processed
        log.debug("offset committed topic=%s offset=%d", self.topic, processed)
