"""What the agent can see of its owner's machine without asking anyone: the battery, the
programs running, how long since someone typed at a terminal (``manners.Seen``'s inputs).

logind (``logind.py``) says best whether the owner is there: desktops (GNOME, KDE and others,
under Wayland or X11) tell it when their session goes idle, and it says when the machine is
about to sleep. Where there is no logind, or it cannot be reached, the terminals' access times
are the fallback: the kernel updates a terminal's when someone types on it (what ``w`` shows as
IDLE), so they cover consoles and SSH sessions, not a graphical session's mouse.

Everything here reads files only (blocking, short): the agent calls it from a worker thread.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from vpool.worker_agent.manners import Battery

POWER_SUPPLY = Path("/sys/class/power_supply")
PROC = Path("/proc")
DEV = Path("/dev")

_MAINS = ("Mains", "USB", "Wireless")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def read_battery(root: Path = POWER_SUPPLY) -> Battery | None:
    """The machine's battery, as ``/sys/class/power_supply`` shows it; None when it has none.

    Discharging means no mains supply is online and a system battery says "Discharging" (a
    laptop full on its charger says "Full" or "Not charging"). Batteries of devices (a
    mouse: ``scope`` "Device") do not count. Several system batteries: their charge is
    summed by energy (or charge) where every one reports it, else averaged."""
    try:
        supplies = sorted(root.iterdir())
    except OSError:
        return None
    mains_online = False
    discharging = False
    percents: list[float] = []
    full = now = 0.0
    by_energy = True
    batteries = 0
    for supply in supplies:
        kind = _read(supply / "type")
        if kind in _MAINS:
            mains_online |= _read(supply / "online") == "1"
            continue
        if kind != "Battery" or _read(supply / "scope") == "Device":
            continue
        if _read(supply / "present") == "0":
            continue
        batteries += 1
        discharging |= _read(supply / "status") == "Discharging"
        with contextlib.suppress(ValueError):
            percents.append(float(_read(supply / "capacity")))
        pair = _energy(supply)
        if pair is None:
            by_energy = False
        else:
            now, full = now + pair[0], full + pair[1]
    if not batteries:
        return None
    percent: float | None
    if by_energy and full > 0:
        percent = 100.0 * now / full
    elif percents:
        percent = sum(percents) / len(percents)
    else:
        percent = None
    return Battery(discharging=discharging and not mains_online, percent=percent)


def _energy(supply: Path) -> tuple[float, float] | None:
    for now_name, full_name in (("energy_now", "energy_full"), ("charge_now", "charge_full")):
        try:
            return float(_read(supply / now_name)), float(_read(supply / full_name))
        except ValueError:
            continue
    return None


def running_programs(names: Iterable[str], proc: Path = PROC) -> frozenset[str]:
    """Which of ``names`` run now, of anyone's: a process's name (``comm``, which the kernel
    cuts at 15 characters) or the file name of its ``argv[0]`` equal to one."""
    wanted = {n.strip() for n in names if n.strip()}
    if not wanted:
        return frozenset()
    short = {n[:15]: n for n in wanted}
    found: set[str] = set()
    try:
        entries = os.scandir(proc)
    except OSError:
        return frozenset()
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            base = Path(entry.path)
            comm = _read(base / "comm")
            if comm in short:
                found.add(short[comm])
                continue
            try:
                argv0 = (base / "cmdline").read_bytes().split(b"\0", 1)[0]
            except OSError:
                continue
            name = os.path.basename(argv0.decode(errors="replace"))
            if name in wanted:
                found.add(name)
    return frozenset(found)


def terminal_idle(now: float, dev: Path = DEV) -> float | None:
    """Seconds since anyone typed at a terminal (the newest access time of the consoles
    ``/dev/tty[0-9]*`` and pseudo-terminals ``/dev/pts/*``), None when there is none."""
    newest: float | None = None
    candidates: list[Path] = []
    with contextlib.suppress(OSError):
        candidates += [p for p in dev.glob("tty[0-9]*") if p.name[3:].isdigit()]
    with contextlib.suppress(OSError):
        candidates += [p for p in (dev / "pts").iterdir() if p.name.isdigit()]
    for path in candidates:
        try:
            atime = path.stat().st_atime
        except OSError:
            continue
        newest = atime if newest is None else max(newest, atime)
    return None if newest is None else max(0.0, now - newest)


def process_tree(root: int, proc: Path = PROC) -> list[int]:
    """``root`` and every process descended from it (from each process's parent in
    ``/proc/PID/stat``); [] when ``root`` is gone."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.scandir(proc)
    except OSError:
        return []
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            stat = _read(Path(entry.path) / "stat")
            if not stat:
                continue
            fields = stat.rsplit(")", 1)[-1].split()
            with contextlib.suppress(IndexError, ValueError):
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    if not (proc / str(root)).exists():
        return []
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def usage(pids: Iterable[int], proc: Path = PROC) -> tuple[float, int]:
    """CPU seconds (user and system) and resident bytes of ``pids`` together, from
    ``/proc/PID/stat`` and ``statm``; processes gone meanwhile count for nothing."""
    cpu = 0
    rss = 0
    for pid in pids:
        stat = _read(proc / str(pid) / "stat")
        statm = _read(proc / str(pid) / "statm").split()
        with contextlib.suppress(IndexError, ValueError):
            fields = stat.rsplit(")", 1)[1].split()
            cpu += int(fields[11]) + int(fields[12])
        with contextlib.suppress(IndexError, ValueError):
            rss += int(statm[1]) * _PAGE
    return cpu / _TICKS, rss
