"""The node's status page: groups, leaders, health, per-table rows/s and per-topic lag.

`status_document` reads the node once (the same structures the metrics exporter reads);
`RateTracker` turns successive row counts into rows per second; `render_page` and
`render_fragment` are pure (document in, HTML out). The page refreshes itself: a small
script fetches the fragment every `REFRESH_S` seconds and swaps it in (without scripts, a
meta refresh reloads the whole page). Served by status_http.py at `/`, the document as JSON
at `/status.json`.
"""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

from hastream.model import LOCAL_GROUP
from raftstore.metrics import MetricsSource

REFRESH_S: Final = 2
# Rates are computed between samples at least this far apart (several viewers, one rate).
RATE_SAMPLE_MIN_S: Final = 1.0


def status_document(source: MetricsSource) -> dict[str, Any]:
    """The node as the page shows it. JSON-serializable."""
    groups: list[dict[str, Any]] = []
    tables: list[dict[str, Any]] = []
    topics: list[dict[str, Any]] = []
    for group in source.groups():
        status = group.status()
        group_id = group.group_id
        if group_id != LOCAL_GROUP:
            groups.append(_group_entry(group_id, status))
        for table, stats in sorted(status["table_stats"].items()):
            tables.append(
                {
                    "group": group_id,
                    "table": table,
                    "rows": stats["row_count"],
                    "earliest_offset": stats["earliest_offset"],
                }
            )
        connections = status["subscriptions"]
        for topic, persisted in sorted(group.topics().items()):
            table = topic.rpartition("/")[0]
            if table not in status["table_stats"]:
                continue
            rows = status["table_stats"][table]["row_count"]
            topics.append(
                {
                    "topic": topic,
                    "table": table,
                    "persisted_offset": persisted,
                    "lag_rows": max(0, rows - 1 - persisted),
                    "connections": connections.get(topic, 0),
                }
            )
    return {
        "node": source.alias,
        "ready": source.ready(),
        "serving": source.serving(),
        "groups": groups,
        "tables": tables,
        "topics": topics,
    }


def _group_entry(group_id: int, status: dict[str, Any]) -> dict[str, Any]:
    lags: dict[str, int] = {}
    if status["role"] == "leader":
        last = status["last_log_index"]
        lags = {alias: max(0, last - match) for alias, match in status["match_index"].items()}
    return {
        "group": group_id,
        "role": status["role"],
        "leader": status["leader"],
        "term": status["term"],
        "commit_index": status["commit_index"],
        "last_applied": status["last_applied"],
        "health": status["health"]["state"],
        "health_reason": status["health"].get("reason", ""),
        "follower_lag": lags,
        "transfer_target": status.get("transfer_target"),
    }


@dataclass
class RateTracker:
    """Rows per second per table, from row counts sampled at least RATE_SAMPLE_MIN_S apart.
    Thread-safe."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sample: tuple[float, dict[str, int]] | None = None
    _rates: dict[str, float] = field(default_factory=dict)

    def update(self, rows: dict[str, int], now_s: float | None = None) -> dict[str, float]:
        """Record `rows` (table -> row count) seen at `now_s`; the latest rates."""
        now = time.monotonic() if now_s is None else now_s
        with self._lock:
            if self._sample is None:
                self._sample = (now, rows)
                return {}
            then, before = self._sample
            elapsed = now - then
            if elapsed >= RATE_SAMPLE_MIN_S:
                self._rates = {
                    table: max(0, count - before[table]) / elapsed
                    for table, count in rows.items()
                    if table in before
                }
                self._sample = (now, rows)
            return dict(self._rates)


def rows_by_table(document: dict[str, Any]) -> dict[str, int]:
    return {f"{t['group']}/{t['table']}": int(t["rows"]) for t in document["tables"]}


# --- rendering (pure) --------------------------------------------------------------------

_STYLE: Final = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .2em} h2{font-size:1.05em;margin:1.2em 0 .4em}
table{border-collapse:collapse;min-width:40em;background:#fff}
th,td{border:1px solid #ddd;padding:.3em .7em;text-align:left;font-variant-numeric:tabular-nums}
th{background:#f0f0f0} td.num{text-align:right}
.badge{padding:.1em .5em;border-radius:.6em;font-size:.9em;color:#fff}
.ok{background:#2e7d32} .warn{background:#ef6c00} .bad{background:#c62828}
.muted{color:#777;font-size:.9em}
"""

_SCRIPT: Final = """
async function refresh() {
  try {
    const response = await fetch('fragment', {cache: 'no-store'});
    if (response.ok) {
      document.getElementById('status').innerHTML = await response.text();
      document.getElementById('refreshed').textContent =
        'refreshed ' + new Date().toLocaleTimeString();
    }
  } catch (error) {
    document.getElementById('refreshed').textContent = 'node unreachable: ' + error;
  }
}
setInterval(refresh, REFRESH_MS);
""".replace("REFRESH_MS", str(REFRESH_S * 1000))


def render_page(document: dict[str, Any], rates: dict[str, float]) -> str:
    node = html.escape(str(document["node"]))
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>hastream {node}</title><style>{_STYLE}</style>"
        f"<noscript><meta http-equiv='refresh' content='{REFRESH_S * 2}'></noscript>"
        "</head><body>"
        f"<div id='status'>{render_fragment(document, rates)}</div>"
        f"<p class='muted' id='refreshed'>refreshes every {REFRESH_S} s</p>"
        f"<script>{_SCRIPT}</script></body></html>\n"
    )


def render_fragment(document: dict[str, Any], rates: dict[str, float]) -> str:
    """The page's body: what the script swaps in on every refresh."""
    node = html.escape(str(document["node"]))
    serving = _badge("serving", "ok") if document["serving"] else _badge("not serving", "bad")
    ready = "ready" if document["ready"] else "replaying or in doubt"
    parts = [
        f"<h1>hastream node {node} {serving}</h1>",
        f"<p class='muted'>{ready}; <a href='metrics'>/metrics</a>, "
        "<a href='status.json'>status.json</a></p>",
        "<h2>Raft groups</h2>",
        _groups_table(document["groups"]),
        "<h2>Tables</h2>",
        _tables_table(document["tables"], rates),
        "<h2>Subscriber topics</h2>",
        _topics_table(document["topics"]),
    ]
    return "\n".join(parts)


def _badge(text: str, kind: str) -> str:
    return f"<span class='badge {kind}'>{html.escape(text)}</span>"


def _health_badge(state: str) -> str:
    kind = {"healthy": "ok", "stalled": "warn", "repairing": "warn"}.get(state, "bad")
    return _badge(state, kind)


def _table(headers: tuple[str, ...], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f"<p class='muted'>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: object, *, number: bool = False) -> str:
    css = " class='num'" if number else ""
    return f"<td{css}>{html.escape(str(value))}</td>"


def _groups_table(groups: list[dict[str, Any]]) -> str:
    rows = []
    for group in groups:
        lag = ", ".join(f"{alias}: {n}" for alias, n in sorted(group["follower_lag"].items()))
        role = group["role"]
        if group.get("transfer_target") is not None:
            role += " (handing over)"
        rows.append(
            [
                _cell(group["group"], number=True),
                _cell(group["leader"] or "none (election)"),
                _cell(role),
                _cell(group["term"], number=True),
                _cell(group["commit_index"], number=True),
                _cell(group["last_applied"], number=True),
                f"<td>{_health_badge(group['health'])} {html.escape(group['health_reason'])}</td>",
                _cell(lag or "-"),
            ]
        )
    headers = ("group", "leader", "role here", "term", "commit", "applied", "health")
    return _table((*headers, "follower lag (entries)"), rows, "no Raft groups")


def _tables_table(tables: list[dict[str, Any]], rates: dict[str, float]) -> str:
    rows = []
    for table in tables:
        rate = rates.get(f"{table['group']}/{table['table']}")
        rows.append(
            [
                _cell(table["table"]),
                _cell(table["group"], number=True),
                _cell(table["rows"], number=True),
                _cell("-" if rate is None else f"{rate:,.1f}", number=True),
                _cell(table["earliest_offset"], number=True),
            ]
        )
    headers = ("table", "group", "rows", "rows/s", "earliest offset")
    return _table(headers, rows, "no tables")


def _topics_table(topics: list[dict[str, Any]]) -> str:
    rows = [
        [
            _cell(topic["topic"]),
            _cell(topic["persisted_offset"], number=True),
            _cell(topic["lag_rows"], number=True),
            _cell(topic["connections"], number=True),
        ]
        for topic in topics
    ]
    headers = ("topic", "persisted offset", "lag (rows)", "subscriptions here")
    return _table(headers, rows, "no topic has persisted an offset")
