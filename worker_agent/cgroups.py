"""A cgroup of its own for each rank: memory, process and CPU limits, events, kill, removal.

Every rank's sandbox runs in a group made for it under the agent's own group of each hierarchy,
``<agent's group>/vpool-agent-<pid>/<name>``: never somewhere the agent is not, so a delegated
subtree (a systemd user service with ``Delegate=yes``) or a container's share is enough. Both
kinds of hierarchy are handled:

- cgroup v2 (unified): one directory. Controllers reach the rank's group only if they are
  enabled in ``cgroup.subtree_control`` of every group above it that we own, and a group with
  processes of its own cannot enable them for its children (the "no internal processes" rule):
  if the agent sits alone in its group it moves itself into ``vpool-agent-<pid>/agent``, as
  systemd's delegation documentation asks of a delegated service.
- cgroup v1: one directory per hierarchy (memory, pids, cpu, freezer), each under the agent's
  own group of that hierarchy (``/proc/self/cgroup`` may show a different path per controller).

A limit is read back after it is set and never assumed (systemd issue 9641: a limit written
into a group whose controller is not delegated fails silently). What did not take is in
``RankCgroup.problems``, and ``probe`` tries a throwaway group to say what this machine gives;
where nothing can be had the caller falls back to rlimits and reports weaker isolation.

Everything here blocks (file writes under ``/sys/fs/cgroup``, short waits for a group to
freeze or empty); the agent calls it from a worker thread.

Errors:

    AgentError
     +-- CgroupError     no group could be made, or one could not be joined, killed or removed
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vpool.worker_agent.errors import AgentError

log = logging.getLogger("vpool.agent")

PROC_CGROUP = Path("/proc/self/cgroup")
PROC_MOUNTINFO = Path("/proc/self/mountinfo")

# The limits a rank's group can carry; v1 needs the freezer besides, to kill without a race.
LIMITING = frozenset({"memory", "pids", "cpu"})
_V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
_V2_CONTROLLERS = ("memory", "pids", "cpu")

# The agent's own leaf under its base when it had to leave its group (v2, see the docstring).
AGENT_LEAF = "agent"

CPU_SHARES_MIN = 2  # v1 cpu.shares: the kernel clamps anything lower to 2
CPU_WEIGHT_MIN = 1  # v2 cpu.weight: 1..10000, 100 by default
# v1 reads "no limit" as the largest page multiple below 2**63 (9223372036854771712).
_UNLIMITED = 1 << 62

_PAGE = os.sysconf("SC_PAGE_SIZE")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+=-]{0,199}")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")

_FREEZE_TIMEOUT = 1.0  # s for a group to freeze before it is killed unfrozen all the same

# Making and removing the shared base directories is serialised: one rank's ``remove`` may
# rmdir an empty base while another rank's ``create`` is about to make its group in it.
_BASE_LOCK = threading.Lock()


class CgroupError(AgentError):
    """No cgroup could be made, joined, killed or removed; the message says which and why."""


@dataclass(frozen=True)
class Limits:
    """What a rank's group allows: bytes of memory (no swap), processes and threads."""

    memory: int | None = None
    pids: int | None = None
    cpu_weight_low: bool = True  # the lowest CPU weight: the volunteer's work always comes first

    def __post_init__(self) -> None:
        if self.memory is not None and self.memory < _PAGE:
            raise ValueError(f"a memory limit of {self.memory} bytes is below one page")
        if self.pids is not None and self.pids < 1:
            raise ValueError(f"a limit of {self.pids} processes leaves none")


@dataclass(frozen=True)
class Support:
    """What ``probe`` found: the hierarchy version (0: none), what it limits, what is missing."""

    version: int
    controllers: frozenset[str]  # of LIMITING, each set and read back on a real group
    reason: str = ""  # why something is missing ("" when all is there)


@dataclass(frozen=True)
class Events:
    """What happened in a rank's group. None: this group has no such counter."""

    oom_kills: int | None  # processes the OOM killer ended for the group's memory limit
    memory_max_hits: int | None  # times usage reached the limit (v1 memory.failcnt, v2 "max")
    pids_max_hits: int | None  # forks and clones refused by pids.max (EAGAIN)
    memory_peak: int | None  # bytes at most in use


# -- parsing the kernel's files -----------------------------------------------------------------


@dataclass(frozen=True)
class ProcCgroupLine:
    """One line of ``/proc/<pid>/cgroup``: ``hierarchy-id:controllers:path``."""

    hierarchy: int  # 0: the unified (v2) hierarchy
    controllers: tuple[str, ...]  # v1 controllers (or "name=..."); () on the v2 line
    path: str  # relative to the cgroup namespace's root


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup filesystem in ``/proc/self/mountinfo``."""

    version: int
    root: str  # the group of the hierarchy that is this mount's top directory
    mount_point: str
    options: frozenset[str]  # the superblock's options: v1 controllers and "name=..."


def parse_proc_cgroup(text: str) -> list[ProcCgroupLine]:
    """The lines of ``/proc/<pid>/cgroup`` (raises ``CgroupError`` on one it cannot read)."""
    lines = []
    for line in text.splitlines():
        if not line.strip():
            continue
        # A path may itself hold colons; the first two separate the fields.
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[0].isdigit() or not parts[2].startswith("/"):
            raise CgroupError(f"unexpected line in /proc/self/cgroup: {line!r}")
        controllers = tuple(c for c in parts[1].split(",") if c)
        lines.append(ProcCgroupLine(int(parts[0]), controllers, parts[2]))
    return lines


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup and cgroup2 mounts of a ``/proc/<pid>/mountinfo``."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        # Optional fields come before the "-" separator, so fstype is found from it.
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 4:
            continue
        fstype = fields[sep + 1]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        mounts.append(
            CgroupMount(
                version=2 if fstype == "cgroup2" else 1,
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                options=frozenset(fields[sep + 3].split(",")),
            )
        )
    return mounts


def parse_keyed(text: str) -> dict[str, int]:
    """``key value`` lines (memory.events, pids.events, memory.oom_control, cgroup.events)."""
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            values[parts[0]] = int(parts[1])
    return values


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes.
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


# -- files --------------------------------------------------------------------------------------


def _read(path: Path) -> str:
    return path.read_text()


def _write(path: Path, value: str) -> None:
    # One write(2) per value: a cgroup file takes each write as one command, and the error
    # (EBUSY, EINVAL, ...) comes from that write rather than from a buffered close.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_limit(path: Path) -> int | None:
    """A limit file's value; None for no limit (v2 "max", v1's near-2**63)."""
    text = _read(path).strip()
    if text == "max":
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


# The rank groups this process made and has not removed.
_MADE: set[Path] = set()


def _read_procs(path: Path) -> list[int]:
    try:
        return [int(line) for line in _read(path).split()]
    except FileNotFoundError:
        return []


def _make_group(group: Path) -> None:
    """mkdir ``group``. One this process made and has not removed is in use: refused
    (``FileExistsError``), as is one with processes in it. Any other one is a leftover of an
    earlier agent that had this pid (an agent killed with SIGKILL leaves its groups behind,
    and pids are reused): it is removed and made again."""
    try:
        group.mkdir()
    except FileExistsError:
        if group in _MADE or _read_procs(group / "cgroup.procs"):
            raise
        log.info("removing %s, left by an earlier agent with this pid", group)
        try:
            group.rmdir()
        except OSError as exc:
            raise FileExistsError(f"{group} is left over and cannot be removed: {exc}") from exc
        group.mkdir()
    _MADE.add(group)


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _wait_for(done: Callable[[], bool], timeout: float) -> bool:
    """Whether ``done()`` came true within ``timeout`` s (polled: the kernel has no event for
    v1's freezer or an empty v1 group)."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True


# -- where the groups go ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Hierarchy:
    own: Path  # the agent's current group in this hierarchy (its directory)
    controllers: frozenset[str]  # the controllers of ours this hierarchy has (v1) or offers (v2)


@dataclass(frozen=True)
class _Layout:
    version: int
    hierarchies: tuple[_Hierarchy, ...]
    missing: dict[str, str]  # controller -> why the rank's group will not have it

    def limiting(self) -> int:
        return sum(len(h.controllers & LIMITING) for h in self.hierarchies)


def _base_name() -> str:
    return f"vpool-agent-{os.getpid()}"


def group_directory(mounts: list[CgroupMount], path: str) -> Path | None:
    """The directory of group ``path`` in the first of ``mounts`` that shows it."""
    for mount in mounts:
        root = mount.root.rstrip("/")
        if path != root and not path.startswith(root + "/"):
            continue  # this mount shows another part of the hierarchy
        directory = Path(mount.mount_point, path[len(root) :].lstrip("/"))
        if directory.is_dir():
            return directory
    return None


def _v1_layout(lines: list[ProcCgroupLine], mounts: list[CgroupMount]) -> _Layout:
    found: dict[Path, set[str]] = {}
    missing = {}
    for controller in _V1_CONTROLLERS:
        line = next((ln for ln in lines if ln.hierarchy and controller in ln.controllers), None)
        if line is None:
            missing[controller] = f"no cgroup v1 hierarchy has the {controller} controller"
            continue
        candidates = [m for m in mounts if m.version == 1 and set(line.controllers) <= m.options]
        own = group_directory(candidates, line.path)
        if own is None:
            missing[controller] = (
                f"the agent's {controller} group {line.path} is not in any mounted hierarchy"
            )
            continue
        found.setdefault(own, set()).add(controller)
    hierarchies = tuple(_Hierarchy(own, frozenset(c)) for own, c in found.items())
    return _Layout(1, hierarchies, missing)


def _v2_layout(lines: list[ProcCgroupLine], mounts: list[CgroupMount]) -> _Layout:
    line = next((ln for ln in lines if ln.hierarchy == 0 and not ln.controllers), None)
    if line is None:
        return _Layout(2, (), {"": "the agent is in no cgroup v2 group"})
    path = line.path
    # Where a previous call moved the agent (see the module docstring), its group is above.
    leaf = f"/{_base_name()}/{AGENT_LEAF}"
    if path.endswith(leaf):
        path = path[: -len(leaf)] or "/"
    own = group_directory([m for m in mounts if m.version == 2], path)
    if own is None:
        return _Layout(2, (), {"": f"the agent's cgroup v2 group {path} is not mounted"})
    try:
        offered = frozenset(_read(own / "cgroup.controllers").split())
    except OSError as exc:
        return _Layout(2, (), {"": f"cannot read {own}/cgroup.controllers: {_describe(exc)}"})
    missing = {
        c: f"the {c} controller is not delegated to the agent's group {own}"
        for c in _V2_CONTROLLERS
        if c not in offered
    }
    return _Layout(2, (_Hierarchy(own, offered & frozenset(_V2_CONTROLLERS)),), missing)


def _layout(version: int | None) -> _Layout:
    """Where this process's groups are, in the hierarchy ``version`` or the one that limits
    the most (v2 on a tie: one directory, and cgroup.kill)."""
    try:
        lines = parse_proc_cgroup(_read(PROC_CGROUP))
        mounts = parse_mountinfo(_read(PROC_MOUNTINFO))
    except OSError as exc:
        raise CgroupError(f"cannot read this process's cgroups: {_describe(exc)}") from exc
    candidates = []
    for v, make in ((2, _v2_layout), (1, _v1_layout)):
        if version in (None, v) and any(m.version == v for m in mounts):
            candidates.append(make(lines, mounts))
    usable = [c for c in candidates if c.hierarchies]
    if not usable:
        wanted = f"cgroup v{version}" if version else "cgroup"
        reasons = "; ".join(r for c in candidates for r in c.missing.values()) or "none is mounted"
        raise CgroupError(f"no {wanted} hierarchy is usable: {reasons}")
    return max(usable, key=lambda c: (c.limiting(), c.version))


# -- the groups ---------------------------------------------------------------------------------


def _enable(group: Path, controller: str) -> None:
    _write(group / "cgroup.subtree_control", f"+{controller}")


def _enabled(group: Path) -> frozenset[str]:
    return frozenset(_read(group / "cgroup.subtree_control").split())


def _prepare_v2(hierarchy: _Hierarchy, missing: dict[str, str]) -> Path:
    """The base for the agent's groups with our controllers enabled down to it (v2); the
    controllers that could not be enabled go to ``missing``."""
    own = hierarchy.own
    base = own / _base_name()
    try:
        base.mkdir(exist_ok=True)
    except OSError as exc:
        raise CgroupError(f"cannot create {base}: {_describe(exc)}") from exc
    for controller in sorted(hierarchy.controllers):
        try:
            if controller in _enabled(own):
                continue
            try:
                _enable(own, controller)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                # The agent's group has processes (the agent at least); leave it.
                _leave_own_group(own, base)
                _enable(own, controller)
        except OSError as exc:
            missing[controller] = (
                f"cannot enable the {controller} controller in {own}/cgroup.subtree_control: "
                f"{_describe(exc)}"
            )
    for controller in sorted(hierarchy.controllers - missing.keys()):
        try:
            if controller not in _enabled(base):
                _enable(base, controller)
        except OSError as exc:
            missing[controller] = (
                f"cannot enable the {controller} controller in {base}/cgroup.subtree_control: "
                f"{_describe(exc)}"
            )
    return base


def _leave_own_group(own: Path, base: Path) -> None:
    """Move the agent into ``base/agent`` so that ``own`` has no processes of its own."""
    others = set(_read_procs(own / "cgroup.procs")) - {os.getpid()}
    if others:
        # Not ours to move: whoever started them put them there. The agent stays too, as
        # moving it alone would not free the group.
        raise OSError(
            errno.EBUSY,
            f"the agent's group {own} holds other processes ({len(others)}), so it cannot "
            "enable controllers for its children",
        )
    leaf = base / AGENT_LEAF
    leaf.mkdir(exist_ok=True)
    try:
        _write(leaf / "cgroup.procs", str(os.getpid()))
    except OSError:
        # An empty leaf would keep the base from ever being removed (``_remove_dirs``).
        with contextlib.suppress(OSError):
            leaf.rmdir()
        raise
    log.info("moved the agent into %s to enable controllers in %s", leaf, own)


class RankCgroup:
    """One rank's group: a directory per hierarchy (v1) or one (v2), limits already set.

    ``problems`` says what did not take (each a sentence); ``limits_applied`` what reading
    back gave. Made by ``create``, ended by ``kill_all`` and ``remove``."""

    def __init__(
        self,
        name: str,
        version: int,
        dirs: dict[Path, frozenset[str]],
        applied: dict[str, int | None],
        problems: tuple[str, ...],
    ) -> None:
        self.name = name
        self.version = version
        self._dirs = dirs  # group directory -> the controllers it holds
        self._applied = applied
        self.problems = problems

    def __repr__(self) -> str:
        return f"<RankCgroup v{self.version} {' '.join(str(d) for d in self._dirs)}>"

    @classmethod
    def create(cls, name: str, limits: Limits, *, version: int | None = None) -> RankCgroup:
        """Make group ``name`` under the agent's own groups and set ``limits`` in it.

        ``version`` insists on cgroup v1 or v2 (None: the one that limits the most). Raises
        ``CgroupError`` if no group can be made at all; a limit that does not take is in
        ``problems`` instead."""
        if not _NAME.fullmatch(name) or name == AGENT_LEAF:
            raise ValueError(f"{name!r} is not a usable cgroup name")
        layout = _layout(version)
        missing = dict(layout.missing)
        dirs: dict[Path, frozenset[str]] = {}
        with _BASE_LOCK:
            try:
                for hierarchy in layout.hierarchies:
                    if layout.version == 2:
                        base = _prepare_v2(hierarchy, missing)
                    else:
                        base = hierarchy.own / _base_name()
                    group = base / name
                    try:
                        if layout.version == 1:
                            base.mkdir(exist_ok=True)
                        _make_group(group)
                    except FileExistsError as exc:
                        raise CgroupError(f"{group} exists already") from exc
                    except OSError as exc:
                        if layout.version == 2:
                            raise CgroupError(f"cannot create {group}: {_describe(exc)}") from exc
                        # v1: the other hierarchies may still do.
                        for controller in hierarchy.controllers:
                            missing[controller] = f"cannot create {group}: {_describe(exc)}"
                        continue
                    dirs[group] = hierarchy.controllers
                    if layout.version == 2:
                        # What the rank's group really got, whatever enabling them said.
                        try:
                            dirs[group] = frozenset(_read(group / "cgroup.controllers").split())
                        except OSError as exc:
                            raise CgroupError(
                                f"cannot read {group}/cgroup.controllers: {_describe(exc)}"
                            ) from exc
            except BaseException:
                _remove_dirs(dirs)
                raise
        if not dirs:
            raise CgroupError("no cgroup could be created: " + "; ".join(missing.values()))
        applied, problems = _set_limits(layout.version, dirs, limits, missing)
        # The freezer, or a controller no limit was asked of, still says what is missing.
        problems += [why for c, why in missing.items() if c not in applied]
        made = cls(name, layout.version, dirs, applied, tuple(problems))
        if problems:
            log.info("cgroup %s: %s", made, "; ".join(problems))
        return made

    def limits_applied(self) -> dict[str, int | None]:
        """Each limit asked for ("memory", "pids", "cpu") as read back after setting it, in
        the file's own unit (v1 cpu.shares, v2 cpu.weight); None: it did not take."""
        return dict(self._applied)

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a freshly forked child writes its own pid into (one per
        v1 hierarchy, one for v2) to be in this group before it execs anything."""
        return [str(d / "cgroup.procs") for d in self._dirs]

    def attach(self, pid: int) -> None:
        """Move process ``pid`` into this group (its threads too)."""
        for path in self.procs_files():
            try:
                _write(Path(path), str(pid))
            except OSError as exc:
                raise CgroupError(
                    f"cannot move process {pid} into {path}: {_describe(exc)}"
                ) from exc

    def pids(self) -> list[int]:
        """The processes in this group now (in any of its hierarchies)."""
        found: set[int] = set()
        for group in self._dirs:
            try:
                found.update(_read_procs(group / "cgroup.procs"))
            except OSError as exc:
                raise CgroupError(f"cannot read {group}/cgroup.procs: {_describe(exc)}") from exc
        return sorted(found)

    def events(self) -> Events:
        """The group's counters: did the rank meet its memory or its process limit?"""
        memory = self._dir_of("memory")
        pids = self._dir_of("pids")
        pids_events = self._keyed(pids, "pids.events") if pids else None
        pids_max = pids_events.get("max") if pids_events is not None else None
        if memory is None:
            return Events(None, None, pids_max, None)
        if self.version == 1:
            oom = self._keyed(memory, "memory.oom_control")
            return Events(
                oom_kills=oom.get("oom_kill") if oom is not None else None,
                memory_max_hits=self._number(memory, "memory.failcnt"),
                pids_max_hits=pids_max,
                memory_peak=self._number(memory, "memory.max_usage_in_bytes"),
            )
        mem_events = self._keyed(memory, "memory.events")
        return Events(
            oom_kills=mem_events.get("oom_kill") if mem_events is not None else None,
            memory_max_hits=mem_events.get("max") if mem_events is not None else None,
            pids_max_hits=pids_max,
            memory_peak=self._number(memory, "memory.peak"),  # kernels from 5.19
        )

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the group and wait (up to ``timeout`` s) until it is empty.

        v2 uses ``cgroup.kill`` where the kernel has it (5.14): atomic, forks included.
        Otherwise the group is frozen first so that nothing in it can fork while its members
        are signalled, then thawed so that the kills take effect."""
        deadline = time.monotonic() + timeout
        if not self.pids():
            return
        group = next(iter(self._dirs))
        if self.version == 2 and (group / "cgroup.kill").exists():
            try:
                _write(group / "cgroup.kill", "1")
            except FileNotFoundError:
                return  # removed already: nothing is left in it
            except OSError as exc:
                raise CgroupError(f"cannot write {group}/cgroup.kill: {_describe(exc)}") from exc
        else:
            self._kill_frozen()
        # Whatever a freeze did not hold (v1 without a freezer, a freeze that timed out)
        # may have forked meanwhile: signalled again until nothing is left.
        while self._signal_members(signal.SIGKILL):
            if time.monotonic() >= deadline:
                raise CgroupError(
                    f"processes {self.pids()} are still in {self} {timeout} s after SIGKILL"
                )
            _wait_for(lambda: not self.pids(), min(0.05, max(0.0, deadline - time.monotonic())))

    def remove(self, timeout: float = 2.0) -> None:
        """Remove the group once it is empty (waiting up to ``timeout`` s for its processes to
        end), and the agent's base with it when no other group is left there. A group that is
        gone already is fine; one that stays busy raises ``CgroupError``."""
        _wait_for(lambda: not self.pids(), timeout)
        with _BASE_LOCK:
            failed = _remove_dirs(self._dirs)
        if failed:
            raise CgroupError(f"cannot remove {', '.join(failed)} (processes {self.pids()} left)")

    # -- inside --------------------------------------------------------------------------------

    def _dir_of(self, controller: str) -> Path | None:
        return next((d for d, c in self._dirs.items() if controller in c), None)

    def _keyed(self, group: Path, name: str) -> dict[str, int] | None:
        try:
            return parse_keyed(_read(group / name))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CgroupError(f"cannot read {group}/{name}: {_describe(exc)}") from exc

    def _number(self, group: Path, name: str) -> int | None:
        try:
            return int(_read(group / name))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise CgroupError(f"cannot read {group}/{name}: {exc}") from exc

    def _kill_frozen(self) -> None:
        """Freeze (where there is a freezer), SIGKILL every member, thaw."""
        with self._frozen():
            self._signal_members(signal.SIGKILL)

    @property
    def can_freeze(self) -> bool:
        """The group has a freezer (v2 always; v1 when the freezer hierarchy is ours)."""
        return self._freezer() is not None

    def freeze(self, frozen: bool, timeout: float = _FREEZE_TIMEOUT) -> bool:
        """Freeze every process of the group (``frozen``) or thaw them; whether the kernel
        says the group reached that state within ``timeout`` s. The rank's suspension
        (``suspend.py``): a frozen process takes no CPU, and does not know it was frozen."""
        freezer = self._freezer()
        if freezer is None:
            raise CgroupError(f"{self} has no freezer")
        state, on, off, is_frozen = freezer
        try:
            _write(state, on if frozen else off)
        except OSError as exc:
            verb = "freeze" if frozen else "thaw"
            raise CgroupError(f"cannot {verb} {self}: {_describe(exc)}") from exc
        return _wait_for(lambda: is_frozen() == frozen, timeout)

    def _freezer(self) -> tuple[Path, str, str, Callable[[], bool]] | None:
        """(state file, value to freeze, value to thaw, whether it is frozen) or None."""
        if self.version == 2:
            group = next(iter(self._dirs))

            def frozen_v2() -> bool:
                try:
                    return parse_keyed(_read(group / "cgroup.events")).get("frozen") == 1
                except OSError:
                    return True  # gone, or unreadable: no use waiting for it

            return group / "cgroup.freeze", "1", "0", frozen_v2
        freezer = self._dir_of("freezer")
        if freezer is None:
            return None
        state = freezer / "freezer.state"

        def frozen_v1() -> bool:
            try:
                return _read(state).strip() == "FROZEN"
            except OSError:
                return True  # gone, or unreadable: no use waiting for it

        return state, "FROZEN", "THAWED", frozen_v1

    @contextlib.contextmanager
    def _frozen(self) -> Iterator[None]:
        freezer = self._freezer()
        if freezer is None:
            yield
            return
        state, on, off, frozen = freezer
        try:
            _write(state, on)
        except OSError as exc:
            log.warning("cannot freeze %s (killing it unfrozen): %s", self, _describe(exc))
            on = ""
        try:
            if on and not _wait_for(frozen, _FREEZE_TIMEOUT):
                log.warning("%s did not freeze within %s s", self, _FREEZE_TIMEOUT)
            yield
        finally:
            if on:
                with contextlib.suppress(FileNotFoundError):
                    _write(state, off)

    def _signal_members(self, sig: int) -> bool:
        """Send ``sig`` to every process in the group; whether there were any.

        Pid reuse cannot make us signal a stranger: each pid is pinned with a pidfd first,
        and only those still listed in the group after that are signalled."""
        listed = self.pids()
        if not listed:
            return False
        pidfds: dict[int, int] = {}
        try:
            for pid in listed:
                with contextlib.suppress(ProcessLookupError):
                    pidfds[pid] = os.pidfd_open(pid)
            members = set(self.pids())
            for pid, fd in pidfds.items():
                if pid in members:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, sig)
        except OSError as exc:
            raise CgroupError(f"cannot signal the processes of {self}: {_describe(exc)}") from exc
        finally:
            for fd in pidfds.values():
                os.close(fd)
        return True


def _set_limits(
    version: int, dirs: dict[Path, frozenset[str]], limits: Limits, missing: dict[str, str]
) -> tuple[dict[str, int | None], list[str]]:
    """Write ``limits`` into the groups and read each back: what each read back gave, and
    what did not take (with its cause from ``missing`` when the controller is not there)."""

    def group_of(controller: str) -> Path | None:
        return next((d for d, c in dirs.items() if controller in c), None)

    # (limit, controller, file, value, best-effort extras written after it with the same value)
    wanted: list[tuple[str, str, str, int, tuple[tuple[str, int], ...]]] = []
    if limits.memory is not None:
        memory = limits.memory // _PAGE * _PAGE  # the kernel rounds down to pages: so do we
        # No swap either (v1: memsw is memory plus swap; absent without swap accounting).
        if version == 1:
            no_swap = (("memory.memsw.limit_in_bytes", memory),)
            wanted.append(("memory", "memory", "memory.limit_in_bytes", memory, no_swap))
        else:
            no_swap = (("memory.swap.max", 0),)
            wanted.append(("memory", "memory", "memory.max", memory, no_swap))
    if limits.pids is not None:
        wanted.append(("pids", "pids", "pids.max", limits.pids, ()))
    if limits.cpu_weight_low:
        if version == 1:
            wanted.append(("cpu", "cpu", "cpu.shares", CPU_SHARES_MIN, ()))
        else:
            wanted.append(("cpu", "cpu", "cpu.weight", CPU_WEIGHT_MIN, ()))
    applied: dict[str, int | None] = {}
    problems = []
    for limit, controller, name, value, extras in wanted:
        group = group_of(controller)
        applied[limit] = None
        if group is None or not (group / name).exists():
            why = missing.get(controller, f"the rank's group has no {controller} controller")
            problems.append(f"{why}: no {limit} limit")
            continue
        try:
            _write(group / name, str(value))
            for extra, extra_value in extras:
                with contextlib.suppress(OSError):
                    _write(group / extra, str(extra_value))
            got = _read_limit(group / name)
        except (OSError, ValueError) as exc:
            problems.append(f"cannot set {group}/{name} to {value}: {exc}")
            continue
        applied[limit] = got
        if got != value:
            problems.append(f"{group}/{name} reads back {got} after {value} was written")
        if limit == "cpu":
            # The ranks' parent too: CPU is shared out between siblings first, and the base
            # at the default weight would get a busy rank a quarter of a CPU against the
            # volunteer's processes (issue 35). The agent, in the base's leaf on v2, yields
            # as well: it only serves the ranks.
            try:
                _write(group.parent / name, str(value))
            except OSError as exc:
                problems.append(f"cannot set {group.parent}/{name} to {value}: {exc}")
    return applied, problems


def _remove_dirs(dirs: dict[Path, frozenset[str]]) -> list[str]:
    """rmdir each group and then its base if that is empty; the groups that stay."""
    failed = []
    for group in dirs:
        try:
            group.rmdir()
            _MADE.discard(group)
        except FileNotFoundError:
            _MADE.discard(group)
        except OSError as exc:
            failed.append(f"{group} ({_describe(exc)})")
            continue
        # The base goes with its last group; busy or not empty means others still use it.
        with contextlib.suppress(OSError):
            if group.parent.name == _base_name() and not (group.parent / AGENT_LEAF).exists():
                group.parent.rmdir()
    return failed


_BASE_NAME = re.compile(r"vpool-agent-(\d+)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(version: int | None = None) -> list[Path]:
    """Remove what agents that are gone left (killed before they could remove their groups):
    each ``vpool-agent-<pid>`` next to this agent's base whose process is gone, with every
    group in it. The kernel refuses to remove a group that has processes, so whatever still
    runs keeps its group; only empty ones go. The bases removed."""
    try:
        layout = _layout(version)
    except CgroupError:
        return []
    removed = []
    with _BASE_LOCK:
        for hierarchy in layout.hierarchies:
            try:
                bases = [d for d in hierarchy.own.iterdir() if _BASE_NAME.fullmatch(d.name)]
            except OSError:
                continue
            for base in bases:
                pid = int(base.name.rsplit("-", 1)[1])
                if pid == os.getpid() or _alive(pid):
                    continue
                for directory, _, _ in os.walk(base, topdown=False):
                    with contextlib.suppress(OSError):
                        os.rmdir(directory)
                if not base.exists():
                    removed.append(base)
    return removed


def probe(version: int | None = None) -> Support:
    """What this machine gives: a throwaway group is made, limited, read back and removed."""
    name = f"probe-{uuid.uuid4().hex[:12]}"
    try:
        group = RankCgroup.create(name, Limits(memory=64 << 20, pids=64), version=version)
    except CgroupError as exc:
        return Support(0, frozenset(), str(exc))
    problems = list(group.problems)
    try:
        group.remove()
    except CgroupError as exc:
        problems.append(str(exc))
    controllers = frozenset(k for k, v in group.limits_applied().items() if v is not None)
    return Support(group.version, controllers, "; ".join(problems))
