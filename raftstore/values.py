"""`entry_value`: the dataclass of the values the write path makes for every entry.

Read-only to the type checker (`frozen_default`: mypy refuses an assignment to a field, as
for `@dataclass(frozen=True)`), a plain slotted dataclass at run time. A frozen
dataclass's `__init__` sets each field through `object.__setattr__`: 0.72 us for six
fields against 0.17, and an applied one-row entry makes about ten of these on every
replica (the command, its item, the effect, the results, the data-file record and its
header, the cached slice). Measured: `python -m bench.checkouts_ab --shape wait:1`, x0.96
node CPU per row, x1.02-1.03 rows/s (docs/benchmark.md, twentieth session). Hashable and
compared by value, like the frozen dataclasses they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

_Class = TypeVar("_Class")


@dataclass_transform(frozen_default=True)
def entry_value(cls: type[_Class]) -> type[_Class]:
    return dataclass(slots=True, unsafe_hash=True)(cls)
