"""CRC-32 for every checksum this project writes or checks: journal records, data-file
records, checkpoint frames, replica digests and the client's durable buffer.

zlib-ng's `crc32` computes the same function as `zlib.crc32` (the same polynomial, initial
value and result for any input and any starting value), so a file written with either
reads back with either and nothing on disk changes. It folds with the CPU's carry-less
multiply (PCLMULQDQ / VPCLMULQDQ) where Debian's zlib 1.2.13 goes a table lookup at a time,
and every byte a node stores is checksummed at least twice (journal, data file) and again
when it is read back, so a replica spent 12% of its CPU in zlib's `crc32_z` under 10,000-row
publishes (`perf record` on a follower, docs/benchmark.md).

Measured here (2 cores, AMD EPYC, one call on a buffer in cache): 600 KB 86 -> 9.4 us, 12.7 MB
1,841 -> 207 us; 300 bytes 0.17 -> 0.05 us. Both release the GIL on large buffers.

Without the zlib-ng package (a platform it has no wheel for) `zlib.crc32` is used: slower,
the same values.
"""

from __future__ import annotations

from typing import Final

try:
    from zlib_ng.zlib_ng import crc32 as crc32

    IMPLEMENTATION: Final = "zlib-ng"
except ImportError:  # pragma: no cover - the package is in requirements.txt
    from zlib import crc32 as crc32

    IMPLEMENTATION = "zlib"  # type: ignore[misc]

__all__ = ["IMPLEMENTATION", "crc32"]
