"""The sandbox's seccomp filter, two ways.

1. The exported program is run in a small classic-BPF interpreter against every rule of
   ``syscall_rules()`` and against calls that must stay allowed: the table and the bytes agree,
   with no kernel involved.
2. The program is loaded for real by ``bwrap --seccomp`` and a probe script (this file, run in
   the sandbox with ``runpy``) tries each refused act in a child of its own and reports the
   errno. Probe arguments are chosen so that without the filter the kernel answers something
   else (EFAULT, EINVAL, success ...): a control run without ``--seccomp`` checks that, so each
   expected errno is known to come from the filter, not from the sandbox's missing
   capabilities.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import json
import mmap
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import pytest

from vpool.worker_agent import seccomp

BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
PROBE_RUN_NAME = "__seccomp_probe__"
NUMPY_MISSING = -1
X86_64 = platform.machine() == "x86_64"

ALLOW = 0x7FFF0000
AUDIT_ARCH_I386 = 0x40000003
X32_SYSCALL_BIT = 0x40000000

CLONE_VFORK = 0x4000
CLONE_SIGHAND = 0x800
CLONE_NEWUSER = 0x10000000
CLONE_NEW_FLAGS = {
    "newns": 0x00020000,
    "newcgroup": 0x02000000,
    "newuts": 0x04000000,
    "newipc": 0x08000000,
    "newuser": CLONE_NEWUSER,
    "newpid": 0x20000000,
    "newnet": 0x40000000,
}
ADDR_NO_RANDOMIZE = 0x0040000


def _lib() -> Any:
    import pyseccomp  # type: ignore[import-untyped]

    return pyseccomp


def nr(name: str) -> int:
    """The native number of a system call, as libseccomp knows it."""
    number: int = _lib().resolve_syscall(_lib().Arch.NATIVE, name)
    assert number >= 0, f"{name} has no native number"
    return number


def errno_action(value: int) -> int:
    return 0x00050000 | value


# -- 1. the program against the table, in a BPF interpreter ------------------------------------

BPF_LD_W_ABS = 0x20
BPF_ALU_AND_K = 0x54
BPF_RET_K = 0x06
BPF_JUMPS: dict[int, Callable[[int, int], bool]] = {
    0x15: lambda a, k: a == k,  # JEQ
    0x25: lambda a, k: a > k,  # JGT
    0x35: lambda a, k: a >= k,  # JGE
    0x45: lambda a, k: bool(a & k),  # JSET
}


def run_bpf(program: bytes, syscall: int, args: Iterable[int] = (), arch: int = 0) -> int:
    """The action ``program`` returns for one call (``struct seccomp_data``), as the kernel
    would compute it. Only the instructions libseccomp emits are known; any other fails."""
    arch = arch or _lib().system_arch()
    padded = [a & 0xFFFFFFFFFFFFFFFF for a in args] + [0] * 6
    data = struct.pack("<iIQ6Q", syscall, arch, 0, *padded[:6])
    code = list(struct.iter_unpack("<HBBI", program))
    acc = pc = 0
    while True:
        op, jt, jf, k = code[pc]
        pc += 1
        if op == BPF_LD_W_ABS:
            (acc,) = struct.unpack_from("<I", data, k)
        elif op == BPF_ALU_AND_K:
            acc &= k
        elif op in BPF_JUMPS:
            pc += jt if BPF_JUMPS[op](acc, k) else jf
        elif op == BPF_RET_K:
            return int(k)
        else:
            raise AssertionError(f"instruction {op:#x} at {pc - 1} is not simulated")


def satisfying(test: seccomp.ArgTest | None) -> list[int]:
    """Arguments for which ``test`` holds."""
    if test is None:
        return []
    args = [0] * 6
    args[test.index] = test.value + 1 if test.cmp is seccomp.Cmp.NE else test.value
    return args


@pytest.mark.large
def test_build_filter_is_whole_instructions_and_deterministic() -> None:
    program = seccomp.build_filter()
    assert program
    assert len(program) % 8 == 0  # struct sock_filter is 8 bytes
    assert seccomp.build_filter() is program  # compiled once per process
    assert seccomp.build_filter.__wrapped__() == program
    assert seccomp.build_filter.__wrapped__() == program


@pytest.mark.large
def test_open_filter_fd_reads_the_program_from_its_start() -> None:
    fd = seccomp.open_filter_fd()
    try:
        assert not os.get_inheritable(fd)
        with os.fdopen(os.dup(fd), "rb") as f:
            assert f.read() == seccomp.build_filter()
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("group", "rule"),
    [(g, r) for g in seccomp.syscall_rules() for r in g.rules],
    ids=lambda x: x.name if isinstance(x, seccomp.Group) else str(x),
)
@pytest.mark.large
def test_every_rule_refuses_with_its_errno(group: seccomp.Group, rule: seccomp.Rule) -> None:
    action = run_bpf(seccomp.build_filter(), nr(rule.syscall), satisfying(rule.when))
    assert action == errno_action(group.errno)


def test_table_errnos() -> None:
    by_call = {str(rule): group.errno for group in seccomp.syscall_rules() for rule in group.rules}
    assert by_call["clone3"] == errno.ENOSYS
    assert by_call["ptrace"] == errno.EPERM
    assert by_call["unshare"] == errno.EPERM
    assert by_call["mount_setattr"] == errno.EPERM
    assert by_call["socket if arg0 >= 0xb"] == errno.EAFNOSUPPORT


THREAD_FLAGS = 0x3D0F00  # glibc's pthread_create: VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|...
FORK_FLAGS = 0x01200011  # glibc's fork: CHILD_SETTID|CHILD_CLEARTID|SIGCHLD

ALLOWED_CALLS = [
    ("clone", [FORK_FLAGS]),
    ("clone", [THREAD_FLAGS]),
    ("prctl", [15]),  # PR_SET_NAME
    ("madvise", [0, 4096, 4]),  # MADV_DONTNEED
    ("mprotect", [0, 4096, 1]),
    ("mmap", []),
    ("sched_setscheduler", [0, 5]),  # SCHED_IDLE
    ("mbind", []),
    ("set_mempolicy", []),
    ("get_mempolicy", []),
    ("personality", [0]),
    ("socket", [socket.AF_UNIX]),
    ("socket", [socket.AF_INET]),
    ("socket", [socket.AF_INET6]),
    ("socketpair", [socket.AF_UNIX]),
    ("ioctl", [0, termios.TCGETS]),
    ("ioctl", [0, termios.FIONREAD]),
    ("read", []),
    ("getpid", []),
]


@pytest.mark.parametrize(("name", "args"), ALLOWED_CALLS, ids=lambda x: str(x))
@pytest.mark.large
def test_ordinary_calls_are_allowed(name: str, args: list[int]) -> None:
    assert run_bpf(seccomp.build_filter(), nr(name), args) == ALLOW


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        # The kernel reads the ioctl request and socket's domain as 32-bit ints and the
        # personality as unsigned int: junk in the high half must not slip past the filter.
        ("ioctl", [0, termios.TIOCSTI | 1 << 32], errno.EPERM),
        ("ioctl", [0, termios.TIOCSTI | 0xFFFFFFFF00000000], errno.EPERM),
        ("socket", [socket.AF_UNIX | 1 << 32], errno.EAFNOSUPPORT),
        ("socket", [-1], errno.EAFNOSUPPORT),
        ("personality", [1 << 32], errno.EPERM),
        ("personality", [0xFFFFFFFF], errno.EPERM),
        ("clone", [CLONE_NEWUSER | THREAD_FLAGS], errno.EPERM),
        ("clone", [sum(CLONE_NEW_FLAGS.values())], errno.EPERM),
    ],
    ids=str,
)
@pytest.mark.large
def test_argument_edges(name: str, args: list[int], expected: int) -> None:
    assert run_bpf(seccomp.build_filter(), nr(name), args) == errno_action(expected)


@pytest.mark.skipif(not X86_64, reason="i386 and x32 are x86_64's other ABIs")
@pytest.mark.large
def test_other_abis_get_enosys() -> None:
    program = seccomp.build_filter()
    assert run_bpf(program, 20, arch=AUDIT_ARCH_I386) == errno_action(errno.ENOSYS)  # getpid
    assert run_bpf(program, X32_SYSCALL_BIT | nr("getpid")) == errno_action(errno.ENOSYS)


@pytest.mark.large
def test_interpreter_allows_what_an_empty_filter_allows() -> None:
    """The interpreter can say ALLOW for a refused call: the checks above can fail."""
    lib = _lib()
    empty = lib.SyscallFilter(lib.ALLOW)
    with tempfile.TemporaryFile() as f:
        empty.export_bpf(f)
        f.seek(0)
        program = f.read()
    assert run_bpf(program, nr("ptrace")) == ALLOW


# -- 2. the program in the kernel, through bwrap ------------------------------------------------


class Probe(NamedTuple):
    act: Callable[[], int]  # 0: it worked; else the errno it failed with
    expected: int  # under the filter
    # Without the filter the kernel answers something other than ``expected`` (refusals) or
    # the act works too (allowed acts). False where that depends on the kernel's build.
    discriminating: bool = True


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def raw(name: str, *args: int) -> int:
    """``syscall(name, args...)``: 0 when it succeeded, else its errno."""
    libc = _libc()
    ctypes.set_errno(0)
    result = libc.syscall(ctypes.c_long(nr(name)), *(ctypes.c_ulong(a) for a in args))
    return ctypes.get_errno() if result == -1 else 0


def raw_nr(number: int) -> int:
    libc = _libc()
    result = libc.syscall(ctypes.c_long(number))
    return ctypes.get_errno() if result == -1 else 0


def errno_of(act: Callable[[], object]) -> int:
    try:
        act()
    except OSError as exc:
        return exc.errno or -2
    return 0


def _on_controlling_pty(request: int) -> int:
    """``ioctl(request, NULL)`` on a pty made our controlling terminal: without the filter the
    kernel lets the terminal's own session use TIOCSTI and then faults on the NULL pointer."""
    os.setsid()
    _master, slave = os.openpty()  # the master is left open: closing it hangs the pty up
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    return raw("ioctl", slave, request, 0)


def _clone_new(flag: int) -> int:
    # CLONE_SIGHAND without CLONE_VM: EINVAL from the kernel before any child exists.
    return raw("clone", flag | CLONE_SIGHAND, 0, 0, 0, 0)


def _on_pty(request: int) -> int:
    _master, slave = os.openpty()  # the master is left open: closing it hangs the pty up
    return raw("ioctl", slave, request, 0)


def _socket(family: int, kind: int = socket.SOCK_DGRAM) -> int:
    return errno_of(lambda: socket.socket(family, kind).close())


def _socketpair(family: int) -> int:
    try:
        ends = socket.socketpair(family, socket.SOCK_DGRAM)
    except OSError as exc:
        return exc.errno or -2
    for end in ends:
        end.close()
    return 0


def _fork() -> int:
    child = os.fork()
    if child == 0:
        os._exit(7)
    _, status = os.waitpid(child, 0)
    return 0 if os.waitstatus_to_exitcode(status) == 7 else errno.ECHILD


def _thread() -> int:
    seen = []
    t = threading.Thread(target=lambda: seen.append(threading.get_native_id()))
    t.start()
    t.join()
    return 0 if seen and seen[0] != threading.get_native_id() else errno.ESRCH


def _memory() -> int:
    libc = _libc()
    region = mmap.mmap(-1, mmap.PAGESIZE)
    region.madvise(mmap.MADV_DONTNEED)
    anchor = ctypes.c_char.from_buffer(region)
    result = libc.mprotect(ctypes.c_void_p(ctypes.addressof(anchor)), mmap.PAGESIZE, 1)
    return ctypes.get_errno() if result == -1 else 0


def _prctl_set_name() -> int:
    libc = _libc()
    return ctypes.get_errno() if libc.prctl(15, b"probe", 0, 0, 0) == -1 else 0  # PR_SET_NAME


def _sched_idle() -> int:
    return errno_of(lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)))


def _numpy() -> int:
    try:
        import numpy as np
    except ImportError:
        return NUMPY_MISSING
    matrix = np.arange(1, 10, dtype=float).reshape(3, 3) + np.eye(3)
    solved = np.linalg.solve(matrix, matrix @ np.ones(3))
    return 0 if np.allclose(solved, 1.0) else errno.EDOM


def _i386_getpid() -> int:
    """i386's getpid through ``int 0x80``; the negated errno is in eax on failure."""
    code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20; int 0x80; ret
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    result: int = ctypes.CFUNCTYPE(ctypes.c_int)(address)()
    return -result if result < 0 else 0


PROBES: dict[str, Probe] = {
    # Refused. Arguments that make the kernel fail otherwise are noted.
    "ptrace traceme": Probe(lambda: raw("ptrace", 0), errno.EPERM),  # works
    "process_vm_readv": Probe(lambda: raw("process_vm_readv", 1, 0, 0, 0, 0, 1), errno.EPERM),
    "kcmp": Probe(lambda: raw("kcmp", os.getpid(), os.getpid(), 100, 0, 0), errno.EPERM),
    "personality no aslr": Probe(lambda: raw("personality", ADDR_NO_RANDOMIZE), errno.EPERM),
    "perf_event_open": Probe(
        lambda: raw("perf_event_open", 0, 0, 2**64 - 1, 2**64 - 1, 0), errno.EPERM
    ),  # EFAULT
    "chroot": Probe(lambda: raw("chroot", 1), errno.EPERM),  # EFAULT
    "mount": Probe(lambda: raw("mount", 0, 1, 0, 0, 0), errno.EPERM),  # EFAULT
    "umount2": Probe(lambda: raw("umount2", 0, 0x100), errno.EPERM),  # EINVAL: flags
    "open_tree": Probe(lambda: raw("open_tree", 2**64 - 1, 0, 1 << 28), errno.EPERM),
    "name_to_handle_at": Probe(
        lambda: raw("name_to_handle_at", 2**64 - 1, 0, 0, 0, 1 << 28), errno.EPERM
    ),
    "keyctl": Probe(lambda: raw("keyctl", 0x7FFF, 0, 0, 0, 0), errno.EPERM),  # EOPNOTSUPP
    "clock_settime": Probe(lambda: raw("clock_settime", 1000, 0), errno.EPERM),  # EINVAL
    "unshare newuser": Probe(lambda: raw("unshare", CLONE_NEWUSER), errno.EPERM, False),
    "unshare newuser|vfork": Probe(
        lambda: raw("unshare", CLONE_NEWUSER | CLONE_VFORK), errno.EPERM
    ),  # EINVAL
    "setns": Probe(lambda: raw("setns", 2**64 - 1, 0), errno.EPERM),  # EBADF
    **{
        f"clone {name}": Probe(functools.partial(_clone_new, flag), errno.EPERM)
        for name, flag in CLONE_NEW_FLAGS.items()
    },
    "clone3": Probe(lambda: raw("clone3", 0, 0), errno.ENOSYS),  # EINVAL: size 0
    "io_uring_setup": Probe(lambda: raw("io_uring_setup", 1, 0), errno.ENOSYS, False),
    "ioctl TIOCSTI": Probe(lambda: _on_controlling_pty(termios.TIOCSTI), errno.EPERM),
    "ioctl TIOCSTI high bits": Probe(
        lambda: _on_controlling_pty(termios.TIOCSTI | 1 << 32), errno.EPERM
    ),
    "ioctl TIOCLINUX": Probe(lambda: _on_pty(termios.TIOCLINUX), errno.EPERM),  # ENOTTY
    "socket netlink": Probe(lambda: _socket(socket.AF_NETLINK), errno.EAFNOSUPPORT),
    "socket packet": Probe(
        lambda: _socket(socket.AF_PACKET, socket.SOCK_RAW), errno.EAFNOSUPPORT
    ),  # EPERM: no CAP_NET_RAW
    "socketpair netlink": Probe(lambda: _socketpair(socket.AF_NETLINK), errno.EAFNOSUPPORT),
    # Allowed.
    "fork": Probe(_fork, 0),
    "thread": Probe(_thread, 0),
    "socket unix": Probe(lambda: _socket(socket.AF_UNIX), 0),
    "socket inet": Probe(lambda: _socket(socket.AF_INET), 0),
    "socketpair unix": Probe(lambda: _socketpair(socket.AF_UNIX), 0),
    "personality linux": Probe(lambda: raw("personality", 0), 0),
    "prctl set name": Probe(_prctl_set_name, 0),
    "mprotect madvise": Probe(_memory, 0),
    "sched idle": Probe(_sched_idle, 0),
    "tcgetattr": Probe(lambda: errno_of(lambda: termios.tcgetattr(os.openpty()[1])), 0),
    "numpy": Probe(_numpy, 0),
}
if X86_64:
    PROBES["i386 int 0x80"] = Probe(_i386_getpid, errno.ENOSYS, False)
    PROBES["x32 getpid"] = Probe(
        lambda: raw_nr(X32_SYSCALL_BIT | nr("getpid")), errno.ENOSYS, False
    )


def probe_main() -> None:
    """In the sandbox: each probe in a child of its own (a probe may change the process:
    a new session, a tracer), results as JSON on stdout."""
    results: dict[str, int | str] = {}
    for name, probe in PROBES.items():
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read_end)
            try:
                result: int | str = probe.act()
            except BaseException as exc:
                result = f"raised {exc!r}"
            os.write(write_end, json.dumps(result).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            said = pipe.read()
        _, status = os.waitpid(child, 0)
        if said:
            results[name] = json.loads(said)
        else:
            results[name] = f"died: wait status {status:#x}"
    print(json.dumps(results))


class Runs(NamedTuple):
    filtered: dict[str, int | str]
    control: dict[str, int | str]


def _sandboxed(extra: list[str], pass_fds: tuple[int, ...] = ()) -> dict[str, int | str]:
    command = [
        BWRAP,
        *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"),
        *("--unshare-pid", "--cap-drop", "ALL", "--die-with-parent"),
        *extra,
        sys.executable,
        "-c",
        f"import runpy, sys; runpy.run_path(sys.argv[1], run_name={PROBE_RUN_NAME!r})",
        __file__,
    ]
    done = subprocess.run(
        command, pass_fds=pass_fds, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"probe run failed ({done.returncode}):\n{done.stderr}"
    results: dict[str, int | str] = json.loads(done.stdout)
    return results


@pytest.fixture(scope="module")
def runs() -> Runs:
    if not os.path.exists(BWRAP):
        pytest.skip("bwrap is not installed")
    trial = subprocess.run(
        [BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if trial.returncode != 0:
        pytest.skip(f"bwrap cannot make a sandbox here: {trial.stderr.strip()}")
    fd = seccomp.open_filter_fd()
    try:
        filtered = _sandboxed(["--seccomp", str(fd)], pass_fds=(fd,))
    finally:
        os.close(fd)
    return Runs(filtered, _sandboxed([]))


def _skip_unless_testable(name: str, runs: Runs) -> None:
    if name == "numpy" and runs.filtered[name] == NUMPY_MISSING:
        pytest.skip("numpy is not installed")
    if name == "i386 int 0x80" and runs.control[name] != 0:
        pytest.skip(f"this kernel runs no i386 system calls ({runs.control[name]})")


@pytest.mark.parametrize("name", list(PROBES))
def test_in_the_sandbox(name: str, runs: Runs) -> None:
    _skip_unless_testable(name, runs)
    got = runs.filtered[name]
    expected = PROBES[name].expected
    assert got == expected, (
        f"{name}: got {got} ({_strerror(got)}), expected {expected} ({_strerror(expected)})"
    )


@pytest.mark.parametrize("name", [n for n, p in PROBES.items() if p.discriminating])
def test_without_the_filter(name: str, runs: Runs) -> None:
    """The probe tells the filter's answer from the kernel's own."""
    _skip_unless_testable(name, runs)
    got = runs.control[name]
    expected = PROBES[name].expected
    if expected == 0:
        assert got == 0, f"{name} fails even without the filter: {got} ({_strerror(got)})"
    else:
        assert got != expected, f"{name}: the kernel alone answers {got} ({_strerror(got)})"


def _strerror(value: int | str) -> str:
    return os.strerror(value) if isinstance(value, int) and value > 0 else str(value)


if __name__ == PROBE_RUN_NAME:
    probe_main()
