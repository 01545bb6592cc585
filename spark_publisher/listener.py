"""Persisting a streaming query's hastream offset as soon as each micro-batch commits.

Spark calls a source's `commit(end)` for micro-batch N only when it plans micro-batch N+1
with new data, and never for the last micro-batch of a run, so the offset the source
persists lags by one micro-batch (measured on pyspark 4.3). A StreamingQueryListener
sees every micro-batch's `endOffset` on the driver right after the batch commits; this one
persists `endOffset - 1` (the last processed row) for the action, through Raft.

    listener = HAStreamOffsetListener("h1:8901,h2:8902", "t", action="agg", query_name="agg")
    spark.streams.addListener(listener)
    spark.readStream.format("hastream")...writeStream.queryName("agg")...start()

Best effort: a failure is logged and the next micro-batch persists a later offset. Spark's
checkpoint stays the source of truth for a restarted query.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryListener

from api_clients import RaftStoreError
from spark_publisher.cluster import PLANNING_TIMEOUT_S, commit_offset, table_info
from spark_publisher.options import offset_number, parse

log = logging.getLogger(__name__)


class HAStreamOffsetListener(StreamingQueryListener):
    """Persists the end offset of the hastream source of `table` after every micro-batch.

    Spark describes a Python streaming source only by its class (no name, no options), so
    the query is matched by its name (`writeStream.queryName(...)`), and its Python
    streaming source whose offsets name `table` is taken (offsets written before they named
    the table, `{"offset": N}`, count as this table's when they are the query's only ones).
    With several sources of one table in one query, pass `source_index` (its position in
    `progress.sources`). Runs on the driver's listener thread; `persisted` is the last
    offset it stored, `rows_behind_latest` how far the last micro-batch ended behind the
    table's row count when it was planned (Kafka's offsetsBehindLatest).
    """

    def __init__(
        self,
        sites: str,
        table: str,
        action: str = "spark",
        *,
        query_name: str,
        source_index: int | None = None,
        timeout_s: float = PLANNING_TIMEOUT_S,
        **tls_options: str,
    ) -> None:
        """`tls_options`: the source's TLS and login options (`tls`, `caFile`, `certFile`,
        `keyFile`, `userid`, `password`), so the offsets are stored over the same kind of
        connection, as the same user."""
        super().__init__()
        known = {"tls", "caFile", "certFile", "keyFile", "userid", "password"}
        unknown = sorted(set(tls_options) - known)
        if unknown:
            raise TypeError(f"unexpected keyword arguments: {', '.join(unknown)}")
        self._options = parse(
            {
                "sites": sites,
                "table": table,
                "action": action,
                "timeoutSec": str(timeout_s),
                **tls_options,
            }
        )
        self._query_name = query_name
        self._source_index = source_index
        self._lock = threading.Lock()
        self.persisted: int | None = None
        self.rows_behind_latest: int | None = None
        self.failures = 0

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        if progress.name != self._query_name:
            return
        sources = list(progress.sources)
        if self._source_index is not None:
            ours = sources[self._source_index : self._source_index + 1]
        else:
            ours = [source for source in sources if is_python_stream_source(source.description)]
        table = self._options.table
        ends = [
            (source, end)
            for source in ours
            if (end := _offset_of(source.endOffset, table)) is not None
        ]
        if len(ends) > 1:
            log.warning(
                "query %s has %d Python streaming sources of %s: pass source_index",
                progress.name,
                len(ends),
                table,
            )
            return
        if ends:
            source, end = ends[0]
            latest = _offset_of(source.latestOffset, table)
            self.rows_behind_latest = None if latest is None else max(0, latest - end)
            self._persist(end - 1)

    def _persist(self, last: int) -> None:
        with self._lock:
            if last < 0 or last == self.persisted:
                return
            options = self._options
            try:
                if self.persisted is None:
                    table_info(options, fresh=True)  # Route CommitOffset to the leader.
                commit_offset(options, last, options.timeout_s)
            except RaftStoreError as error:
                self.failures += 1
                log.warning("offset %d of %s not persisted: %s", last, options.topic, error)
                return
            self.persisted = last


def is_python_stream_source(description: str) -> bool:
    """Whether a source progress `description` is a Python Data Source stream (Spark names
    only the class: `...python.PythonMicroBatchStream...@1a2b3c`)."""
    return "PythonMicroBatchStream" in description


def _offset_of(text: str | None, table: str) -> int | None:
    """N of a progress's offset JSON when it is an offset of `table` (the source's own
    form, `options.offset_number`); None for anything else."""
    try:
        offset = json.loads(text or "null")
        return offset_number(offset, table) if isinstance(offset, dict) else None
    except ValueError:  # not JSON, malformed, or another table's (OptionError)
        return None
