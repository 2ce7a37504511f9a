"""The volunteer's preferences, applied: when the ranks of this agent may run.

The owner's machine is theirs first (as in BOINC, HTCondor, Folding@home): ranks run always or
only once the owner has been away for ``idle_after``; they stop while the machine runs on
battery, while one of the programs the owner named runs, outside the hours the owner gave, and
while the owner paused the agent. Stopping is suspending: the ranks are frozen (``ranks.py``),
the coordinator hears they are suspended, not lost, and they thaw when they may run again. A
machine about to sleep or shut down, or a battery nearly empty, hands every rank back instead
(seed 001's proactive evacuation): each is checkpointed and restarted elsewhere from that image.

Everything here is pure: ``decide(preferences, seen)`` turns what the agent observed
(``desktop.py``) into a ``Verdict``; ``suspend.py`` acts on it.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass
from typing import Literal

from vpool.sizes import format_duration

Activity = Literal["available", "suspended", "leaving"]
RUN_WHEN = ("always", "idle")

_HOURS = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


class PreferenceError(ValueError):
    """A preference that cannot be understood (the message says which and why)."""


@dataclass(frozen=True)
class Window:
    """Hours of the day, ``start`` to ``end`` in minutes after midnight; past midnight when
    ``end <= start`` ("22:00-07:00")."""

    start: int
    end: int

    def __contains__(self, minute: int) -> bool:
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end

    def __str__(self) -> str:
        return (
            f"{self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"
        )


def parse_hours(text: str) -> tuple[Window, ...]:
    """``"22:00-07:00, 12:00-13:30"`` as windows; ``""`` (any time) as none."""
    windows = []
    for part in text.split(","):
        if not part.strip():
            continue
        m = _HOURS.match(part)
        if m is None:
            raise PreferenceError(f"run_hours: {part.strip()!r} is not HH:MM-HH:MM")
        h1, m1, h2, m2 = (int(g) for g in m.groups())
        if h1 > 24 or h2 > 24 or m1 > 59 or m2 > 59 or h1 * 60 + m1 > 1440 or h2 * 60 + m2 > 1440:
            raise PreferenceError(f"run_hours: {part.strip()!r} is not a time of day")
        start, end = (h1 * 60 + m1) % 1440, (h2 * 60 + m2) % 1440
        if start == end:
            raise PreferenceError(f"run_hours: {part.strip()!r} is empty (use '' for any time)")
        windows.append(Window(start, end))
    return tuple(windows)


@dataclass(frozen=True)
class Preferences:
    run_when: str = "always"  # "always" | "idle"
    idle_after: float = 300.0  # s the owner must have been away (run_when "idle")
    pause_on_battery: bool = True
    evacuate_battery_below: float = 10.0  # percent, discharging: hand every rank back
    pause_while: frozenset[str] = frozenset()  # program names
    hours: tuple[Window, ...] = ()  # empty: any time

    def __post_init__(self) -> None:
        if self.run_when not in RUN_WHEN:
            raise PreferenceError(
                f"run_when: {self.run_when!r} is not one of {', '.join(RUN_WHEN)}"
            )
        if not self.idle_after >= 0:
            raise PreferenceError(f"idle_after: {self.idle_after!r} is not a duration")
        if not 0 <= self.evacuate_battery_below <= 100:
            raise PreferenceError(
                f"evacuate_battery_below: {self.evacuate_battery_below!r} is not a percentage"
            )


@dataclass(frozen=True)
class Battery:
    discharging: bool  # running on it: no mains power online
    percent: float | None  # charge left (None: not reported)


@dataclass(frozen=True)
class Seen:
    """What the agent observed of its machine at one moment."""

    now: dt.datetime  # local time (for ``hours``)
    idle: float | None = None  # s the owner has been away (None: no way to know)
    idle_source: str = ""  # where ``idle`` came from ("logind", "terminals"), for people
    battery: Battery | None = None  # None: no battery (a desktop)
    programs: frozenset[str] = frozenset()  # of ``pause_while``, those running
    paused_for: float = 0.0  # s the owner's pause has left (math.inf: until resumed)
    going_to_sleep: bool = False  # logind's PrepareForSleep(true) or PrepareForShutdown(true)


@dataclass(frozen=True)
class Verdict:
    activity: Activity
    reason: str = ""  # why not "available", for people and the coordinator
    evacuate: str = ""  # non-empty: checkpoint every rank and hand it back now, for this reason

    @property
    def runs(self) -> bool:
        """The ranks may run (not frozen). Evacuated ranks run until their checkpoint."""
        return self.activity == "available" or bool(self.evacuate)


def decide(prefs: Preferences, seen: Seen) -> Verdict:
    """What the agent does now, by the first rule that applies: sleep or shutdown coming and
    a nearly empty battery hand the ranks back; a pause by the owner, battery, named programs,
    hours and the owner being there suspend them; otherwise they run."""
    if seen.going_to_sleep:
        why = "the machine is going to sleep or shutting down"
        return Verdict("leaving", why, evacuate=why)
    bat = seen.battery
    if (
        bat is not None
        and bat.discharging
        and bat.percent is not None
        and bat.percent < prefs.evacuate_battery_below
    ):
        why = f"its battery is nearly empty ({bat.percent:.0f}%)"
        return Verdict("suspended", why, evacuate=why)
    if seen.paused_for > 0:
        until = (
            "until resumed"
            if math.isinf(seen.paused_for)
            else (f"for {format_duration(seen.paused_for)} more")
        )
        return Verdict("suspended", f"paused by its owner ({until})")
    if prefs.pause_on_battery and bat is not None and bat.discharging:
        left = f", {bat.percent:.0f}% left" if bat.percent is not None else ""
        return Verdict("suspended", f"running on battery{left}")
    if seen.programs:
        names = ", ".join(sorted(seen.programs))
        verb = "is" if len(seen.programs) == 1 else "are"
        return Verdict("suspended", f"{names} {verb} running")
    if prefs.hours:
        minute = seen.now.hour * 60 + seen.now.minute
        if not any(minute in w for w in prefs.hours):
            hours = ", ".join(str(w) for w in prefs.hours)
            return Verdict("suspended", f"outside its hours ({hours})")
    if prefs.run_when == "idle":
        if seen.idle is None:
            return Verdict(
                "suspended", "it runs only when the machine is idle, and cannot tell when it is"
            )
        if seen.idle <= 0 or seen.idle < prefs.idle_after:  # 0: present now, whatever idle_after
            if seen.idle < 60:
                why = "the owner is using the machine"
            else:
                why = f"the machine has been idle for {format_duration(seen.idle)} only"
            return Verdict(
                "suspended", f"{why} (it runs after {format_duration(prefs.idle_after)} idle)"
            )
    return Verdict("available")
