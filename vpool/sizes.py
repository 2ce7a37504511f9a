"""Memory sizes and durations as people write and read them: ``vsdk submit --memory 1.5G``,
the pool view, the limits an agent names when a rank goes past one, a join token's lifetime
(``--expires 7d``).

Units are powers of 1024 however they are spelt (``2G``, ``2GB``, ``2GiB``, ``2 g``), as Slurm's
``--mem`` and Docker's ``--memory`` read them; a bare number is bytes. Durations are a number
and one of s, m, h, d, w (a bare number is seconds).
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_DURATION = re.compile(r"(\d{1,9}(?:\.\d{1,6})?)\s*([smhdw]?)", re.ASCII)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(?:i?b)?|b)?", re.IGNORECASE | re.ASCII)


def parse_size(text: str) -> int:
    """Bytes of a size such as ``512M``, ``2G``, ``1.5GiB`` or ``1073741824`` (fractions of
    a byte are dropped). Raises ``ValueError`` with a message for people."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"{text!r} is not a size: write bytes, or a number with K, M, G or T "
            "(powers of 1024), e.g. 512M, 2G, 1.5GiB"
        )
    number, unit = match.groups()
    return int(Fraction(number) * 1024 ** _UNITS[(unit or "").lower()])


def format_size(n: int) -> str:
    """``n`` bytes as "512 MiB", "1.5 GiB", "100 bytes"."""
    for unit, power in (("PiB", 5), ("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        scale = 1024**power
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n} bytes"


def parse_duration(text: str) -> float:
    """Seconds in "90", "30m", "12h", "7d" or "2w" (more than 0). Raises ``ValueError`` with a
    message for people."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None or float(match[1]) <= 0:
        raise ValueError(f"{text[:40]!r} is not a duration such as 30m, 12h, 7d or 2w")
    return float(match[1]) * _SECONDS[match[2]]


def format_duration(seconds: float) -> str:
    """Seconds as people say them: "45 s", "5 min", "1 h 30 min", "2 d 3 h"."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    minutes, s = divmod(s, 60)
    if minutes < 60:
        return f"{minutes} min" + (f" {s} s" if s and minutes < 10 else "")
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    days, hours = divmod(hours, 24)
    return f"{days} d" + (f" {hours} h" if hours else "")
