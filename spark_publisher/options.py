"""The `hastream` data source's options, parsed once into a frozen value.

Pure: no I/O, no Spark. Spark hands a data source its options as a case-insensitive map of
strings; `parse` turns it into `HAStreamOptions` or raises `OptionError` naming the option,
the value and what is allowed, so a typo fails on the driver before any task runs.

Option names follow Spark's Kafka connector (`startingOffsets`, `endingOffsets`,
`maxRowsPerTrigger`); the connector's own names are accepted where the meaning is the same
(`kafka.bootstrap.servers`, `subscribe`, `maxOffsetsPerTrigger`...: ALIASES), and its
options that would change results but are not implemented are refused (REFUSED).

Offsets are table row offsets: row N is the N-th row appended since the table was created;
a range `[start, end)` is half-open.
"""

from __future__ import annotations

import difflib
import enum
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from hastream import wire
from hastream.errors import InvalidArgument
from hastream.tls import ClientTls

log = logging.getLogger(__name__)

ACTION_DEFAULT: Final = "spark"
BATCH_ROWS_DEFAULT: Final = 10_000
# One publish request holds at most this many rows.
BATCH_ROWS_MAX: Final = wire.BATCH_ROWS_MAX
NUM_PARTITIONS_DEFAULT: Final = 2
NUM_PARTITIONS_MAX: Final = 4096
# A read partition holds at least this many rows unless the range is smaller: splitting a
# small micro-batch over many tasks costs more in task overhead than it saves.
PARTITION_ROWS_MIN: Final = 10_000
TIMEOUT_S_DEFAULT: Final = 60.0  # Longer than an election plus a proposal timeout.
TIMEOUT_S_MAX: Final = 3600.0
ACTION_BYTES_MAX: Final = wire.ACTION_NAME_BYTES_MAX
TABLE_BYTES_MAX: Final = wire.TABLE_NAME_BYTES_MAX
IDEMPOTENCY_TOKEN_BYTES_MAX: Final = 1024
MAX_TRIGGER_DELAY_S_DEFAULT: Final = 15 * 60.0  # Kafka's default, 15m
_DURATION_UNITS_S: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}

KNOWN_OPTIONS: Final = (
    "sites",
    "table",
    "action",
    "startingOffsets",
    "endingOffsets",
    "maxRowsPerTrigger",
    "minRowsPerTrigger",
    "maxTriggerDelay",
    "batchRows",
    "numPartitions",
    "timeoutSec",
    "idempotencyToken",
    "tls",
    "caFile",
    "certFile",
    "keyFile",
    "userid",
    "password",
    "startingTimestamp",
    "startingOffsetsByTimestamp",
    "startingOffsetsByTimestampStrategy",
    "endingTimestamp",
    "endingOffsetsByTimestamp",
    "includeMetadata",
    "failOnDataLoss",
)
# Spark's Kafka connector's names for the same meaning (a Kafka job's options carry over).
ALIASES: Final[dict[str, str]] = {
    "kafka.bootstrap.servers": "sites",
    "bootstrap.servers": "sites",
    "subscribe": "table",
    "topic": "table",
    "maxOffsetsPerTrigger": "maxRowsPerTrigger",
    "minOffsetsPerTrigger": "minRowsPerTrigger",
}
# Kafka connector options that would change what a query returns and that this source does
# not implement: refused, never ignored (an ignored minOffsetsPerTrigger would change batches).
REFUSED: Final[dict[str, str]] = {
    "minPartitions": "not the same meaning here: numPartitions caps the tasks of a batch",
    "assign": "a table has no partitions to assign: use table",
    "subscribePattern": "not supported: one table per source (table)",
    "includeHeaders": "rows have no headers",
    "groupIdPrefix": "offsets are per action: use action",
    "kafka.group.id": "offsets are per action: use action",
}
# Options Spark itself puts into a source's or sink's option map.
_SPARK_OPTIONS: Final = frozenset({"path", "checkpointlocation", "queryname"})


class OptionError(ValueError):
    """A `hastream` option is missing or malformed. Raised on the driver, before any task."""

    def __init__(self, option: str, value: str | None, detail: str) -> None:
        self.option = option
        self.value = value
        self.detail = detail
        shown = "missing" if value is None else f"{value!r}"
        super().__init__(f"hastream option {option}={shown}: {detail}")


class TimestampStrategy(enum.Enum):
    """Kafka's startingOffsetsByTimestampStrategy: what a start by time does when every
    retained row is older than the time."""

    ERROR = "error"  # refuse to start (Kafka's default)
    LATEST = "latest"  # start after the last row


class Position(enum.Enum):
    """A named starting or ending position."""

    EARLIEST = "earliest"  # The earliest row still retained.
    LATEST = "latest"  # The table's row count when the query (or batch read) starts.
    PERSISTED = "persisted"  # After the action's offset persisted in the cluster.


# A position is a name or an explicit row offset (>= 0).
Offset = Position | int


@dataclass(frozen=True, slots=True, kw_only=True)
class HAStreamOptions:
    sites: tuple[str, ...]  # host:port[:alias], in the order given.
    table: str
    action: str
    starting_offsets: Offset | None  # None: the default of the read kind.
    ending_offsets: Offset  # Batch reads only: LATEST or a row offset.
    max_rows_per_trigger: int | None
    # Kafka's minOffsetsPerTrigger: a micro-batch waits for this many new rows, at most
    # max_trigger_delay_s after the last one (then it takes what is there).
    min_rows_per_trigger: int | None = None
    max_trigger_delay_s: float = MAX_TRIGGER_DELAY_S_DEFAULT
    batch_rows: int
    num_partitions: int
    timeout_s: float
    idempotency_token: str | None  # Batch writes: a stable job id, so a re-run is deduplicated.
    tls: ClientTls | None = None  # tls=true, or any of caFile/certFile/keyFile
    # userid and password: every task's session logs in (a cluster with authentication=on).
    login: tuple[str, str] | None = field(default=None, repr=False)
    # Start (and, for batch reads, end) by ingest time, ms since the epoch: the first row
    # stamped at or after it. Over startingOffsets / endingOffsets when given, as in Kafka.
    starting_timestamp: int | None = None
    timestamp_strategy: TimestampStrategy = TimestampStrategy.ERROR
    ending_timestamp: int | None = None
    include_metadata: bool = False  # add _offset and _ingest_time to every row read
    # Kafka's failOnDataLoss: false skips rows retention removed before they were read
    # (with a warning) instead of failing the query.
    fail_on_data_loss: bool = True

    @property
    def topic(self) -> str:
        """The cluster-side topic whose processed offset this action persists."""
        return f"{self.table}/{self.action}"


def parse(options: Mapping[str, str]) -> HAStreamOptions:
    """Parses Spark's option map (keys in any case). Raises OptionError."""
    values = _canonical({str(key).lower(): str(value) for key, value in options.items()})
    _check_unknown(values)
    table = _name("table", values.get("table"), TABLE_BYTES_MAX)
    parsed = HAStreamOptions(
        sites=_sites(values.get("sites")),
        table=table,
        action=_name("action", values.get("action", ACTION_DEFAULT), ACTION_BYTES_MAX),
        starting_offsets=_starting(values.get("startingoffsets")),
        ending_offsets=_ending(values.get("endingoffsets")),
        max_rows_per_trigger=_optional_int(
            "maxRowsPerTrigger", values.get("maxrowspertrigger"), 1, 2**62
        ),
        min_rows_per_trigger=_optional_int(
            "minRowsPerTrigger", values.get("minrowspertrigger"), 1, 2**62
        ),
        max_trigger_delay_s=_duration("maxTriggerDelay", values.get("maxtriggerdelay")),
        batch_rows=_int(
            "batchRows", values.get("batchrows"), BATCH_ROWS_DEFAULT, 1, BATCH_ROWS_MAX
        ),
        num_partitions=_int(
            "numPartitions",
            values.get("numpartitions"),
            NUM_PARTITIONS_DEFAULT,
            1,
            NUM_PARTITIONS_MAX,
        ),
        timeout_s=_timeout(values.get("timeoutsec")),
        idempotency_token=_token(values.get("idempotencytoken")),
        tls=_tls(values),
        login=_login(values),
        starting_timestamp=_by_timestamp(values, "starting", table),
        timestamp_strategy=_strategy(values.get("startingoffsetsbytimestampstrategy")),
        ending_timestamp=_by_timestamp(values, "ending", table),
        include_metadata=_flag("includeMetadata", values.get("includemetadata")),
        fail_on_data_loss=_flag("failOnDataLoss", values.get("failondataloss", "true")),
    )
    low, high = parsed.min_rows_per_trigger, parsed.max_rows_per_trigger
    if low is not None and high is not None and low > high:
        raise OptionError("minRowsPerTrigger", str(low), f"above maxRowsPerTrigger={high}")
    return parsed


def _by_timestamp(values: Mapping[str, str], which: str, table: str) -> int | None:
    """`<which>OffsetsByTimestamp` (Kafka's JSON, {"<table>": {"0": ms}}: a table has one
    partition, 0) over `<which>Timestamp` (ms since the epoch), as Kafka ranks them."""
    by_partition = values.get(f"{which}offsetsbytimestamp")
    if by_partition is not None:
        name = f"{which}OffsetsByTimestamp"
        try:
            parsed = json.loads(by_partition)
        except ValueError as error:
            raise OptionError(name, by_partition, f"not JSON: {error}") from None
        expected = f'{{"{table}": {{"0": <ms since the epoch>}}}}'
        if not isinstance(parsed, dict) or set(parsed) != {table}:
            raise OptionError(name, by_partition, f"expected {expected}")
        partitions = parsed[table]
        if not isinstance(partitions, dict) or set(partitions) != {"0"}:
            raise OptionError(name, by_partition, f"a table has one partition, 0: {expected}")
        return _epoch_ms(name, str(partitions["0"]))
    single = values.get(f"{which}timestamp")
    return None if single is None else _epoch_ms(f"{which}Timestamp", single)


def _epoch_ms(option: str, text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise OptionError(option, text, "expected ms since the epoch (an integer)") from None
    if value < 0:
        raise OptionError(option, text, "must be >= 0")
    return value


def _duration(option: str, text: str | None) -> float:
    """Kafka's duration form: a number and a unit (`500ms`, `30s`, `15m`, `1h`, `1d`)."""
    if text is None:
        return MAX_TRIGGER_DELAY_S_DEFAULT
    word = text.strip().lower()
    for unit in sorted(_DURATION_UNITS_S, key=len, reverse=True):  # "ms" before "s"
        number = word.removesuffix(unit).strip()
        if number != word:
            try:
                value = float(number) * _DURATION_UNITS_S[unit]
            except ValueError:
                break
            if value <= 0:
                raise OptionError(option, text, "must be > 0")
            return value
    raise OptionError(option, text, "expected a duration such as 500ms, 30s, 15m or 1h")


def _strategy(text: str | None) -> TimestampStrategy:
    if text is None:
        return TimestampStrategy.ERROR
    for strategy in TimestampStrategy:
        if text.strip().lower() == strategy.value:
            return strategy
    raise OptionError("startingOffsetsByTimestampStrategy", text, "expected error or latest")


def _flag(option: str, text: str | None) -> bool:
    if text is None:
        return False
    word = text.strip().lower()
    if word not in ("true", "false"):
        raise OptionError(option, text, "expected true or false")
    return word == "true"


def _login(values: Mapping[str, str]) -> tuple[str, str] | None:
    userid, password = values.get("userid"), values.get("password")
    if userid is None and password is None:
        return None
    if not userid or password is None:
        raise OptionError("userid/password", None, "give both (or neither)")
    return userid, password


def _tls(values: Mapping[str, str]) -> ClientTls | None:
    """TLS settings: `tls=true` (system roots) or any of the files. The files are read here,
    on the driver, so a wrong path fails before any task."""
    enabled = _flag("tls", values.get("tls"))
    files = {name: values.get(name.lower()) for name in ("caFile", "certFile", "keyFile")}
    if not enabled and not any(files.values()):
        return None
    try:
        tls = ClientTls(files["caFile"], files["certFile"], files["keyFile"])
        tls.read()
    except InvalidArgument as error:
        raise OptionError(error.argument, None, error.detail) from None
    return tls


def _canonical(values: dict[str, str]) -> dict[str, str]:
    """Kafka's names replaced by this source's; refuses the Kafka options it does not
    implement, and an alias that contradicts the option it stands for."""
    refused = {name.lower(): (name, reason) for name, reason in REFUSED.items()}
    canonical = dict(values)
    for key, value in values.items():
        if key in refused:
            name, reason = refused[key]
            raise OptionError(name, value, reason)
    for alias, name in ALIASES.items():
        if alias.lower() not in canonical:
            continue
        value = canonical.pop(alias.lower())
        given = canonical.get(name.lower())
        if given is not None and given != value:
            raise OptionError(alias, value, f"contradicts {name}={given!r}")
        canonical[name.lower()] = value
    return canonical


def _check_unknown(values: Mapping[str, str]) -> None:
    """A name close to a known option is a typo: refuse it (a silently ignored
    `startingOffset` would start from the default). Other unknown names are logged."""
    known = {name.lower(): name for name in KNOWN_OPTIONS}
    for key in values:
        if key in known or key in _SPARK_OPTIONS:
            continue
        close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.8)
        if close:
            raise OptionError(key, values[key], f"unknown option; did you mean {known[close[0]]}?")
        log.warning("ignoring unknown hastream option %s", key)


def _sites(text: str | None) -> tuple[str, ...]:
    if text is None or not text.strip():
        raise OptionError("sites", text, "required: a comma-separated list of host:port")
    sites = tuple(part.strip() for part in text.split(",") if part.strip())
    for site in sites:
        parts = site.split(":")
        if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
            raise OptionError("sites", text, f"{site!r} is not host:port or host:port:alias")
        if not 0 < int(parts[1]) < 65536:
            raise OptionError("sites", text, f"{site!r} has a port outside 1..65535")
    return sites


def _name(option: str, text: str | None, bytes_max: int) -> str:
    if text is None or not text.strip():
        raise OptionError(option, text, "required")
    name = text.strip()
    if len(name.encode()) > bytes_max:
        raise OptionError(option, text, f"longer than {bytes_max} bytes")
    if "/" in name and option == "action":
        raise OptionError(option, text, "must not contain '/'")
    return name


def _offset_number(option: str, text: str) -> int:
    try:
        offset = int(text)
    except ValueError:
        return -1
    if offset < 0:
        raise OptionError(option, text, "a row offset must be >= 0")
    return offset


def _starting(text: str | None) -> Offset | None:
    if text is None:
        return None
    word = text.strip().lower()
    for position in Position:
        if word == position.value:
            return position
    offset = _offset_number("startingOffsets", word)
    if offset < 0:
        raise OptionError(
            "startingOffsets", text, "expected earliest, latest, persisted or a row offset >= 0"
        )
    return offset


def _ending(text: str | None) -> Offset:
    if text is None:
        return Position.LATEST
    word = text.strip().lower()
    if word == Position.LATEST.value:
        return Position.LATEST
    offset = _offset_number("endingOffsets", word)
    if offset < 0:
        raise OptionError("endingOffsets", text, "expected latest or a row offset >= 0")
    return offset


def _int(option: str, text: str | None, default: int, low: int, high: int) -> int:
    value = _optional_int(option, text, low, high)
    return default if value is None else value


def _optional_int(option: str, text: str | None, low: int, high: int) -> int | None:
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise OptionError(option, text, "not an integer") from None
    if not low <= value <= high:
        raise OptionError(option, text, f"must be in [{low}, {high}]")
    return value


def _timeout(text: str | None) -> float:
    if text is None:
        return TIMEOUT_S_DEFAULT
    try:
        value = float(text.strip())
    except ValueError:
        raise OptionError("timeoutSec", text, "not a number of seconds") from None
    if not 0 < value <= TIMEOUT_S_MAX:
        raise OptionError("timeoutSec", text, f"must be in (0, {TIMEOUT_S_MAX:g}]")
    return value


def _token(text: str | None) -> str | None:
    if text is None:
        return None
    if not text or len(text.encode()) > IDEMPOTENCY_TOKEN_BYTES_MAX:
        raise OptionError(
            "idempotencyToken", text, f"must be 1..{IDEMPOTENCY_TOKEN_BYTES_MAX} bytes"
        )
    return text


def split_range(start: int, end: int, partitions_max: int) -> list[tuple[int, int]]:
    """`[start, end)` cut into at most `partitions_max` contiguous ranges of nearly equal
    size, each of at least PARTITION_ROWS_MIN rows (unless the whole range is smaller)."""
    assert 0 <= start <= end, (start, end)
    assert partitions_max >= 1, partitions_max
    rows = end - start
    if rows == 0:
        return []
    count = max(1, min(partitions_max, rows // PARTITION_ROWS_MIN))
    size, extra = divmod(rows, count)
    ranges = []
    position = start
    for index in range(count):
        step = size + (1 if index < extra else 0)
        ranges.append((position, position + step))
        position += step
    assert position == end, (position, end)
    return ranges


def offset_dict(table: str, offset: int) -> dict[str, Any]:
    """A Spark offset of this source. It names the table, so the query's progress does
    (`sources[i].startOffset/endOffset/latestOffset`; Spark describes a Python source only
    by its class), and a checkpoint pointed at another table is refused."""
    return {"table": table, "offset": offset}


def offset_number(offset: Mapping[str, Any], table: str) -> int:
    """N of an offset of `table`; `{"offset": N}` too (written before offsets named the
    table). Raises OptionError for another table's offset (a reused checkpointLocation)."""
    value = offset.get("offset")
    named = offset.get("table", table)
    if not isinstance(value, int) or value < 0 or set(offset) - {"table", "offset"}:
        raise ValueError(
            f"hastream: malformed offset {offset!r}; expected {{'table': T, 'offset': N >= 0}}"
        )
    if named != table:
        raise OptionError(
            "table",
            table,
            f"the checkpoint holds offsets of table {named!r}: "
            "a query on another table needs a new checkpointLocation",
        )
    return value
