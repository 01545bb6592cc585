"""What one table's data-file index costs: memory per record, open time, read speed.

    python -m bench.data_index [--records 300000] [--rows 1] [--repeat 3]

Appends `--records` records of `--rows` one-int64-column rows each to a fresh `TableLog`
(64 MiB segments, the default; one-row records are the smallest a waited one-row append
writes), then measures:

- index memory: the Python heap allocated by reopening the table (`tracemalloc`), per record;
- open: the wall time to reopen (every header is read and checked);
- sequential read: records per second reading the whole table with `TableLog.read`;
- seek: the median time of a `record_at` at a random offset (a reader starting mid-table);
- time lookup: the median `offset_for_time` at a random stamp.

Medians over `--repeat` runs. The index is the only per-record memory a node keeps for a
table's data files, so it bounds how many records a node can hold (a day of one-row
appends at 400/s is 35 million records).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa

from raftstore.storage.segments import DataRecord, TableLog


def _payload(rows: int) -> bytes:
    batch = pa.record_batch([pa.array(range(rows), pa.int64())], names=["id"])
    return batch.serialize().to_pybytes()


def fill(directory: Path, records: int, rows: int) -> None:
    log = TableLog(directory)
    payload = _payload(rows)
    for i in range(records):
        log.append(DataRecord(i + 1, i * rows, rows, 1_000_000 + i, payload))
    log.sync()
    log.close()


def measure(directory: Path, records: int, rows: int) -> dict[str, float]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    log = TableLog(directory)
    open_s = time.perf_counter() - started
    index_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()

    started = time.perf_counter()
    count = sum(1 for _ in log.read(0))
    read_s = time.perf_counter() - started
    assert count == records, (count, records)

    rng = random.Random(1)
    seeks = []
    for _ in range(200):
        offset = rng.randrange(records * rows)
        started = time.perf_counter()
        log.record_at(offset)
        seeks.append(time.perf_counter() - started)
    lookups = []
    for _ in range(200):
        stamp = 1_000_000 + rng.randrange(records)
        started = time.perf_counter()
        found = log.offset_for_time(stamp)
        lookups.append(time.perf_counter() - started)
        assert found == ((stamp - 1_000_000) * rows, stamp), (found, stamp)
    log.close()
    return {
        "index_bytes_per_record": index_bytes / records,
        "open_s": open_s,
        "read_records_per_s": records / read_s,
        "seek_us": statistics.median(seeks) * 1e6,
        "time_lookup_us": statistics.median(lookups) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="data-index-") as parent:
        directory = Path(parent) / "t"
        fill(directory, args.records, args.rows)
        runs = [measure(directory, args.records, args.rows) for _ in range(args.repeat)]
    print(f"{args.records:,} records of {args.rows} row(s), medians of {args.repeat}:")
    for key in runs[0]:
        print(f"  {key:24} {statistics.median(run[key] for run in runs):14,.2f}")


if __name__ == "__main__":
    main()
