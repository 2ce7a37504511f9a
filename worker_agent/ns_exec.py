"""Run a trusted program in a rank's namespaces, loading nothing from the rank's view.

Run by the agent (as root) as::

    python -I -S ns_exec.py --target PID --program PATH [--loader PATH] [--libdir DIR]...
        -- ARG...

(``privileged.Program.ns_exec_argv``). In the agent's own namespaces it opens PROGRAM, its
dynamic LOADER and each library DIR; then it enters host process PID's PID, mount, network,
IPC and UTS namespaces in one ``setns`` on a pidfd (PID cannot be swapped for another
process in between), checks that nothing can have been planted where the loader looks (the
view's ``/`` and ``/etc`` are read-only mounts and there is no ``/etc/ld.so.preload``; else it
exits 126 and says why), forks (the child is in the PID namespace) and the child executes
the loader by its descriptor::

    ld.so --inhibit-cache --library-path /proc/self/fd/L1:... --argv0 NAME /proc/self/fd/P ARG...

with ``PATH`` alone in its environment and ``PR_SET_PDEATHSIG``: if this process is killed
(a timeout), the program dies too. A static PROGRAM (no ``--loader``) is executed by its
descriptor directly. This process exits as the program did (128 + N for signal N).

Standard library only, with ``-I -S``, and every module imported before entering: after
``setns`` an import would read the rank's files.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
# ``privileged.FIXED_PATH``: this script runs by its path with -I -S and imports no vpool module.
FIXED_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXIT_REFUSED = 126
_libc = ctypes.CDLL(None, use_errno=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ns_exec")
    parser.add_argument("--target", type=int, required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--loader", default="")
    parser.add_argument("--libdir", action="append", default=[])
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args

    # 1. Everything that will run, opened here (the agent's mount namespace).
    program_fd = _open_inheritable(args.program, os.O_RDONLY)
    loader_fd = os.open(args.loader, os.O_RDONLY | os.O_CLOEXEC) if args.loader else -1
    lib_fds = [_open_inheritable(d, os.O_RDONLY | os.O_DIRECTORY) for d in args.libdir]
    name = os.path.basename(args.program)

    # 2. The rank's namespaces.
    try:
        pidfd = os.pidfd_open(args.target)
    except OSError as exc:
        return _refuse(f"no process {args.target} to enter: {exc}")
    flags = _CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    if _libc.setns(pidfd, flags) != 0:
        code = ctypes.get_errno()
        return _refuse(f"cannot enter the namespaces of {args.target}: {os.strerror(code)}")
    os.close(pidfd)

    # 3. What the loader reads from the view no matter what (/etc/ld.so.preload) must be
    # unplantable there.
    why = _plantable()
    if why:
        return _refuse(why)

    # 4. Into the PID namespace: a child.
    child = os.fork()
    if child == 0:
        try:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.chdir("/")
            env = {"PATH": FIXED_PATH}
            exe = f"/proc/self/fd/{program_fd}"
            if loader_fd < 0:
                os.execve(program_fd, [name, *rest], env)
            libpath = ":".join(f"/proc/self/fd/{fd}" for fd in lib_fds)
            loader_argv = [args.loader, "--inhibit-cache", "--library-path", libpath]
            os.execve(loader_fd, [*loader_argv, "--argv0", name, exe, *rest], env)
        except OSError as exc:
            os.write(2, f"ns_exec: cannot run {args.program}: {exc}\n".encode())
        os._exit(127)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda s, f: _kill(child, s))
    _, status = os.waitpid(child, 0)  # retried after a signal (PEP 475)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def _plantable() -> str:
    """Why a file could have been planted where the dynamic loader looks ("" if not)."""
    for path in ("/", "/etc"):
        try:
            flags = os.statvfs(path).f_flag
        except FileNotFoundError:
            continue  # no /etc, on a read-only root: none can be made
        except OSError as exc:
            return f"cannot inspect the rank's {path}: {exc}"
        if not flags & os.ST_RDONLY:
            return f"the rank's {path} is writable: a planted file could be loaded"
    if os.path.lexists("/etc/ld.so.preload"):
        return "the rank's view has an /etc/ld.so.preload"
    return ""


def _open_inheritable(path: str, flags: int) -> int:
    fd = os.open(path, flags)
    os.set_inheritable(fd, True)
    return fd


def _refuse(why: str) -> int:
    print(f"ns_exec: refusing to run: {why}", file=sys.stderr, flush=True)
    return EXIT_REFUSED


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
