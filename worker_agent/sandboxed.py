"""Starting and driving one rank process in its sandbox (``sandbox``), with its cgroup.

``start`` runs ``bwrap`` with ``sandbox_init`` (a fresh rank) or ``restore_init`` (a
restore) as the sandbox's pid 1, inside a cgroup of the rank's own (``cgroups``) that the
bwrap process joins before it execs, so that nothing of the sandbox ever runs outside it.
``Sandboxed`` is the handle: the host pids of the init and of the rank, the rank's end as
``sandbox_init`` reports it, signals, and whether a limit ended it (``limit_reason``).

What a sandboxed rank leaves behind dies with it: the init's death ends the PID namespace
(the kernel kills every process in it), and ``kill`` also kills whatever is in the cgroup.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from vpool.sizes import format_size
from vpool.worker_agent import cgroups, criu, privileged, sandbox, seccomp
from vpool.worker_agent.errors import AgentError
from vpool.worker_agent.settings import AgentSettings

log = logging.getLogger("vpool.agent")

_INFO_TIMEOUT = 30.0  # s for bwrap to say its child's pid


class SandboxStartError(AgentError):
    """The sandbox could not be started (bwrap refused, no cgroup, ...)."""


@dataclass
class Isolation:
    """How this agent isolates ranks, found at start: the pieces a sandbox is made of."""

    bwrap: str = ""
    view: sandbox.View | None = None
    seccomp: bytes = b""
    cgroup: cgroups.Support | None = None
    reason: str = ""  # why ranks run unsandboxed ("" with ``view``: sandboxed)

    @property
    def on(self) -> bool:
        return self.view is not None

    @property
    def has_cgroup(self) -> bool:
        """Ranks get a cgroup with memory and process limits."""
        cg = self.cgroup
        return cg is not None and bool(cg.version) and {"memory", "pids"} <= cg.controllers


@dataclass(frozen=True)
class RankLimits:
    """What one rank may use (bytes; 0: no limit)."""

    memory: int = 0
    processes: int = 0
    disk: int = 0  # largest file, and the work directory's total as the agent watches it
    tmp: int = 0  # /tmp and /dev/shm each
    open_files: int = 0
    sched_idle: bool = True

    def describe(self) -> str:
        parts = []
        if self.memory:
            parts.append(f"memory {format_size(self.memory)}")
        if self.processes:
            parts.append(f"{self.processes} processes")
        if self.disk:
            parts.append(f"disk {format_size(self.disk)}")
        if self.open_files:
            parts.append(f"{self.open_files} open files")
        return ", ".join(parts) or "none"


@dataclass
class Sandboxed:
    """A rank's sandbox, running."""

    process: trio.Process  # bwrap
    init_pid: int  # host pid of the sandbox's pid 1
    limits: RankLimits
    cgroup: cgroups.RankCgroup | None
    pid: int = 0  # host pid of the rank (a fresh start: known once sandbox_init says it)
    status: dict[str, int] | None = None  # sandbox_init's "exit" record
    killed_for: str = ""  # a limit the agent enforced itself (disk), set before it kills
    reports: trio.lowlevel.FdStream | None = None  # sandbox_init's status descriptor
    _buffer: bytes = b""
    _ended: bool = False

    def returncode(self) -> int | None:
        """The rank's exit as a returncode (negative: a signal); None while unknown."""
        status = self.status
        if status is None:
            return None
        if "signal" in status:
            return -int(status["signal"])
        return int(status.get("code", 255))

    def signal(self, sig: int) -> None:
        """``sig`` to the rank; SIGKILL ends the whole sandbox (its init, its cgroup)."""
        if sig == signal.SIGKILL:
            _kill(self.init_pid, sig)
            if self.cgroup is not None:
                try:
                    self.cgroup.kill_all()
                except cgroups.CgroupError as exc:
                    log.warning("cannot kill what is left in %s: %s", self.cgroup, exc)
            return
        if self.pid:
            _kill(self.pid, sig)

    def limit_reason(self) -> str:
        """Which limit ended the rank ("" if none did)."""
        if self.killed_for:
            return self.killed_for
        if self.cgroup is None:
            return ""
        try:
            events = self.cgroup.events()
        except cgroups.CgroupError:
            return ""
        if events.oom_kills and self.limits.memory:
            return f"exceeded its memory limit of {format_size(self.limits.memory)}"
        if events.pids_max_hits and self.limits.processes:
            return f"hit its limit of {self.limits.processes} processes"
        return ""

    async def next_report(self) -> bool:
        """Read sandbox_init's next report (``pid P``, ``exit {...}``); False at its end."""
        while b"\n" not in self._buffer:
            chunk = b""
            if self.reports is not None:
                chunk = await self.reports.receive_some(4096)
            if not chunk:
                return False
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        word, _, rest = line.decode(errors="replace").partition(" ")
        if word == "pid" and rest.isdigit():
            self.pid = criu.descendant_host_pid(self.init_pid, int(rest)) or 0
        elif word == "exit":
            try:
                record = json.loads(rest)
            except ValueError:
                record = None
            self.status = record if isinstance(record, dict) else {"code": 255}
        return True

    async def wait_ended(self) -> None:
        """Until the rank ended: sandbox_init said how, or the sandbox is gone."""
        while not self._ended and self.status is None:
            if not await self.next_report():
                self._ended = True

    async def aclose(self) -> None:
        """Kill what is left and remove the cgroup (after the rank ended)."""
        self.signal(signal.SIGKILL)
        with trio.move_on_after(10, shield=True):
            if self.reports is not None:
                await self.reports.aclose()
                self.reports = None
            await self.process.wait()
            if self.cgroup is not None:
                await trio.to_thread.run_sync(self.cgroup.remove)


async def start(
    iso: Isolation,
    mounts: sandbox.Mounts,
    init: Callable[[int], list[str]],
    *,
    name: str,
    limits: RankLimits,
    env: dict[str, str],
    cwd: Path,
    stdout: int | None = None,
    stderr: int | None = None,
    privileged: bool = False,
    pass_fds: list[int] | None = None,
) -> Sandboxed:
    """Start ``init(status_fd)`` as pid 1 of a new sandbox (raises ``SandboxStartError``).

    With ``privileged`` (a restore) there is no seccomp filter and no status reader: the
    caller knows the rank by the restore's own means."""
    assert iso.view is not None
    group: cgroups.RankCgroup | None = None
    if iso.cgroup is not None and iso.cgroup.version:
        cg_limits = cgroups.Limits(
            memory=limits.memory or None, pids=limits.processes or None, cpu_weight_low=True
        )
        try:
            group = await trio.to_thread.run_sync(cgroups.RankCgroup.create, name, cg_limits)
        except cgroups.CgroupError as exc:
            raise SandboxStartError(f"cannot make the rank's cgroup: {exc}") from exc
    fds: list[int] = []
    try:
        status_r, status_w = os.pipe()
        fds += [status_r, status_w]
        info_r, info_w = os.pipe()
        fds += [info_r, info_w]
        seccomp_fd = None
        if not privileged and iso.seccomp:
            seccomp_fd = os.memfd_create("vpool-seccomp", 0)
            fds.append(seccomp_fd)
            os.write(seccomp_fd, iso.seccomp)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        argv = sandbox.command(
            iso.view,
            mounts,
            init(status_w),
            bwrap=iso.bwrap,
            privileged=privileged,
            tmp_size=limits.tmp,
            seccomp_fd=seccomp_fd,
            info_fd=info_w,
        )
        procs = group.procs_files() if group is not None else []
        own = [status_w, info_w] + ([seccomp_fd] if seccomp_fd is not None else [])
        try:
            process = await trio.lowlevel.open_process(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                pass_fds=[*own, *(pass_fds or [])],
                # In the agent's session and a group of its own (see ranks.py).
                process_group=0,
                preexec_fn=(lambda: _join(procs)) if procs else None,
            )
        except OSError as exc:
            raise SandboxStartError(f"cannot run {iso.bwrap}: {exc}") from exc
        for fd in own:
            os.close(fd)
            fds.remove(fd)
        info = await _read_info(info_r, process)
        os.close(info_r)
        fds.remove(info_r)
        box = Sandboxed(process, int(info["child-pid"]), limits, group)
        box.reports = trio.lowlevel.FdStream(status_r)
        fds.remove(status_r)
        group = None  # the handle owns it now
        if not privileged:
            with trio.move_on_after(_INFO_TIMEOUT):
                while not box.pid and await box.next_report():
                    pass
        return box
    finally:
        for fd in fds:
            os.close(fd)
        if group is not None:
            await trio.to_thread.run_sync(group.remove)


async def start_restore(
    iso: Isolation,
    mounts: sandbox.Mounts,
    scratch: Path,
    *,
    python: str,
    criu: str,
    name: str,
    limits: RankLimits,
    log: int,
) -> Sandboxed:
    """A new sandbox whose pid 1, ``restore_init``, restores the images in ``scratch``/images
    and writes the restored process's end to ``scratch``/status; CRIU's own output to
    ``log``. ``scratch`` is reached through a descriptor (/proc/self/fd/N): the sandbox does
    not show the agent's directories."""
    scratch_fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY)
    inside = f"/proc/self/fd/{scratch_fd}"
    try:
        return await start(
            iso,
            mounts,
            lambda status_fd: [
                python,
                "-I",
                "-m",
                "vpool.worker_agent.restore_init",
                "--criu",
                privileged.which(criu) or criu,
                "--images",
                f"{inside}/images",
                "--status",
                f"{inside}/status",
                "--pass-fd",
                str(scratch_fd),
            ],
            name=name,
            limits=limits,
            env={"PATH": privileged.FIXED_PATH},
            cwd=mounts.rank_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            privileged=True,
            pass_fds=[scratch_fd],
        )
    finally:
        os.close(scratch_fd)


def _join(procs: list[str]) -> None:
    """In the forked child, before exec: into the rank's cgroup (every v1 hierarchy)."""
    pid = str(os.getpid()).encode()
    for path in procs:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)


async def _read_info(fd: int, process: trio.Process) -> dict[str, int]:
    """bwrap's ``--info-fd`` JSON (``child-pid``)."""
    stream = trio.lowlevel.FdStream(os.dup(fd))
    data = b""
    try:
        with trio.move_on_after(_INFO_TIMEOUT):
            while True:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                data += chunk
                try:
                    info = json.loads(data)
                except ValueError:
                    continue
                if isinstance(info, dict) and isinstance(info.get("child-pid"), int):
                    return info
    finally:
        await stream.aclose()
    with trio.move_on_after(2):
        await process.wait()
    raise SandboxStartError(
        f"bwrap did not start the sandbox (exit {process.returncode}): {data[-300:]!r}"
    )


def _kill(pid: int, sig: int) -> None:
    if pid <= 0:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def find_isolation(settings: AgentSettings) -> Isolation:
    """What this agent can isolate ranks with (blocking: runs bwrap and the interpreter)."""
    if settings.sandbox == "off":
        return Isolation(reason="the sandbox is off in this agent's settings (sandbox = 'off')")
    bwrap = shutil.which(settings.bwrap) or ""
    why = sandbox.check(bwrap)
    if why:
        return Isolation(reason=why)
    try:
        filter_bpf = seccomp.build_filter()
    except Exception as exc:  # libseccomp missing or refusing: no filter, no sandbox
        return Isolation(reason=f"cannot build the seccomp filter: {exc}")
    extra = []
    criu_path = privileged.which(settings.criu)
    if criu_path and os.path.exists(criu_path):
        # Dumps run CRIU inside the rank's namespaces, where it must find itself.
        extra.append(os.path.dirname(os.path.realpath(criu_path)))
    try:
        view = sandbox.discover_view(
            settings.python_path, criu.vpool_dirs(), settings.work_path / "sandbox-etc", *extra
        )
    except (sandbox.SandboxError, OSError) as exc:
        return Isolation(reason=str(exc))
    return Isolation(bwrap, view, filter_bpf, cgroups.probe())


def rank_limits(settings: AgentSettings) -> RankLimits:
    return RankLimits(
        memory=settings.rank_memory_bytes,
        processes=settings.rank_processes,
        disk=settings.rank_disk,
        tmp=settings.rank_tmp,
        open_files=settings.rank_open_files,
        sched_idle=settings.rank_idle_priority,
    )
