"""hastream.checksum.crc32 is zlib.crc32, value for value: files written before it (and by a
node without zlib-ng) must read back, and what it writes must read back there."""

from __future__ import annotations

import importlib.util
import zlib

from hypothesis import given
from hypothesis import strategies as st

from hastream import checksum


@given(st.binary(max_size=70_000), st.integers(0, 2**32 - 1))
def test_the_same_values_as_zlib_from_any_start(data: bytes, start: int) -> None:
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, start) == zlib.crc32(data, start)


@given(st.binary(max_size=20_000), st.data())
def test_slices_and_chaining_as_the_storage_code_uses_them(
    data: bytes, draw: st.DataObject
) -> None:
    # The journal checks a record as crc32(command, crc32(header)) over memoryview slices.
    cut = draw.draw(st.integers(0, len(data)))
    view = memoryview(data)
    chained = checksum.crc32(view[cut:], checksum.crc32(view[:cut]))
    assert chained == zlib.crc32(data)
    assert checksum.crc32(bytearray(data)) == zlib.crc32(data)


def test_several_megabytes() -> None:
    # Past the sizes above: the folding paths for large buffers, and a 12.7 MB request.
    data = bytes(range(256)) * 50_000
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(memoryview(data)[7:-3], 99) == zlib.crc32(data[7:-3], 99)


def test_zlib_ng_is_used_where_it_is_installed() -> None:
    installed = importlib.util.find_spec("zlib_ng") is not None
    expected = "zlib-ng" if installed else "zlib"
    assert expected == checksum.IMPLEMENTATION
