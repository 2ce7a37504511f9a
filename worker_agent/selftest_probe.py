"""The hostile acts of ``vpool-agent selftest``, done from inside a sandboxed test rank.

Run in the sandbox as ``python selftest_probe.py TARGETS_JSON`` (``selftest``). Prints one JSON
object: probe name -> what happened (an errno name, an exception name, "ok", or a value).
With ``--clone``, it also forks a checkpoint clone the way a rank does (its own process group,
stdio on /dev/null), prints ``{"clone": PID}`` and waits; the clone waits for its parent to
change (a restore), then writes what it can do after the restore to
``/vpool/rank/restored.json``. Standard library only: it runs with ``-I -S``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWUSER = 0x10000000
_KEYCTL = {"x86_64": 250, "aarch64": 219}  # the system call's number


def _errno_of(fn: Callable[[], object]) -> str:
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return "ok"


def _exception_of(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def _libc_call(name: str, *args: Any) -> Callable[[], None]:
    def call() -> None:
        if getattr(_libc, name)(*args) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    return call


def _connect(host: str, port: int) -> Callable[[], None]:
    def call() -> None:
        with socket.create_connection((host, port), timeout=2):
            pass

    return call


def _read(path: str) -> Callable[[], object]:
    def call() -> object:
        with open(path, "rb") as f:
            return f.read(1)

    return call


def _rewrite(path: str) -> Callable[[], None]:
    """Write a setting's own value back (changes nothing where it is allowed)."""

    def call() -> None:
        with open(path, "rb") as f:
            value = f.read()
        with open(path, "wb") as f:
            f.write(value)

    return call


def _status(field: str) -> str:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return line.split()[1]
    return ""


def _secret_in_environ() -> bool:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if any(e.startswith(b"VPOOL_RANK_SECRET=") for e in f.read().split(b"\0")):
                    return True
        except OSError:
            continue
    return False


def confinement() -> dict[str, str]:
    """What the process itself holds: capabilities, no_new_privs, seccomp mode."""
    return {
        "capabilities": _status("CapEff"),
        "bounding_set": _status("CapBnd"),
        "no_new_privs": _status("NoNewPrivs"),
        "seccomp": _status("Seccomp"),
    }


def probe(targets: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for name, path in targets.get("private", {}).items():
        seen[f"read_{name}"] = _exception_of(_read(path))
    seen["read_shadow"] = _exception_of(_read("/etc/shadow"))
    seen["other_processes"] = sorted(
        int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) not in (1, os.getpid())
    )
    seen["signal_agent"] = _exception_of(lambda: os.kill(int(targets["agent_pid"]), 0))
    seen["secret_in_environ"] = _secret_in_environ()
    seen["connect_coordinator"] = _errno_of(
        _connect(str(targets["coordinator_host"]), int(targets["coordinator_port"]))
    )
    # TEST-NET-1: with no route out, connect fails here without sending anything.
    seen["connect_outside"] = _errno_of(_connect("192.0.2.1", 80))
    seen["write_system"] = _errno_of(lambda: open("/usr/.vpool-probe", "w").close())
    seen["write_work"] = _errno_of(lambda: open("probe.txt", "w").close())
    # Where a privileged helper entering the sandbox would look: the loader's preload list.
    seen["write_root"] = _errno_of(lambda: open("/etc/ld.so.preload", "w").close())
    seen["write_kernel_settings"] = _errno_of(_rewrite("/proc/sys/kernel/core_pattern"))
    seen["write_sysrq"] = _errno_of(lambda: open("/proc/sysrq-trigger", "w").close())
    seen["host_boot_id"] = _exception_of(_read("/proc/sys/kernel/random/boot_id"))
    if seen["host_boot_id"] == "ok":
        with open("/proc/sys/kernel/random/boot_id") as f:
            seen["host_boot_id"] = f.read().strip() == targets.get("boot_id")
    seen["new_user_namespace"] = _errno_of(_libc_call("unshare", _CLONE_NEWUSER))
    seen["ptrace"] = _errno_of(_libc_call("ptrace", 0, 0, 0, 0))
    seen["mount"] = _errno_of(_libc_call("mount", b"none", b"/tmp", b"tmpfs", 0, None))
    keyctl = _KEYCTL.get(platform.machine())
    if keyctl is not None:
        seen["keyctl"] = _errno_of(_libc_call("syscall", keyctl, 0, 0, 0, 0))
    seen["netlink_socket"] = _errno_of(
        lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()
    )
    tmp = os.statvfs("/tmp")
    seen["tmp_bytes"] = tmp.f_blocks * tmp.f_frsize
    seen.update(confinement())
    return seen


def _clone() -> None:
    parent = os.getpid()
    pid = os.fork()
    if pid:
        print(json.dumps({"clone": pid}), flush=True)
        time.sleep(600)  # until the selftest kills the sandbox
        return
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    deadline = time.monotonic() + 600
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    with open("/vpool/rank/restored.json", "w") as f:
        json.dump(confinement(), f)
    os._exit(0)


def main() -> None:
    if sys.argv[1:2] == ["--clone"]:
        _clone()
        return
    print(json.dumps(probe(json.loads(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
