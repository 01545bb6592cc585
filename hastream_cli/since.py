"""`hastream tail --since`: a point in time as an operator types it.

Pure: text and the current time in, ms since the epoch out.
"""

from __future__ import annotations

import datetime
import re
from typing import Final

from api_clients.times import epoch_ms

_UNITS_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
_AGO: Final = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def since_ms(text: str, now_ms: int) -> int:
    """`text` as ms since the epoch: a duration ago (`90s`, `5m`, `2h`, `1d`), an ISO 8601
    time (`2026-11-25T01:00:00Z`; without a zone it is UTC), or ms since the epoch.
    Raises ValueError naming what is accepted."""
    word = text.strip()
    ago = _AGO.fullmatch(word)
    if ago is not None:
        return now_ms - int(float(ago.group(1)) * _UNITS_S[ago.group(2)] * 1000)
    if word.isdigit():
        return int(word)
    try:
        stamp = datetime.datetime.fromisoformat(word)
    except ValueError:
        pass
    else:
        return epoch_ms(stamp, "--since")  # naive is UTC, as everywhere in the client
    raise ValueError(
        f"{text!r} is not a time: give a duration ago (90s, 5m, 2h, 1d), an ISO 8601 "
        "time (2026-11-25T01:00:00Z) or ms since the epoch"
    )
