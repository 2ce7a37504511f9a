"""Init of a checkpoint restore's PID namespace: restore the image, wait for the process.

Run as ``unshare --pid --fork --mount-proc python -m vpool.worker_agent.restore_init --criu
CRIU --images DIR --status FILE`` (``criu.restore_command``): this process is pid 1 of a fresh
PID namespace, where the image's pids are free. It runs ``criu restore --restore-detached
--restore-sibling``, so the restored process is its own child, then waits for it (and reaps
every orphan of the namespace, as an init must) and writes its exit to FILE, atomically:
``{"code": N}`` or ``{"signal": S}``, exiting with N or 128 + S. CRIU's own exit status says
nothing about the restored process: that is why this exists.

A failed restore writes no status file, prints the tail of CRIU's log on stderr and exits 2.
SIGTERM, SIGINT, SIGHUP and SIGQUIT sent to this process (the agent signals the process group
of ``unshare``, which this process shares; the restored process has a group of its own) are
passed on to the restored process. When this process dies the kernel kills the whole namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

from vpool.worker_agent import privileged

# The standard library and ``privileged`` (a small module) only: this runs on every restore
# and should start fast (no trio).

# CRIU writes the restored process's pid (inside the new namespace) here, in the images
# directory; ``criu.restored_host_pid`` maps it to the agent's view.
PIDFILE_NAME = "restored.pid"
RESTORE_LOG_NAME = "restore.log"
RESTORE_FAILED = 2
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class _Forwarder:
    """Signals that arrive before the restored process exists are passed on once it does."""

    def __init__(self) -> None:
        self.target = 0
        self.pending: list[int] = []

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.target:
            _kill(self.target, signum)
        else:
            self.pending.append(signum)

    def attach(self, pid: int) -> None:
        self.target = pid
        for signum in self.pending:
            _kill(pid, signum)
        self.pending.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vpool.worker_agent.restore_init")
    parser.add_argument("--criu", default="criu")
    parser.add_argument("--images", type=Path, required=True)
    parser.add_argument("--status", type=Path, required=True)
    # A descriptor CRIU must have too: --images and --status name paths through it
    # (/proc/self/fd/N) in a sandbox, where the agent's directories are not mounted.
    parser.add_argument("--pass-fd", type=int, action="append", default=[])
    args = parser.parse_args(argv)

    forwarder = _Forwarder()
    for signum in _FORWARDED:
        signal.signal(signum, forwarder.handle)

    images: Path = args.images if str(args.images).startswith("/proc/") else args.images.absolute()
    pidfile = images / PIDFILE_NAME
    pidfile.unlink(missing_ok=True)
    command = [
        args.criu,
        "restore",
        "--restore-detached",
        "--restore-sibling",
        "-D",
        str(images),
        "--pidfile",
        str(pidfile),
        "-o",
        RESTORE_LOG_NAME,
        "--manage-cgroups=ignore",
        # Into this process's session (the agent's), as it was dumped: one scheduler
        # autogroup with the agent's other ranks and its niced checkpoint chores.
        "--shell-job",
        # Only what is said here: no configuration file, no environment of the agent's.
        "--no-default-config",
    ]
    try:
        criu = subprocess.run(
            command,
            env={"PATH": privileged.FIXED_PATH},
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            stderr=sys.stderr,
            check=False,
            pass_fds=args.pass_fd,
        )
    except OSError as exc:
        print(f"restore failed: cannot run {args.criu}: {exc}", file=sys.stderr, flush=True)
        return RESTORE_FAILED
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        pid = 0
    if criu.returncode != 0 or pid <= 0:
        print(
            f"restore failed (criu exit {criu.returncode}): {log_tail(images / RESTORE_LOG_NAME)}",
            file=sys.stderr,
            flush=True,
        )
        return RESTORE_FAILED
    forwarder.attach(pid)
    status = _wait_for(pid)
    _write_status(args.status, status)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def log_tail(path: Path, lines: int = 12) -> str:
    """The last lines of a CRIU log, errors first: what a failure report should say."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    all_lines = text.splitlines()
    errors = [line for line in all_lines if "Error" in line][-lines:]
    chosen = errors if errors else all_lines[-lines:]
    return " | ".join(line.strip() for line in chosen)


def _wait_for(pid: int) -> int:
    """Reap children until ``pid`` ends; its wait status."""
    while True:
        try:
            child, status = os.wait()
        except ChildProcessError:
            # Not our child after all: nothing can tell how it ended.
            return 255 << 8
        if child == pid:
            return status


def _write_status(path: Path, status: int) -> None:
    if os.WIFSIGNALED(status):
        record = {"signal": os.WTERMSIG(status)}
    else:
        record = {"code": os.waitstatus_to_exitcode(status)}
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
