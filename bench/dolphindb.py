"""DolphinDB's published HA vs non-HA write throughput (seed 004, section 5).

Three servers on 10 GbE, Raft log on SSD, table data on HDD, synchronous persistence, no
compression, the API client on the leader's server. Rows/s as published; the ratio is
HA / normal. Key: (columns, threads, batch rows per write).
"""

from __future__ import annotations

from typing import Final, NamedTuple


class Published(NamedTuple):
    total_rows: int
    writes_per_thread: int
    ha_rows_per_s: float
    normal_rows_per_s: float
    ratio_percent: float


DOLPHINDB: Final[dict[tuple[int, int, int], Published]] = {
    # 11 columns
    (11, 1, 1): Published(10_000, 10_000, 671.9, 1_515.8, 44.3),
    (11, 1, 100): Published(1_000_000, 10_000, 2_383.4, 2_451.1, 97.2),
    (11, 1, 1_000): Published(10_000_000, 10_000, 22_714.4, 23_697.2, 95.9),
    (11, 1, 10_000): Published(10_000_000, 1_000, 379_046.3, 529_997.9, 71.5),
    (11, 4, 1): Published(40_000, 10_000, 884.7, 5_618.0, 15.7),
    (11, 4, 100): Published(4_000_000, 10_000, 9_488.4, 9_776.4, 97.1),
    (11, 4, 1_000): Published(40_000_000, 10_000, 89_536.3, 93_496.2, 95.8),
    (11, 4, 10_000): Published(40_000_000, 1_000, 675_641.4, 1_126_475.0, 60.0),
    # 211 columns
    (211, 1, 1): Published(10_000, 10_000, 23.4, 23.9, 98.1),
    (211, 1, 100): Published(1_000_000, 10_000, 3_895.2, 4_121.1, 94.5),
    (211, 1, 1_000): Published(10_000_000, 10_000, 21_833.6, 29_430.8, 74.2),
    (211, 1, 10_000): Published(10_000_000, 1_000, 59_755.4, 89_136.1, 67.0),
    (211, 4, 1): Published(40_000, 10_000, 93.2, 96.2, 96.9),
    (211, 4, 100): Published(4_000_000, 10_000, 13_522.3, 23_371.3, 57.9),
    (211, 4, 1_000): Published(40_000_000, 10_000, 77_011.2, 107_458.7, 71.7),
    (211, 4, 10_000): Published(40_000_000, 1_000, 67_816.2, 122_075.9, 55.6),
}
