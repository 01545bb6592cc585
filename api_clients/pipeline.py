"""Pipelined publishing: up to `max_in_flight` publish requests of one producer in flight on
one PublishStream call, answered in order (Kafka's idempotent producer with
max.in.flight.requests > 1).

Every request keeps its producer id and sequence for life. When the stream fails with a
retryable error (NotLeader, an election, an unreachable node, a timeout) the pipeline opens
a new stream to the leader (the Session's leader following: a NotLeader hint at once, else
the next site after a capped backoff) and resends every unacknowledged request in order with
the same producer id and sequence; the leader answers the ones it already applied from its
producer window (`duplicate_batch`) instead of applying them twice. The server proposes
pipelined requests `contiguous`, so a request after a failed one is refused (SequenceGap)
instead of landing before the failed one's resend: rows land in request order, once.

The server can only detect a gap for a producer it knows, so until this pipeline's first
request is acknowledged, only one request is in flight.

A silent leader (cut off by the network, frozen) answers nothing and resets nothing: a
watchdog thread measures how long the stream has had requests out and no acknowledgement,
and past the session's hedge delay asks the other sites who leads (`hedge.LeaderWatch`);
once they agree on another leader it cancels the stream, which then fails as
`Unresponsive` and reopens there at once, resending as above. HTTP/2 keepalive stays the
backstop when they cannot say.

Failure: when a request fails with a non-retryable error, or retryable errors go on past the
Session's deadline (counted from the last progress), that request's future raises the error
and every later unacknowledged request's future raises `PublishAborted` (none of them was
applied after a non-retryable error; after a deadline their outcome is unknown). The
pipeline then goes on under a fresh random producer id (its sequences restart at 1), so
nothing sent later can be mistaken for, or blocked by, the failed requests. A pipeline
started with `renew=False` (the caller's own producer id, which promises that a re-run
maps the same rows to the same sequences) does not go on: every later `submit` raises
PublishAborted, so no row can be committed under an id a re-run would not repeat.

Threads: `submit`, `flush`, `close` from any thread (one lock). A driver thread owns the
stream (opens it, reads the answers, settles the futures, reconnects); gRPC's own thread
pulls the outgoing messages from `_outgoing`; the watchdog thread only cancels a stream
left for another leader. Futures are completed on the driver thread.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

from api_clients.call_policy import untried_site
from api_clients.hedge import LeaderWatch
from api_clients.retry import Backoff
from api_clients.transport import Stream, StreamBroken, Unresponsive
from api_clients.types import AppendResult, StreamOpener
from hastream import wire
from hastream.errors import BatchTooLarge, InvalidArgument, RaftStoreError, TableNotFound
from proto import hastream_pb2

log = logging.getLogger(__name__)

MAX_IN_FLIGHT_DEFAULT: Final = 64
# How often waiting threads look at the pipeline's state again (they are also notified).
_POLL_S: Final = 0.2
# How often the watchdog looks at an attempt with nothing outstanding.
_WATCH_IDLE_POLL_S: Final = 0.1


class PipelineClosed(RaftStoreError):
    """`close()` ended the pipeline while `pending` requests were still unacknowledged
    after its timeout: their outcome is unknown."""

    def __init__(self, table: str, pending: int) -> None:
        self.table = table
        self.pending = pending
        super().__init__(f"the pipeline of table {table!r} closed with {pending} requests pending")

    def fields(self) -> dict[str, Any]:
        return {"table": self.table, "pending": self.pending}


class PublishAborted(RaftStoreError):
    """A pipelined request was not acknowledged because an earlier request of the same
    pipeline failed (`cause`, the earlier request's `sequence`). After a non-retryable
    `cause` it was not applied; after a deadline its outcome is unknown."""

    def __init__(self, sequence: int, cause: str) -> None:
        self.sequence = sequence
        self.cause = cause
        super().__init__(f"aborted: request {sequence} of this pipeline failed first: {cause}")

    def fields(self) -> dict[str, Any]:
        return {"sequence": self.sequence, "cause": self.cause}


@dataclass(slots=True)
class _Request:
    sequence: int
    payload: bytes
    row_count: int
    future: Future[AppendResult]
    sent_at: float = 0.0  # time.perf_counter() of the first send


@dataclass(slots=True)
class _Attempt:
    """One PublishStream call: how many of the unacknowledged requests (from the head) went
    out on it."""

    site: str
    sent: int = 0
    closed: bool = False
    call: Stream | None = None
    # Since when requests are out on it without an acknowledgement (the first send, or the
    # last acknowledgement while more are out); None: nothing is out.
    waiting_since: float | None = None
    moved: Unresponsive | None = None  # the watchdog left it for another leader


@dataclass(slots=True)
class _Retry:
    """The retry state of the driver between two acknowledgements."""

    backoff: Backoff
    redirected: bool = False
    not_found: set[str] = field(default_factory=set)  # sites that answered TableNotFound
    not_found_error: TableNotFound | None = None
    gave_up: bool = False  # the requests it covered were failed


class PublishPipeline:
    """Pipelined publishing of already validated, encoded payloads to one table.

    `submit` blocks while `max_in_flight` requests (or PIPELINE_IN_FLIGHT_BYTES_MAX payload
    bytes) are unacknowledged. `producer_id` and `first_sequence` start the producer (a
    random id by default)."""

    def __init__(
        self,
        session: StreamOpener,
        table: str,
        *,
        producer_id: bytes | None = None,
        first_sequence: int = 1,
        max_in_flight: int = MAX_IN_FLIGHT_DEFAULT,
        deadline_s: float | None = None,
        renew: bool = True,
    ) -> None:
        if not 1 <= max_in_flight <= wire.PIPELINE_IN_FLIGHT_MAX:
            raise InvalidArgument("max_in_flight", f"must be in [1, {wire.PIPELINE_IN_FLIGHT_MAX}]")
        if producer_id is not None and len(producer_id) != wire.PRODUCER_ID_BYTES:
            raise InvalidArgument("producer_id", f"must be {wire.PRODUCER_ID_BYTES} bytes")
        if first_sequence < 1:
            raise InvalidArgument("first_sequence", f"must be >= 1, got {first_sequence}")
        if deadline_s is not None and deadline_s <= 0:
            raise InvalidArgument("deadline_s", f"must be > 0, got {deadline_s}")
        self._session = session
        self._table = table
        self._max_in_flight = max_in_flight
        self._deadline_s = session.deadline_s if deadline_s is None else deadline_s
        self._condition = threading.Condition()
        self._producer_id = producer_id or secrets.token_bytes(wire.PRODUCER_ID_BYTES)
        self._next_sequence = first_sequence
        self._producer_known = False  # the group acknowledged a request of this producer
        self._renew = renew  # go on under a fresh producer after a failure (module docstring)
        # (sequence, cause) of the failure that ended a pipeline that does not renew.
        self._ended_by: tuple[int, str] | None = None
        self._unacked: collections.deque[_Request] = collections.deque()
        self._unacked_bytes = 0  # payload bytes of `_unacked`
        # Thread -> groups of requests it took off `_unacked` and is completing the futures
        # of (outside the lock): flush waits for them too, except on that thread itself (a
        # future's callback may flush).
        self._settling: dict[int, int] = {}
        self._acked = 0  # requests acknowledged so far (progress, for the retry budget)
        self._closing = False
        self._closed = threading.Event()  # set with _closing: wakes the watchdog
        self._driver: threading.Thread | None = None
        self._current: _Attempt | None = None  # the attempt the watchdog watches
        self.resent_requests = 0
        self.reconnects = 0
        self.messages_sent = 0

    @property
    def table(self) -> str:
        return self._table

    @property
    def producer_id(self) -> bytes:
        with self._condition:
            return self._producer_id

    @property
    def next_sequence(self) -> int:
        with self._condition:
            return self._next_sequence

    def in_flight(self) -> int:
        """Requests submitted and not acknowledged (nor failed) yet."""
        with self._condition:
            return len(self._unacked)

    def stats(self) -> dict[str, int]:
        with self._condition:
            return {
                "in_flight": len(self._unacked),
                "acknowledged": self._acked,
                "reconnects": self.reconnects,
                "resent_requests": self.resent_requests,
                "messages_sent": self.messages_sent,
            }

    def wait_in_flight_below(self, count: int, timeout_s: float) -> bool:
        """Wait until fewer than `count` requests are in flight (or the pipeline ended or
        closes), at most `timeout_s`; whether that is so."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            while len(self._unacked) >= count and not self._closing and self._ended_by is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._condition.wait(timeout=min(left, _POLL_S))
            return True

    def rows_in_flight(self) -> int:
        with self._condition:
            return sum(request.row_count for request in self._unacked)

    # -- callers' threads --------------------------------------------------------------

    def submit(self, payload: bytes, row_count: int) -> Future[AppendResult]:
        """Queue one request (an Arrow IPC stream with the table's schema); its future
        gives the committed offsets. Blocks while the window is full: `max_in_flight`
        requests, or `PIPELINE_IN_FLIGHT_BYTES_MAX` payload bytes (the most a node reads
        ahead on one stream), at most until the pending requests are acknowledged or fail
        at the deadline. Raises BatchTooLarge for a request over the wire's bounds."""
        if len(payload) > wire.BATCH_BYTES_MAX:
            raise BatchTooLarge(len(payload), wire.BATCH_BYTES_MAX)
        if not 1 <= row_count <= wire.BATCH_ROWS_MAX:
            raise InvalidArgument("row_count", f"must be in [1, {wire.BATCH_ROWS_MAX}]")
        future: Future[AppendResult] = Future()
        with self._condition:
            self._check_open()
            while self._window_full(len(payload)):  # bounded: acks or failure
                self._condition.wait(timeout=_POLL_S)
                self._check_open()
            sequence = self._next_sequence
            self._next_sequence += 1
            self._unacked.append(_Request(sequence, payload, row_count, future))
            self._unacked_bytes += len(payload)
            self._condition.notify_all()
            if self._driver is None:
                self._driver = threading.Thread(
                    target=self._drive, name=f"publish-pipeline-{self._table}", daemon=True
                )
                self._driver.start()
                threading.Thread(
                    target=self._watch_attempts,
                    name=f"publish-watchdog-{self._table}",
                    daemon=True,
                ).start()
        return future

    def _check_open(self) -> None:
        """Raise if the pipeline takes no more requests (caller holds the lock)."""
        if self._closing:
            raise InvalidArgument("publisher", "the pipeline is closed")
        if self._ended_by is not None:
            raise PublishAborted(*self._ended_by)

    def _window_full(self, payload_bytes: int) -> bool:
        """Whether one more request must wait (caller holds the lock). A request alone in
        the window always fits."""
        if len(self._unacked) >= self._max_in_flight:
            return True
        return bool(self._unacked) and (
            self._unacked_bytes + payload_bytes > wire.PIPELINE_IN_FLIGHT_BYTES_MAX
        )

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted request is acknowledged or failed; False if
        `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            # Bounded: every request is acked or fails at the deadline, and its future is
            # completed right after (a caller that flushed may look at its futures at once).
            while self._unacked or self._settling_elsewhere():
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._condition.wait(timeout=_POLL_S)
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, then end the stream and the driver thread. Requests still pending after
        `timeout_s` fail (the first with PipelineClosed, the others with PublishAborted)."""
        self.flush(timeout_s)
        with self._condition:
            self._closing = True
            self._closed.set()
            self._condition.notify_all()
            driver = self._driver
        if driver is not None:
            driver.join(timeout=self._deadline_s)
        with self._condition:
            pending = len(self._unacked)
        if pending:
            self._fail_all(PipelineClosed(self._table, pending), renew=False)

    # -- driver thread -----------------------------------------------------------------

    def _drive(self) -> None:
        try:
            self._drive_until_closed()
        except BaseException as error:  # a bug or a closed session: nobody may wait forever
            log.exception("publish pipeline driver failed table=%s", self._table)
            with self._condition:
                self._closing = True
                self._closed.set()
            self._fail_all(error, renew=False)
            raise

    def _drive_until_closed(self) -> None:  # the pipeline's event loop: runs until close()
        site = self._session.route(table=self._table)
        retry: _Retry | None = None
        while self._wait_for_work():
            attempt = _Attempt(site)
            with self._condition:
                self.resent_requests += sum(1 for request in self._unacked if request.sent_at)
                acked_before = self._acked
            error = self._stream(attempt)
            with self._condition:
                attempt.closed = True
                self._condition.notify_all()
                progressed = self._acked > acked_before
            if error is None:
                continue  # ended cleanly: we half-closed (closing), or it reopens
            if retry is None or progressed:  # the retry budget counts from the last progress
                retry = _Retry(self._session.new_backoff(self._deadline_s))
            self.reconnects += 1
            site = self._after_failure(site, error, retry)
            if retry.gave_up:
                # The failed requests are settled; the next ones get a budget of their own
                # (a spent one would fail each of them at once, in a tight loop).
                retry = None

    def _watch_attempts(self) -> None:  # the watchdog's loop: runs until close()
        """Leaves an attempt whose requests go unanswered past the hedge delay once the
        other sites agree on another leader: marks it `moved` and cancels its call."""
        watched: _Attempt | None = None
        watch: LeaderWatch | None = None
        try:
            while not self._closed.is_set():
                with self._condition:
                    attempt = self._current
                    since = None if attempt is None or attempt.closed else attempt.waiting_since
                if attempt is not watched:
                    if watch is not None:
                        watch.close()
                    watched = attempt
                    watch = (
                        None
                        if attempt is None
                        else self._session.leader_watch(attempt.site, table=self._table)
                    )
                if watch is None or attempt is None or since is None:
                    self._closed.wait(_WATCH_IDLE_POLL_S)
                    continue
                waited_s = time.monotonic() - since
                leader = watch.check(waited_s)
                if leader is None:
                    self._closed.wait(watch.poll_s(waited_s))
                    continue
                with self._condition:
                    attempt.moved = Unresponsive(attempt.site, waited_s, leader)
                    call = attempt.call
                if call is not None:
                    call.cancel()
                watch.close()
                watch = None  # this attempt is done for; the next one gets its own watch
        finally:
            if watch is not None:
                watch.close()

    def _wait_for_work(self) -> bool:
        with self._condition:
            while not self._unacked and not self._closing:
                self._condition.wait(timeout=_POLL_S)
            return not self._closing

    def _stream(self, attempt: _Attempt) -> RaftStoreError | None:
        """Run one PublishStream call until it ends; the error that ended it, or None."""
        call = self._session.open_stream(attempt.site, "PublishStream", self._outgoing(attempt))
        with self._condition:
            attempt.call = call
            self._current = attempt
        try:
            for acks in call:
                self._acknowledge(attempt, acks.responses)
        except RaftStoreError as error:  # the call's typed failure, or a broken answer
            call.cancel()  # ends the call after a broken answer; a no-op on a failed one
            with self._condition:
                return attempt.moved or error
        with self._condition:
            if attempt.moved is not None:
                return attempt.moved
            if self._unacked and not self._closing:
                return StreamBroken(attempt.site, "the stream ended with requests unanswered")
        return None

    def _outgoing(self, attempt: _Attempt) -> Iterator[hastream_pb2.PublishBatch]:
        """The messages of one call (gRPC's thread): every unsent request that fits, packed;
        returns (half-closes) when the call ended or the pipeline closes with all sent."""
        while True:  # ends with the attempt
            with self._condition:
                while True:  # bounded: the attempt ends or requests arrive (polled)
                    if attempt.closed:
                        return
                    requests = self._sendable(attempt)
                    if requests:
                        break
                    if self._closing and attempt.sent == len(self._unacked):
                        return
                    self._condition.wait(timeout=_POLL_S)
                if attempt.sent == 0:
                    attempt.waiting_since = time.monotonic()
                attempt.sent += len(requests)
                self.messages_sent += 1
                now = time.perf_counter()
                for request in requests:
                    request.sent_at = request.sent_at or now
                producer_id = self._producer_id
            yield hastream_pb2.PublishBatch(
                requests=[
                    hastream_pb2.PublishRequest(
                        table=self._table,
                        payload=request.payload,
                        producer_id=producer_id,
                        sequence=request.sequence,
                    )
                    for request in requests
                ]
            )

    def _sendable(self, attempt: _Attempt) -> list[_Request]:
        """Unsent requests for one message (caller holds the lock). Until the producer is
        known, one request at a time (see the module docstring)."""
        if not self._producer_known and attempt.sent > 0:
            return []
        count_max = wire.PIPELINE_BATCH_REQUESTS_MAX if self._producer_known else 1
        requests: list[_Request] = []
        size = 0
        for index in range(attempt.sent, min(len(self._unacked), attempt.sent + count_max)):
            request = self._unacked[index]
            if requests and size + len(request.payload) > wire.BATCH_BYTES_MAX:
                break
            requests.append(request)
            size += len(request.payload)
        return requests

    def _acknowledge(self, attempt: _Attempt, responses: Any) -> None:
        """Settle the head requests with `responses` (driver thread)."""
        done: list[tuple[_Request, AppendResult]] = []
        with self._condition:
            for response in responses:
                if not self._unacked or attempt.sent == 0:
                    raise StreamBroken(attempt.site, "an answer to a request not sent")
                request = self._unacked[0]
                if response.sequence != request.sequence:
                    raise StreamBroken(
                        attempt.site,
                        f"an answer for sequence {response.sequence}, expected {request.sequence}",
                    )
                self._unacked.popleft()
                self._unacked_bytes -= len(request.payload)
                attempt.sent -= 1
                done.append((request, append_result(response)))
            if done:
                self._acked += len(done)
                self._producer_known = True
                attempt.waiting_since = time.monotonic() if attempt.sent else None
                self._settling_begins()
                self._condition.notify_all()
        if not done:
            return
        try:
            self._session.remember_leader(attempt.site, table=self._table, group=None)
            for request, result in done:
                request.future.set_result(result)
        finally:
            self._settled()

    def _settling_begins(self) -> None:
        """This thread took requests off `_unacked` (caller holds the condition)."""
        me = threading.get_ident()
        self._settling[me] = self._settling.get(me, 0) + 1

    def _settled(self) -> None:
        """This thread completed the futures of the requests it took off `_unacked`."""
        me = threading.get_ident()
        with self._condition:
            self._settling[me] -= 1
            if not self._settling[me]:
                del self._settling[me]
            self._condition.notify_all()

    def _settling_elsewhere(self) -> bool:
        me = threading.get_ident()
        return any(ident != me for ident in self._settling)

    def _after_failure(self, site: str, error: RaftStoreError, retry: _Retry) -> str:
        """Where the next attempt goes; fails the pipeline (and returns `site`) when the
        error is final or the retry budget is spent."""
        if isinstance(error, TableNotFound):
            # A node that has not applied the table's creation yet says so: believe it once
            # every known site did, or a site sends us back to one that did (its leader).
            retry.not_found.add(site)
            retry.not_found_error = error
            untried = untried_site(self._session.sites, retry.not_found)
            if untried is not None and retry.backoff.remaining_s() > 0:
                return untried
        hint = self._session.redirect_target(error, site)
        if retry.not_found_error is not None and hint in retry.not_found:
            error = retry.not_found_error
        if not error.retryable:
            log.warning("pipelined publish failed table=%s error=%s", self._table, error)
            self._fail_all(error, renew=True)
            retry.gave_up = True
            return site
        log.debug("publish stream failed site=%s error=%s", site, error)
        self._session.forget_leader(site, table=self._table, group=None)
        if isinstance(error, Unresponsive) and hint is not None:
            # The stream waited the hedge delay (which bounds these moves) and the other
            # sites agree on this leader: go at once, as call_policy.decide does.
            return hint
        if hint is not None and not retry.redirected and retry.backoff.remaining_s() > 0:
            retry.redirected = True  # the first redirect goes at once; later ones back off
            return hint
        if not retry.backoff.wait():
            log.warning("pipelined publish gave up table=%s error=%s", self._table, error)
            self._fail_all(error, renew=True)
            retry.gave_up = True
            return site
        return hint if hint is not None else self._session.next_site(site)

    def _fail_all(self, error: BaseException, *, renew: bool) -> None:
        """Fail every unacknowledged request: the head with `error`, the rest with
        PublishAborted; with `renew`, go on under a fresh producer. Futures are completed
        outside the lock (their callbacks may submit)."""
        with self._condition:
            if not self._unacked:
                return
            failed = list(self._unacked)
            self._unacked.clear()
            self._unacked_bytes = 0
            self._settling_begins()
            if renew and not self._renew:
                self._ended_by = (failed[0].sequence, str(error))
            elif renew:
                self._producer_id = secrets.token_bytes(wire.PRODUCER_ID_BYTES)
                self._next_sequence = 1
                self._producer_known = False
                log.warning(
                    "pipeline continues under a new producer table=%s failed_requests=%d",
                    self._table,
                    len(failed),
                )
            self._condition.notify_all()
        head = failed[0]
        try:
            head.future.set_exception(error)
            for request in failed[1:]:
                request.future.set_exception(PublishAborted(head.sequence, str(error)))
        finally:
            self._settled()


def append_result(response: hastream_pb2.PublishResponse) -> AppendResult:
    """The result of one answered publish request (unary or pipelined)."""
    return AppendResult(
        first_offset=response.first_offset,
        row_count=response.row_count,
        duplicates=response.duplicates,
        lsn=response.lsn,
        duplicate_batch=response.duplicate_batch,
    )
