"""The owner's preferences applied (worker_agent/manners.py) and what the agent reads of the
machine (worker_agent/desktop.py): pure rules, and real files in a temporary tree."""

from __future__ import annotations

import datetime as dt
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vpool.config import SettingsError
from vpool.worker_agent import desktop
from vpool.worker_agent.manners import (
    Battery,
    PreferenceError,
    Preferences,
    Seen,
    Window,
    decide,
    parse_hours,
)
from vpool.worker_agent.settings import load_agent_settings

NOON = dt.datetime(2026, 11, 26, 12, 0)


def seen(**kw: object) -> Seen:
    return Seen(now=kw.pop("now", NOON), **kw)  # type: ignore[arg-type]


def test_by_default_ranks_run() -> None:
    assert decide(Preferences(), seen()).activity == "available"
    assert decide(Preferences(), seen()).runs


def test_run_when_idle_waits_for_idle_after_and_suspends_when_the_owner_is_back() -> None:
    prefs = Preferences(run_when="idle", idle_after=300)
    back = decide(prefs, seen(idle=3.0))
    assert back.activity == "suspended" and not back.runs
    assert back.reason == "the owner is using the machine (it runs after 5 min idle)"
    waiting = decide(prefs, seen(idle=120.0))
    assert waiting.reason == "the machine has been idle for 2 min only (it runs after 5 min idle)"
    assert decide(prefs, seen(idle=300.0)).activity == "available"
    # logind's "present" is 0 s idle: suspended even when any idleness would do.
    anytime = Preferences(run_when="idle", idle_after=0)
    assert decide(anytime, seen(idle=0.0)).activity == "suspended"
    assert decide(anytime, seen(idle=0.5)).activity == "available"
    unknown = decide(prefs, seen(idle=None))
    assert unknown.activity == "suspended" and "cannot tell" in unknown.reason


def test_battery_suspends_and_an_empty_one_hands_every_rank_back() -> None:
    prefs = Preferences()
    on_battery = decide(prefs, seen(battery=Battery(discharging=True, percent=55.0)))
    assert (on_battery.activity, on_battery.reason) == (
        "suspended",
        "running on battery, 55% left",
    )
    assert not on_battery.evacuate
    charging = decide(prefs, seen(battery=Battery(discharging=False, percent=5.0)))
    assert charging.activity == "available"
    empty = decide(prefs, seen(battery=Battery(discharging=True, percent=7.0)))
    assert empty.evacuate == "its battery is nearly empty (7%)" and empty.runs
    # The owner allows battery: it runs on it, but still leaves before the battery dies.
    allowed = Preferences(pause_on_battery=False)
    assert decide(allowed, seen(battery=Battery(True, 50.0))).activity == "available"
    assert decide(allowed, seen(battery=Battery(True, 9.0))).evacuate


def test_sleep_comes_first_and_hands_back_everything() -> None:
    v = decide(Preferences(run_when="idle"), seen(idle=0.0, going_to_sleep=True))
    assert v.activity == "leaving" and v.evacuate and v.runs


def test_pause_programs_and_hours() -> None:
    prefs = Preferences(hours=parse_hours("22:00-07:00"), pause_while=frozenset({"steam"}))
    assert decide(prefs, seen(paused_for=math.inf)).reason == "paused by its owner (until resumed)"
    assert decide(prefs, seen(paused_for=7200)).reason == "paused by its owner (for 2 h more)"
    night = dt.datetime(2026, 11, 26, 23, 30)
    assert decide(prefs, seen(now=night)).activity == "available"
    assert decide(prefs, seen(now=night, programs=frozenset({"steam"}))).reason == (
        "steam is running"
    )
    assert decide(prefs, seen()).reason == "outside its hours (22:00-07:00)"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("9-17", "is not HH:MM-HH:MM"),
        ("25:00-03:00", "is not a time of day"),
        ("10:61-11:00", "is not a time of day"),
        ("10:00-10:00", "is empty"),
    ],
)
def test_bad_hours_are_refused_with_the_reason(text: str, error: str) -> None:
    with pytest.raises(PreferenceError, match=error):
        parse_hours(text)
    with pytest.raises(SettingsError, match=error):
        load_agent_settings(None, {"run_hours": text})


def test_bad_preferences_fail_when_the_settings_load() -> None:
    with pytest.raises(SettingsError, match="run_when: 'sometimes'"):
        load_agent_settings(None, {"run_when": "sometimes"})
    with pytest.raises(SettingsError, match="not a percentage"):
        load_agent_settings(None, {"evacuate_battery_below": 150})
    prefs = load_agent_settings(
        None, {"pause_while": [" steam ", ""], "run_hours": "8:00-9:00, 22:00-24:00"}
    ).preferences()
    assert prefs.pause_while == {"steam"}
    assert prefs.hours == (Window(480, 540), Window(1320, 0))


@given(st.integers(0, 1439), st.integers(0, 1439), st.integers(0, 1439))
def test_a_window_holds_the_minutes_from_its_start_to_its_end(
    start: int, end: int, minute: int
) -> None:
    if start == end:
        return
    w = parse_hours(str(Window(start, end)))[0]
    assert w == Window(start, end)
    assert (minute in w) == ((minute - start) % 1440 < (end - start) % 1440)


# -- the machine ----------------------------------------------------------------------------


def supply(root: Path, name: str, **files: str) -> None:
    d = root / name
    d.mkdir(parents=True)
    for key, value in files.items():
        (d / key).write_text(value + "\n")


def test_battery_from_power_supply(tmp_path: Path) -> None:
    assert desktop.read_battery(tmp_path / "none") is None
    assert desktop.read_battery(tmp_path) is None
    supply(tmp_path, "AC", type="Mains", online="0")
    supply(
        tmp_path,
        "hidpp_battery_0",
        type="Battery",
        scope="Device",
        status="Discharging",
        capacity="3",
    )  # a mouse's: not the machine's
    assert desktop.read_battery(tmp_path) is None
    supply(
        tmp_path,
        "BAT0",
        type="Battery",
        status="Discharging",
        capacity="40",
        energy_now="20000000",
        energy_full="50000000",
    )
    supply(
        tmp_path,
        "BAT1",
        type="Battery",
        status="Discharging",
        capacity="100",
        energy_now="10000000",
        energy_full="10000000",
    )
    bat = desktop.read_battery(tmp_path)
    assert bat is not None and bat.discharging
    assert bat.percent == pytest.approx(50.0)  # by energy, not the mean of 40 and 100
    (tmp_path / "AC" / "online").write_text("1\n")
    bat = desktop.read_battery(tmp_path)
    assert bat is not None and not bat.discharging


def test_battery_without_energy_files_averages_capacity(tmp_path: Path) -> None:
    supply(tmp_path, "BAT0", type="Battery", status="Discharging", capacity="30")
    supply(tmp_path, "BAT1", type="Battery", status="Full", capacity="50", present="1")
    supply(tmp_path, "BAT2", type="Battery", status="Unknown", capacity="x", present="0")
    assert desktop.read_battery(tmp_path) == Battery(discharging=True, percent=40.0)


@pytest.mark.large
def test_running_programs_by_name_and_argv0(tmp_path: Path) -> None:
    # A real process named like a long program, started here and ended by its pid.
    exe = tmp_path / "a-long-program-name-x"
    exe.symlink_to(sys.executable)
    proc = subprocess.Popen([str(exe), "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        found: frozenset[str] = frozenset()
        while time.monotonic() < deadline and not found:
            found = desktop.running_programs([exe.name, "no-such-program"])
        assert found == {exe.name}
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)
    assert desktop.running_programs([exe.name]) == frozenset()
    assert desktop.running_programs([]) == frozenset()


def test_terminal_idle_is_the_newest_access(tmp_path: Path) -> None:
    assert desktop.terminal_idle(1000.0, tmp_path) is None
    (tmp_path / "pts").mkdir()
    for name, atime in (
        ("tty1", 100.0),
        ("tty2", 700.0),
        ("ttyS0", 990.0),
        ("pts/3", 400.0),
        ("pts/ptmx", 999.0),
    ):
        (tmp_path / name).touch()
        os.utime(tmp_path / name, (atime, atime))
    # ttyS0 (a serial line) and ptmx (the multiplexer) are nobody's keyboard.
    assert desktop.terminal_idle(1000.0, tmp_path) == 300.0
