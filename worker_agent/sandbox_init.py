"""Init of a rank's sandbox: pid 1 of its PID namespace, the rank's parent.

Run by ``bwrap --as-pid-1`` as ``python -I -S sandbox_init.py --status-fd N [options] --
PROGRAM ARGS`` (``sandbox.command``), with no capabilities, ``no_new_privs`` and the sandbox's
seccomp filter already in force. It

1. forks the rank; the child sets its limits (``--nofile``, ``--fsize``, without a cgroup
   ``--data`` and ``--nproc``; no core files), the
   idle scheduling class (``--sched-idle``: the rank takes only CPU time the volunteer leaves),
   stdin (``--stdin`` or ``/dev/null``, opened inside the sandbox: a host descriptor would
   make the rank's clones undumpable), closes every other descriptor and execs PROGRAM;
2. writes ``pid P`` (P: the rank's pid in the sandbox) on the status descriptor, reaps every
   process of the namespace (an init must), and when the rank ends writes ``exit {"code": N}``
   or ``exit {"signal": S}``: the agent learns how the rank ended from here, not from bwrap,
   whose own status cannot tell a signal from an exit code;
3. lingers while other processes of the sandbox live, at most ``--linger`` seconds: the
   clone of a checkpoint in flight, which the agent may still dump (the rank's freshest
   state). Then it exits, and the kernel kills whatever is left in the namespace: nothing a
   rank started outlives it.

SIGTERM, SIGINT and SIGHUP sent to this process are passed on to the rank. Standard library
only, started with ``-I -S``: it runs before every rank and must start fast.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from types import FrameType

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
EXIT_CANNOT_START = 127


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandbox_init")
    parser.add_argument("--status-fd", type=int, required=True)
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--stdin", default="")
    parser.add_argument("--nofile", type=int, default=0)
    parser.add_argument("--fsize", type=int, default=0)
    # Where no cgroup can be had: memory by RLIMIT_DATA (private and anonymous mappings, the
    # heap; not the address space, which threads and numpy reserve by gigabytes unused) and
    # processes by RLIMIT_NPROC (per user: ignored for root, which only a cgroup can limit).
    parser.add_argument("--data", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=0)
    parser.add_argument("--sched-idle", action="store_true")
    # As root: empty the capability bounding set with the CAP_SETPCAP bwrap left this
    # process, then drop every capability (the rank, uid 0, can never regain any by exec).
    parser.add_argument("--drop-bounding", action="store_true")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("no program given")
    status = os.fdopen(args.status_fd, "w", buffering=1)
    os.set_inheritable(args.status_fd, False)
    if args.drop_bounding:
        _drop_bounding_set()

    rank = os.fork()
    if rank == 0:
        _become_rank(args, program)  # never returns
    target = [rank]

    def forward(signum: int, frame: FrameType | None) -> None:
        _kill(target[0], signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    _say(status, f"pid {rank}")
    wait_status = _reap_until(rank)
    if os.WIFSIGNALED(wait_status):
        record = {"signal": os.WTERMSIG(wait_status)}
    else:
        record = {"code": os.waitstatus_to_exitcode(wait_status)}
    _say(status, "exit " + json.dumps(record))
    _linger(args.linger)
    return 0


def _become_rank(args: argparse.Namespace, program: list[str]) -> None:
    """In the forked child: limits, scheduling, stdio, then exec the program."""
    try:
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if args.nofile > 0:
            resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
        if args.fsize > 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize, args.fsize))
        if args.data > 0:
            resource.setrlimit(resource.RLIMIT_DATA, (args.data, args.data))
        if args.nproc > 0 and os.getuid() != 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (args.nproc, args.nproc))
        if args.sched_idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        for sig in _FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        fd = os.open(args.stdin or os.devnull, os.O_RDONLY)
        if fd != 0:
            os.dup2(fd, 0)
            os.close(fd)
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        os.execv(program[0], program)
    except OSError as exc:
        os.write(2, f"vpool sandbox: cannot start {program[0]}: {exc}\n".encode())
    os._exit(EXIT_CANNOT_START)


def _reap_until(pid: int) -> int:
    """Reap children until ``pid`` ends; its wait status."""
    while True:
        try:
            child, wait_status = os.wait()
        except ChildProcessError:
            return 255 << 8  # cannot happen: the rank is our child
        if child == pid:
            return wait_status


def _linger(seconds: float) -> None:
    """Reap what is left until nothing is, or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            child, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # nothing left
        if child == 0:
            time.sleep(0.02)


def _say(status: object, line: str) -> None:
    try:
        status.write(line + "\n")  # type: ignore[attr-defined]
    except OSError:
        pass  # the agent is gone; the rank's end is all that is left to do


def _drop_bounding_set() -> None:
    """Empty the capability bounding set, then this process's own capabilities."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(_PR_CAPBSET_DROP, cap)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]

    header, data = Header(_LINUX_CAPABILITY_VERSION_3, 0), (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _prctl(option: int, value: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
