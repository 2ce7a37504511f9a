"""A rank's cgroup, with real cgroups and real processes.

The parsing of the kernel's files is tested with fixed text. The rest makes real groups under
this process's own groups (as root; v1 on this machine and CI, v2 where it can be had) and
runs real children in them: a limit is read back, a child that allocates past its memory limit
is OOM-killed, one that forks past its process limit gets EAGAIN, ``kill_all`` ends a tree
whose grandchild left its parent, and ``remove`` leaves nothing behind. Every group a test
makes is killed and removed by the fixture, whatever the test's end.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vpool.worker_agent import cgroups
from vpool.worker_agent.cgroups import CgroupError, Limits, RankCgroup

MiB = 1 << 20
TIMEOUT = 60.0  # s for any child to reach the outcome a test waits for

# The machine to itself: sweep() takes any dead agent's groups (another pytest worker's agents
# sweep at start); the OOM and freezer tests fill memory and measure CPU time.
pytestmark = pytest.mark.exclusive

# -- the kernel's files, parsed -----------------------------------------------------------------

THIS_MACHINE = """\
9:name=systemd:/
8:pids:/
6:freezer:/
4:memory:/process_api/898f2b481dd5f0386fcc07c6a523a95e
2:cpu,cpuacct:/
0::/
"""


def test_proc_cgroup_v1_lines_keep_their_controllers_and_paths() -> None:
    lines = cgroups.parse_proc_cgroup(THIS_MACHINE)
    assert lines[0] == cgroups.ProcCgroupLine(9, ("name=systemd",), "/")
    assert lines[2] == cgroups.ProcCgroupLine(6, ("freezer",), "/")
    assert lines[3] == cgroups.ProcCgroupLine(
        4, ("memory",), "/process_api/898f2b481dd5f0386fcc07c6a523a95e"
    )
    assert lines[4] == cgroups.ProcCgroupLine(2, ("cpu", "cpuacct"), "/")
    assert lines[5] == cgroups.ProcCgroupLine(0, (), "/")


def test_proc_cgroup_v2_line_of_a_user_service() -> None:
    path = "/user.slice/user-1000.slice/user@1000.service/app.slice/vpool-agent.service"
    assert cgroups.parse_proc_cgroup(f"0::{path}\n") == [cgroups.ProcCgroupLine(0, (), path)]


def test_proc_cgroup_path_may_hold_colons() -> None:
    assert cgroups.parse_proc_cgroup("0::/a:b/c") == [cgroups.ProcCgroupLine(0, (), "/a:b/c")]


@pytest.mark.parametrize("line", ["0:/", "x::/", "4:memory:relative", "garbage"])
def test_proc_cgroup_line_it_cannot_read_is_an_error(line: str) -> None:
    with pytest.raises(CgroupError, match="unexpected line"):
        cgroups.parse_proc_cgroup(line)


def test_mountinfo_gives_cgroup_mounts_with_roots_options_and_unescaped_paths() -> None:
    text = (
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /cg/cpu,cpuacct rw,relatime shared:7 - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:32 /process_api /mnt/my\\040cgroups rw master:3 - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    assert cgroups.parse_mountinfo(text) == [
        cgroups.CgroupMount(1, "/", "/cg/cpu,cpuacct", frozenset({"rw", "cpu", "cpuacct"})),
        cgroups.CgroupMount(1, "/process_api", "/mnt/my cgroups", frozenset({"rw", "memory"})),
        cgroups.CgroupMount(2, "/", "/sys/fs/cgroup/unified", frozenset({"rw", "nsdelegate"})),
    ]


def test_group_directory_follows_the_mount_root(tmp_path: Path) -> None:
    (tmp_path / "whole" / "process_api" / "x").mkdir(parents=True)
    (tmp_path / "part" / "x").mkdir(parents=True)
    whole = cgroups.CgroupMount(1, "/", str(tmp_path / "whole"), frozenset({"memory"}))
    part = cgroups.CgroupMount(1, "/process_api", str(tmp_path / "part"), frozenset({"memory"}))
    assert cgroups.group_directory([whole], "/process_api/x") == tmp_path / "whole/process_api/x"
    assert cgroups.group_directory([part], "/process_api/x") == tmp_path / "part/x"
    assert cgroups.group_directory([part], "/process_api") == tmp_path / "part"
    # A mount of another part of the hierarchy does not show the group, nor a look-alike name.
    assert cgroups.group_directory([part], "/other/x") is None
    assert cgroups.group_directory([part], "/process_api2/x") is None


def test_keyed_files() -> None:
    oom_control = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
    assert cgroups.parse_keyed(oom_control) == {
        "oom_kill_disable": 0,
        "under_oom": 0,
        "oom_kill": 3,
    }
    memory_events = "low 0\nhigh 0\nmax 41\noom 2\noom_kill 2\noom_group_kill 0\n"
    assert cgroups.parse_keyed(memory_events)["oom_kill"] == 2
    assert cgroups.parse_keyed(memory_events)["max"] == 41
    assert cgroups.parse_keyed("max 5\nmax.imposed 1\n") == {"max": 5, "max.imposed": 1}
    assert cgroups.parse_keyed("populated 1\nfrozen 0\n")["frozen"] == 0
    assert cgroups.parse_keyed("") == {}


def test_limits_refuse_what_leaves_nothing() -> None:
    with pytest.raises(ValueError, match="below one page"):
        Limits(memory=100)
    with pytest.raises(ValueError, match="leaves none"):
        Limits(pids=0)


def test_a_name_that_is_not_one_directory_is_refused() -> None:
    for name in ("", "..", "a/b", ".hidden", cgroups.AGENT_LEAF):
        with pytest.raises(ValueError, match="not a usable cgroup name"):
            RankCgroup.create(name, Limits())


# -- real groups --------------------------------------------------------------------------------


def _offered(version: int) -> frozenset[str] | None:
    """The limiting controllers hierarchy ``version`` has for this process (None: it is not
    there), found without the module under test: were ``probe`` asked, a limit that stopped
    taking would skip these tests instead of failing them."""
    mounts = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    if version == 1:
        found = {c for m in mounts if m.version == 1 for c in m.options & cgroups.LIMITING}
        return frozenset(found) if found else None
    lines = cgroups.parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    line = next((ln for ln in lines if ln.hierarchy == 0), None)
    v2 = [m for m in mounts if m.version == 2]
    own = cgroups.group_directory(v2, line.path) if line is not None else None
    if own is None:
        return None
    return frozenset((own / "cgroup.controllers").read_text().split()) & cgroups.LIMITING


def _usable(version: int) -> frozenset[str]:
    if os.geteuid() != 0:
        pytest.skip("real cgroups need root here (no delegated subtree is set up for tests)")
    offered = _offered(version)
    if offered is None:
        pytest.skip(f"this process is in no mounted cgroup v{version} hierarchy")
    return offered


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def version(request: pytest.FixtureRequest) -> int:
    v: int = request.param
    _usable(v)
    return v


@pytest.fixture
def make_group(version: int) -> Iterator[Callable[[Limits], RankCgroup]]:
    made: list[RankCgroup] = []

    def make(limits: Limits) -> RankCgroup:
        group = RankCgroup.create(f"test-{uuid.uuid4().hex[:10]}", limits, version=version)
        made.append(group)
        assert group.version == version
        return group

    yield make
    for group in made:
        try:
            group.kill_all()
        finally:
            group.remove()


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Children running ``python -c program``, killed and waited for at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(program: str, join: RankCgroup | None = None) -> subprocess.Popen[str]:
        procs = join.procs_files() if join is not None else []
        proc = subprocess.Popen(
            [sys.executable, "-c", program],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # As the agent starts a sandbox: in the group before anything runs.
            preexec_fn=(lambda: _join(procs)) if procs else None,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=TIMEOUT)


def _join(procs: list[str]) -> None:
    pid = str(os.getpid()).encode()
    for path in procs:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)


def _read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
    assert ready, f"no line from the child within {TIMEOUT} s"
    return proc.stdout.readline()


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out


def _needs(version: int, controller: str) -> None:
    if controller not in _usable(version):
        pytest.skip(f"the {controller} controller is not in this process's cgroup v{version}")


def _base_dirs(group: RankCgroup) -> list[Path]:
    return [Path(p).parent.parent for p in group.procs_files()]


def test_probe_finds_the_hierarchy_that_limits_memory_pids_and_cpu() -> None:
    if os.geteuid() != 0:
        pytest.skip("real cgroups need root here (no delegated subtree is set up for tests)")
    mounts = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    if not mounts:
        pytest.skip("no cgroup hierarchy is mounted")
    # A controller belongs to one hierarchy: a v1 memory mount means v2 cannot have it.
    expected = 1 if any(m.version == 1 and "memory" in m.options for m in mounts) else 2
    support = cgroups.probe()
    assert support == cgroups.Support(expected, frozenset({"memory", "pids", "cpu"}), "")
    leftovers = [d for m in mounts for d in Path(m.mount_point).rglob(f"vpool-agent-{os.getpid()}")]
    assert leftovers == []


def test_groups_are_made_under_the_agents_own_groups(version: int) -> None:
    group = RankCgroup.create("test-placement", Limits(), version=version)
    try:
        lines = cgroups.parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
        mounts = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
        own = set()
        for line in lines:
            if (version == 2) == (line.hierarchy == 0):
                kind = [
                    m for m in mounts if m.version == version and set(line.controllers) <= m.options
                ]
                directory = cgroups.group_directory(kind, line.path)
                if directory is not None:
                    own.add(directory)
        dirs = [Path(p).parent for p in group.procs_files()]
        assert dirs
        for d in dirs:
            assert d.name == "test-placement"
            assert d.parent.name == f"vpool-agent-{os.getpid()}"
            assert d.parent.parent in own, (d, own)
    finally:
        group.remove()


def test_a_group_left_by_an_earlier_agent_with_this_pid_is_made_again(version: int) -> None:
    # An agent killed with SIGKILL leaves its groups; a later agent may get its pid.
    stale = RankCgroup.create("test-left-over", Limits(), version=version)
    cgroups._MADE.clear()  # this process is now that later agent: it made none of them
    again = RankCgroup.create("test-left-over", Limits(pids=32), version=version)
    try:
        assert again.limits_applied()["pids"] == 32 or again.problems
        assert again.procs_files() == stale.procs_files()
    finally:
        again.remove()


@pytest.mark.large
def test_a_group_with_processes_in_it_is_never_taken_over(version: int) -> None:
    busy = RankCgroup.create("test-busy", Limits(), version=version)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        busy.attach(proc.pid)
        cgroups._MADE.clear()  # as for a later agent: what makes it refuse is the process
        with pytest.raises(cgroups.CgroupError, match="exists already"):
            RankCgroup.create("test-busy", Limits(), version=version)
    finally:
        proc.kill()
        proc.wait()
        busy.remove()


def test_limits_read_back_as_set_or_are_reported(
    version: int, make_group: Callable[[Limits], RankCgroup]
) -> None:
    group = make_group(Limits(memory=64 * MiB, pids=8))
    applied = group.limits_applied()
    cpu_min = cgroups.CPU_SHARES_MIN if version == 1 else cgroups.CPU_WEIGHT_MIN
    expected = {"memory": 64 * MiB, "pids": 8, "cpu": cpu_min}
    assert set(applied) == set(expected)
    offered = _usable(version)
    for limit, value in expected.items():
        if limit in offered:
            assert applied[limit] == value
        else:
            # Not delegated here (v2 next to v1): the limit is reported missing, not assumed.
            assert applied[limit] is None
            assert any(f"no {limit} limit" in p for p in group.problems), group.problems
    if offered == cgroups.LIMITING:
        assert group.problems == ()


def test_memory_limit_is_page_rounded_and_read_back(
    version: int, make_group: Callable[[Limits], RankCgroup]
) -> None:
    _needs(version, "memory")
    group = make_group(Limits(memory=64 * MiB + 1, pids=None, cpu_weight_low=False))
    assert group.limits_applied() == {"memory": 64 * MiB}
    assert group.problems == ()


def test_a_child_past_its_memory_limit_is_oom_killed(
    version: int,
    make_group: Callable[[Limits], RankCgroup],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    _needs(version, "memory")
    group = make_group(Limits(memory=64 * MiB, pids=8))
    # Non-zero bytes: every page is written, so every page is charged.
    proc = spawn("data = b'\\x01' * (256 << 20)\nprint('survived', len(data))", join=group)
    returncode, out = _finish(proc)
    assert returncode == -signal.SIGKILL, out
    events = group.events()
    assert events.oom_kills is not None and events.oom_kills >= 1, events
    assert events.memory_peak is None or events.memory_peak <= 64 * MiB, events
    assert events.pids_max_hits == 0, events


def test_a_child_forking_past_its_process_limit_gets_eagain(
    version: int,
    make_group: Callable[[Limits], RankCgroup],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    _needs(version, "pids")
    group = make_group(Limits(memory=256 * MiB, pids=8))
    program = """
import json
import os
r, w = os.pipe()
children = 0
try:
    while children < 64:  # a bound of its own, should the limit not hold
        if os.fork() == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        children += 1
    result = "no-limit"
except BlockingIOError:
    result = "EAGAIN"
os.close(w)
for _ in range(children):
    os.wait()
print(result, children)
"""
    returncode, out = _finish(spawn(program, join=group))
    assert returncode == 0, out
    # The child itself is one of the 8.
    assert out.split() == ["EAGAIN", "7"], out
    events = group.events()
    assert events.pids_max_hits is not None and events.pids_max_hits >= 1, events
    assert not events.oom_kills, events


DOUBLE_FORK = """
import os, signal
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, b"%d\\n" % os.getpid())
        while True:
            signal.pause()
    os._exit(0)
os.close(w)
print(os.read(r, 64).decode().strip(), flush=True)
while True:
    signal.pause()
"""


def test_kill_all_ends_a_tree_that_left_its_parent_and_remove_leaves_nothing(
    version: int,
    make_group: Callable[[Limits], RankCgroup],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    group = make_group(Limits(memory=256 * MiB, pids=16))
    proc = spawn(DOUBLE_FORK, join=group)
    orphan = int(_read_line(proc))
    watch = os.pidfd_open(orphan)
    try:
        assert {proc.pid, orphan} <= set(group.pids())
        group.kill_all()
        assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL
        poller = select.poll()
        poller.register(watch, select.POLLIN)
        assert poller.poll(TIMEOUT * 1000), "the orphaned grandchild survived kill_all"
    finally:
        os.close(watch)
    assert group.pids() == []
    group.remove()
    for d in [Path(p).parent for p in group.procs_files()] + _base_dirs(group):
        assert not d.exists(), d
    group.remove()  # gone already: fine


def test_a_process_attached_after_it_started_is_in_the_group_and_killed(
    version: int,
    make_group: Callable[[Limits], RankCgroup],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    group = make_group(Limits(pids=16))
    proc = spawn("import signal\nprint('up', flush=True)\nsignal.pause()")
    assert _read_line(proc).strip() == "up"
    assert group.pids() == []
    group.attach(proc.pid)
    assert group.pids() == [proc.pid]
    group.kill_all()
    assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL
    assert group.pids() == []


@pytest.mark.large
def test_attaching_a_process_that_is_gone_is_an_error(
    make_group: Callable[[Limits], RankCgroup],
) -> None:
    group = make_group(Limits())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=TIMEOUT)  # reaped: its pid names nothing (until reused)
    with pytest.raises(CgroupError, match=f"cannot move process {proc.pid}"):
        group.attach(proc.pid)


def test_killing_by_freezing_when_there_is_no_cgroup_kill(
    version: int,
    make_group: Callable[[Limits], RankCgroup],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    # v1 always kills this way; v2 does on kernels before 5.14 (no cgroup.kill).
    group = make_group(Limits(pids=16))
    proc = spawn(DOUBLE_FORK, join=group)
    orphan = int(_read_line(proc))
    watch = os.pidfd_open(orphan)
    try:
        group._kill_frozen()
        assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL
        poller = select.poll()
        poller.register(watch, select.POLLIN)
        assert poller.poll(TIMEOUT * 1000), "the orphaned grandchild survived the kill"
    finally:
        os.close(watch)
    # Thawed again: the group takes new processes and they run.
    after = spawn("print('runs', flush=True)", join=group)
    assert _finish(after) == (0, "runs\n")


COUNTER = """
n = 0
print("up", flush=True)
while True:
    n += 1
    if n % 200000 == 0:
        print(n, flush=True)
"""


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_a_frozen_group_takes_no_cpu_and_runs_on_when_thawed(
    version: int,
    make_group: Callable[[Limits], RankCgroup],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    group = make_group(Limits(pids=16))
    if not group.can_freeze:
        pytest.skip(f"{group} has no freezer here")
    proc = spawn(COUNTER, join=group)
    assert _read_line(proc).strip() == "up"
    assert group.freeze(True)
    ticks = _cpu_ticks(proc.pid)
    # Frozen: what it printed before is all there is, and its CPU time stands still (the
    # kernel's own clock ticks 100 times a second: a running loop would gain ~25 in 0.25 s).
    deadline = time.monotonic() + 0.25
    while time.monotonic() < deadline:
        assert _cpu_ticks(proc.pid) == ticks
    assert group.pids() == [proc.pid]
    assert group.freeze(False)
    deadline = time.monotonic() + TIMEOUT
    while _cpu_ticks(proc.pid) == ticks:  # it counts on
        assert time.monotonic() < deadline, "still frozen after the thaw"
        time.sleep(0.01)
    group.kill_all()
    assert proc.wait(timeout=TIMEOUT) == -signal.SIGKILL


def test_sweep_removes_what_dead_agents_left_and_keeps_what_runs(
    version: int,
    make_group: Callable[[Limits], RankCgroup],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    own = make_group(Limits())  # this agent's base exists, with a group in it
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=TIMEOUT)  # its pid names nothing now: an agent that was SIGKILLed
    base = Path(own.procs_files()[0]).parent.parent.parent / f"vpool-agent-{gone.pid}"
    (base / "1-0-1-x").mkdir(parents=True)
    (base / "1-1-1-x").mkdir()
    busy = base / "1-2-1-x"
    busy.mkdir()
    proc = spawn("import signal\nprint('up', flush=True)\nsignal.pause()")
    assert _read_line(proc).strip() == "up"
    (busy / "cgroup.procs").write_text(str(proc.pid))  # a rank the dead agent left running
    try:
        assert base not in cgroups.sweep(version)  # the busy group keeps its base
        assert sorted(p.name for p in base.iterdir() if p.is_dir()) == ["1-2-1-x"]
        assert Path(own.procs_files()[0]).exists()  # a live agent's groups are not touched
        proc.kill()
        proc.wait(timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while (busy / "cgroup.procs").read_text().strip():  # the kernel empties it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert base in cgroups.sweep(version)  # (and any other dead agent's leftovers)
        assert not base.exists()
    finally:
        for d in (busy, base / "1-0-1-x", base / "1-1-1-x", base):
            with contextlib.suppress(OSError):
                d.rmdir()


def test_a_name_in_use_is_refused_and_the_first_group_is_kept(
    make_group: Callable[[Limits], RankCgroup],
) -> None:
    group = make_group(Limits())
    with pytest.raises(CgroupError, match="exists already"):
        RankCgroup.create(group.name, Limits(), version=group.version)
    assert all(Path(p).exists() for p in group.procs_files())


def test_remove_of_a_busy_group_raises_after_its_deadline(
    make_group: Callable[[Limits], RankCgroup],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    group = make_group(Limits())
    proc = spawn("import signal\nprint('up', flush=True)\nsignal.pause()", join=group)
    assert _read_line(proc).strip() == "up"
    with pytest.raises(CgroupError, match="cannot remove"):
        group.remove(timeout=0.05)
    assert group.pids() == [proc.pid]


# -- cgroup v2: an agent alone in its group leaves it to enable controllers ---------------------

# Run as the agent, in a group of its own: makes a rank's group with ``controller`` (one this
# machine's v2 hierarchy has: on a hybrid machine memory, pids and cpu are in v1) and says
# where it ended up. Replacing the wanted controllers is the only change to the module.
LEAVE_OWN_GROUP = """
import json, sys
from pathlib import Path
from vpool.worker_agent import cgroups
cgroups._V2_CONTROLLERS = (sys.argv[1],)
group = cgroups.RankCgroup.create("rank", cgroups.Limits(cpu_weight_low=False), version=2)
(procs,) = group.procs_files()
rank = Path(procs).parent
own = [ln[3:] for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln[:3] == "0::"]
print(json.dumps({
    "own": own[0],
    "rank": str(rank),
    "rank_controllers": (rank / "cgroup.controllers").read_text().split(),
    "problems": list(group.problems),
}))
group.remove()
"""


@pytest.fixture
def agent_group() -> Iterator[tuple[Path, str, str]]:
    """A v2 group for a stand-in agent (directory, path in the hierarchy, a controller it is
    given), under this process's own group; removed with all below it, and the controller
    disabled again where this fixture enabled it."""
    _usable(2)
    lines = cgroups.parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    mounts = cgroups.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    (line,) = [ln for ln in lines if ln.hierarchy == 0]
    own = cgroups.group_directory([m for m in mounts if m.version == 2], line.path)
    assert own is not None
    offered = sorted((own / "cgroup.controllers").read_text().split())
    if line.path != "/" or not offered:
        # Elsewhere this process's own group could not enable a controller with itself in it.
        pytest.skip("needs this process in the root of a cgroup v2 hierarchy with a controller")
    controller = offered[0]
    enabled_before = controller in (own / "cgroup.subtree_control").read_text().split()
    name = f"test-agent-{uuid.uuid4().hex[:10]}"
    group = own / name
    group.mkdir()
    if not enabled_before:
        (own / "cgroup.subtree_control").write_text(f"+{controller}")
    try:
        yield group, f"/{name}", controller
    finally:
        for top, _, _ in os.walk(group, topdown=False):
            os.rmdir(top)
        if not enabled_before:
            (own / "cgroup.subtree_control").write_text(f"-{controller}")


def test_an_agent_alone_in_its_v2_group_moves_into_a_leaf_to_enable_controllers(
    agent_group: tuple[Path, str, str],
) -> None:
    group, path, controller = agent_group
    assert controller not in (group / "cgroup.subtree_control").read_text().split()
    proc = subprocess.Popen(
        [sys.executable, "-c", LEAVE_OWN_GROUP, controller],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: _join([str(group / "cgroup.procs")]),
    )
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, out
    found = json.loads(out)
    base = f"vpool-agent-{proc.pid}"
    assert found["own"] == f"{path}/{base}/{cgroups.AGENT_LEAF}"
    assert found["rank"] == str(group / base / "rank")
    assert controller in found["rank_controllers"]
    assert found["problems"] == []
    assert controller in (group / "cgroup.subtree_control").read_text().split()
    # The rank's group is gone; the base stays while the agent's leaf is in it.
    assert not (group / base / "rank").exists()
    assert (group / base / cgroups.AGENT_LEAF).is_dir()


def test_an_agent_that_shares_its_v2_group_stays_and_reports_it(
    agent_group: tuple[Path, str, str], spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    group, path, controller = agent_group
    other = spawn("import signal\nprint('up', flush=True)\nsignal.pause()")
    assert _read_line(other).strip() == "up"
    (group / "cgroup.procs").write_text(str(other.pid))
    proc = subprocess.Popen(
        [sys.executable, "-c", LEAVE_OWN_GROUP, controller],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: _join([str(group / "cgroup.procs")]),
    )
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, out
    found = json.loads(out)
    assert found["own"] == path
    assert controller not in found["rank_controllers"]
    assert any("holds other processes (1)" in p for p in found["problems"]), found["problems"]
    other.kill()
    other.wait(timeout=TIMEOUT)
