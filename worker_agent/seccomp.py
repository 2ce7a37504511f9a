"""The seccomp filter of a rank's sandbox: which system calls it refuses, and with which errno.

bubblewrap loads it (``bwrap --seccomp FD``, with ``open_filter_fd()`` as FD) just before it
execs the sandbox's first program, so every process of the sandbox carries it and cannot drop
it. The rules follow Flatpak's ``setup_seccomp`` (``common/flatpak-run.c``), which descends
from linux-user-chroot and Sandstorm: everything is allowed except calls a volunteer's machine
should never see from a stranger's program, and each refusal fails with an errno the program
can handle rather than killing it. The table is ``syscall_rules()``, one ``Group`` per concern:

- other processes' memory and state: ``ptrace``, ``process_vm_readv``/``writev`` and ``kcmp``;
- ``personality`` other than plain ``PER_LINUX`` (no ASLR switch-off, no foreign ABIs);
- kernel attack surface a compute job does not need: ``perf_event_open``, ``bpf``,
  ``userfaultfd``, and io_uring (the last with ENOSYS, see its group);
- administering the machine: modules, kexec, reboot, swap, clocks, accounting, quotas, the
  kernel log, I/O ports, ``vhangup``, ``uselib``, ``modify_ldt``, file handles;
- changing the filesystem view: ``chroot``, ``pivot_root``, ``mount`` and the new mount API;
- the kernel keyrings, which are shared beyond the sandbox;
- new namespaces: ``unshare``, ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag.
  ``clone3`` fails with ENOSYS whatever it asks: its flags sit in a struct seccomp cannot
  read, and glibc then falls back to ``clone``, which the filter can check;
- typing into the terminal: ``ioctl`` ``TIOCSTI`` and ``TIOCLINUX``;
- sockets other than ``AF_UNIX``, ``AF_INET`` and ``AF_INET6``, with EAFNOSUPPORT (netlink,
  packet, bluetooth, vsock ... reach kernel code the job has no use for).

Calls of a process's own life stay allowed: ``clone`` and ``fork`` without namespace flags,
threads, ``prctl``, ``mmap``/``mprotect``/``madvise``, ``sched_setscheduler`` (the rank runs
at ``SCHED_IDLE``), and the NUMA calls (``mbind``, ``set_mempolicy``, ``move_pages`` ...),
which Flatpak refuses but which OpenBLAS, hwloc and MPI libraries use to place their memory.
CRIU dumps and restores a process that carries this filter: it runs outside the sandbox and
saves and reloads the filter itself.

Only the native ABI passes: a system call through any other one the kernel accepts (i386's
``int 0x80`` or an x32 call on x86_64, arm32 on aarch64) fails with ENOSYS, as on a kernel built
without it. Flatpak instead adds the i386 ABI with the same rules for multiarch apps; ranks are
native CPython, so a second ABI would only be a second door to guard.

Errors: ``SeccompError`` (an ``AgentError``): libseccomp is missing or refused a rule.
"""

from __future__ import annotations

import enum
import errno
import functools
import os
import platform
import socket
import termios
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from vpool.worker_agent.errors import AgentError

__all__ = [
    "ArgTest",
    "Cmp",
    "Group",
    "Rule",
    "SeccompError",
    "build_filter",
    "open_filter_fd",
    "syscall_rules",
]


class SeccompError(AgentError):
    """The filter cannot be built here: libseccomp is missing or does not know a call."""


class Cmp(enum.Enum):
    """How an argument is compared; the names are libseccomp's (``SCMP_CMP_*``)."""

    EQ = "=="
    NE = "!="
    GE = ">="
    MASKED_EQ = "&=="


@dataclass(frozen=True, slots=True)
class ArgTest:
    """``arg[index] OP value``, or for ``MASKED_EQ`` ``arg[index] & mask == value``."""

    index: int
    cmp: Cmp
    value: int
    mask: int = 0

    def __str__(self) -> str:
        if self.cmp is Cmp.MASKED_EQ:
            return f"arg{self.index} & {self.mask:#x} == {self.value:#x}"
        return f"arg{self.index} {self.cmp.value} {self.value:#x}"


@dataclass(frozen=True, slots=True)
class Rule:
    """One refused call: ``syscall``, every time (``when`` is None) or when ``when`` holds.

    One test at most: libseccomp 2.5 rejects two comparisons of the same argument in a rule,
    and no rule here needs two arguments. Refusing a call under several conditions takes
    several rules.
    """

    syscall: str
    when: ArgTest | None = None

    def __str__(self) -> str:
        return self.syscall if self.when is None else f"{self.syscall} if {self.when}"


@dataclass(frozen=True, slots=True)
class Group:
    """Calls refused for one reason, all with the same errno."""

    name: str
    errno: int
    why: str
    rules: tuple[Rule, ...]


def _every(*syscalls: str) -> tuple[Rule, ...]:
    return tuple(Rule(name) for name in syscalls)


# The kernel's clone() takes its flags first, except on CONFIG_CLONE_BACKWARDS2 machines
# (s390), where the child's stack comes first; Flatpak makes the same distinction.
_CLONE_FLAGS_ARG: Final = 1 if platform.machine() in ("s390", "s390x") else 0

_CLONE_NEW_FLAGS: Final = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

_PER_LINUX: Final = 0

# Ascending. The kernel reads socket()'s domain as an int, the filter the whole register: a
# value with stray high bits is refused even where the kernel would have read an allowed
# family, never the other way round.
_SOCKET_FAMILIES_ALLOWED: Final = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)

# The ioctl request is compared on its low 32 bits only, as Flatpak does, because the kernel
# reads it as an unsigned int: TIOCSTI with junk in the high half is still TIOCSTI.
_IOCTL_REQUEST_MASK: Final = 0xFFFFFFFF


def _families_refused(syscall: str) -> tuple[Rule, ...]:
    """Refuse every domain of ``syscall`` (arg 0) but the allowed families: the gaps, then
    everything above the highest, as Flatpak's socket rules do (seccomp has no "not in")."""
    rules = []
    below = 0
    for family in _SOCKET_FAMILIES_ALLOWED:
        rules += [Rule(syscall, ArgTest(0, Cmp.EQ, gap)) for gap in range(below, family)]
        below = family + 1
    rules.append(Rule(syscall, ArgTest(0, Cmp.GE, below)))
    return tuple(rules)


_GROUPS: Final = (
    Group(
        "other processes",
        errno.EPERM,
        "Reading or changing another process's memory, or comparing its kernel objects, is "
        "how one rank would spy on another (or on a clone being checkpointed). kcmp, which "
        "Flatpak allows, is refused too: it is a ptrace-family probe that only debuggers, "
        "CRIU (which runs outside the sandbox) and GPU drivers (absent here) use.",
        _every("ptrace", "process_vm_readv", "process_vm_writev", "kcmp"),
    ),
    Group(
        "personality",
        errno.EPERM,
        "Only PER_LINUX, as in Flatpak: other personalities switch off address space "
        "randomisation (ADDR_NO_RANDOMIZE) or emulate other systems. The query "
        "personality(0xffffffff) is refused too: seccomp cannot say 'neither 0 nor "
        "0xffffffff' in a rule, and nothing a rank runs asks.",
        (Rule("personality", ArgTest(0, Cmp.NE, _PER_LINUX)),),
    ),
    Group(
        "kernel attack surface",
        errno.EPERM,
        "Profiling, eBPF and userfaultfd: rich kernel interfaces with a long record of "
        "privilege escalations, and of no use to a compute job.",
        _every("perf_event_open", "bpf", "userfaultfd"),
    ),
    Group(
        "io_uring",
        errno.ENOSYS,
        "CRIU cannot checkpoint a process that holds an io_uring, and io_uring has had many "
        "privilege escalations (Docker refuses it too). ENOSYS, as from a kernel without it, "
        "makes libraries that try it (libuv, liburing users) fall back to ordinary calls.",
        _every("io_uring_setup", "io_uring_enter", "io_uring_register"),
    ),
    Group(
        "machine administration",
        errno.EPERM,
        "Modules, kexec, reboot, swap, clocks, process accounting, quotas, the kernel log, "
        "I/O ports, vhangup, uselib: the volunteer's machine is not the job's to administer. "
        "Most already need a capability the sandbox lacks; the filter keeps even the "
        "capability checks out of reach. modify_ldt is refused as Flatpak does outside "
        "multiarch: it serves 16-bit code only and has leaked kernel memory before.",
        _every(
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "reboot",
            "swapon",
            "swapoff",
            "settimeofday",
            "clock_settime",
            "clock_adjtime",
            "adjtimex",
            "acct",
            "quotactl",
            "lookup_dcookie",
            "syslog",
            "iopl",
            "ioperm",
            "vhangup",
            "uselib",
            "modify_ldt",
        ),
    ),
    Group(
        "file handles",
        errno.EPERM,
        "open_by_handle_at opens a file by inode handle, bypassing the path (and so any bind "
        "mount of the sandbox: the 'shocker' container escape); name_to_handle_at makes the "
        "handles.",
        _every("open_by_handle_at", "name_to_handle_at"),
    ),
    Group(
        "filesystem view",
        errno.EPERM,
        "The sandbox's mounts are bwrap's to set. chroot is harmless without CAP_SYS_CHROOT, "
        "which the sandbox lacks, and is refused anyway so that the filter alone holds. The "
        "new mount API (fsopen and friends) is refused with EPERM like mount(); Flatpak uses "
        "ENOSYS there so that libmount falls back to mount(), which fails with EPERM all the "
        "same.",
        _every(
            "chroot",
            "pivot_root",
            "mount",
            "umount2",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "open_tree",
            "move_mount",
            "mount_setattr",
        ),
    ),
    Group(
        "kernel keyrings",
        errno.EPERM,
        "Keyrings are not namespaced: a user's keys (Kerberos tickets, disk keys) would be "
        "reachable from the sandbox.",
        _every("keyctl", "add_key", "request_key"),
    ),
    Group(
        "new namespaces",
        errno.EPERM,
        "A new user namespace grants every capability inside it and opens kernel code meant "
        "for root; the other namespaces would let a rank undo bwrap's view. clone() without "
        "namespace flags (fork, threads) stays allowed; each flag is its own rule because "
        "seccomp can only test one mask per rule.",
        (
            *_every("unshare", "setns"),
            *(
                Rule("clone", ArgTest(_CLONE_FLAGS_ARG, Cmp.MASKED_EQ, flag, mask=flag))
                for flag in _CLONE_NEW_FLAGS.values()
            ),
        ),
    ),
    Group(
        "clone3",
        errno.ENOSYS,
        "clone3's flags are in a struct behind a pointer that seccomp cannot read, so it "
        "cannot be told apart from a namespace-creating one (CVE-2021-41133). ENOSYS makes "
        "glibc fall back to clone(), which the filter checks.",
        _every("clone3"),
    ),
    Group(
        "terminal input",
        errno.EPERM,
        "TIOCSTI pushes characters into a terminal's input, to be run by the shell outside "
        "once the rank exits (CVE-2017-5226); TIOCLINUX's paste does the same on a virtual "
        "console (CVE-2023-28100).",
        tuple(
            Rule("ioctl", ArgTest(1, Cmp.MASKED_EQ, request, mask=_IOCTL_REQUEST_MASK))
            for request in (termios.TIOCSTI, termios.TIOCLINUX)
        ),
    ),
    Group(
        "socket families",
        errno.EAFNOSUPPORT,
        "Only AF_UNIX, AF_INET and AF_INET6. The sandbox has no network, but inet stays so "
        "that programs probing socket(AF_INET) get an ordinary error later rather than here; "
        "netlink, packet and the rest reach kernel code a rank does not need. EAFNOSUPPORT is "
        "what a kernel without that family says.",
        (*_families_refused("socket"), *_families_refused("socketpair")),
    ),
)


def syscall_rules() -> tuple[Group, ...]:
    """The filter's table: every refused call, grouped by reason with its errno."""
    return _GROUPS


@functools.cache
def build_filter() -> bytes:
    """The filter as a classic-BPF program for the native architecture (``struct
    sock_filter`` array, what ``bwrap --seccomp`` reads), compiled once per process."""
    return _compile(_GROUPS)


def open_filter_fd() -> int:
    """A new descriptor reading ``build_filter()`` from its start, for ``bwrap --seccomp FD``.

    Non-inheritable (pass it with ``pass_fds``); the caller closes it once bwrap is started.
    """
    program = build_filter()
    fd = os.memfd_create("vpool-seccomp", os.MFD_CLOEXEC)
    try:
        view = memoryview(program)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


# libseccomp does not promise thread safety (it keeps process-wide state such as its API
# level), and two threads may both miss the cache and build at once.
_compile_lock = threading.Lock()


def _compile(groups: Iterable[Group]) -> bytes:
    # Imported here, not at the top: pyseccomp loads libseccomp.so.2 on import and raises
    # RuntimeError without it, which must become a SeccompError for the agent, not an
    # ImportError of this module.
    try:
        import pyseccomp  # type: ignore[import-untyped]  # no py.typed; used through Any
    except (ImportError, RuntimeError) as exc:
        raise SeccompError(f"cannot load libseccomp: {exc}") from exc
    lib: Any = pyseccomp
    with _compile_lock:
        program = lib.SyscallFilter(lib.ALLOW)
        try:
            program.set_attr(lib.Attr.ACT_BADARCH, lib.ERRNO(errno.ENOSYS))
            for group in groups:
                for rule in group.rules:
                    number = lib.resolve_syscall(lib.Arch.NATIVE, rule.syscall)
                    # An unknown name would make libseccomp drop the rule (EINVAL at best):
                    # fail closed rather than hand out a filter with a hole in it.
                    if number == -1:
                        raise SeccompError(f"libseccomp does not know {rule.syscall!r}")
                    program.add_rule(lib.ERRNO(group.errno), number, *_args(lib, rule.when))
            with os.fdopen(os.memfd_create("vpool-seccomp-build"), "w+b") as out:
                program.export_bpf(out)
                out.seek(0)
                code: bytes = out.read()
        except OSError as exc:
            raise SeccompError(f"libseccomp refused the filter: {exc}") from exc
    return code


def _args(lib: Any, test: ArgTest | None) -> tuple[Any, ...]:
    if test is None:
        return ()
    op = getattr(lib, test.cmp.name)
    if test.cmp is Cmp.MASKED_EQ:
        # libseccomp's SCMP_CMP_MASKED_EQ takes the mask first, then the value.
        return (lib.Arg(test.index, op, test.mask, test.value),)
    return (lib.Arg(test.index, op, test.value),)
