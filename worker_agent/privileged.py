"""What the agent runs with privileges on a rank's behalf, and how it never runs the rank's code.

A checkpoint of a sandboxed rank runs CRIU as root, with every capability, inside the rank's
PID, mount, network, IPC and UTS namespaces (``criu.dump``: CRIU cannot dump a process of a
nested PID namespace from outside, and it sees the rank's files on the rank's mounts). Inside
the rank's mount namespace every path is the rank's to plant: an ``/etc/ld.so.preload``, a
``criu`` in a directory of ``PATH``, a ``~/.criu/default.conf``, a library where the dynamic
loader looks. So nothing of that program is looked up in there:

- the program is resolved here, in the agent's own mount namespace, on a fixed ``PATH``
  (``FIXED_PATH``), to a file that only root (or the agent's user) can change, along with its
  ELF interpreter (the dynamic loader) and the directories of the libraries it needs
  (``resolve``, ``Program``);
- ``ns_exec`` (a standard-library script started by the agent's interpreter, in the agent's
  namespaces) opens those files before it enters the rank's namespaces, enters them by a
  pidfd, and executes the loader *by its descriptor*, asking it to load the program and its
  libraries through ``/proc/self/fd/N`` (magic links to the agent's files whatever the mount
  namespace), with the loader's cache inhibited and an environment of ``PATH`` alone (no
  ``LD_*``, no ``HOME``);
- the one file the loader always reads, ``/etc/ld.so.preload``, cannot be kept from it: so
  ``ns_exec`` refuses to run anything unless the rank's ``/`` and ``/etc`` are read-only
  mounts with no such file (which the sandbox makes them: ``sandbox.command``'s
  ``--remount-ro /``; a rank without capabilities cannot remount), and says so.

CRIU's own configuration files are ignored by ``--no-default-config`` (``criu``), in the
agent's namespaces too.

Errors: ``UntrustedProgram`` (the program, its loader or a library directory can be changed by
someone other than root or the agent's user, or is not where it should be).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vpool.worker_agent.errors import AgentError

# Where a privileged program is looked up: the system's directories, never the agent's PATH.
FIXED_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NS_EXEC_SCRIPT = Path(__file__).with_name("ns_exec.py")
# ns_exec's exit status when it refused (the rank's view could have planted a file).
EXIT_REFUSED = 126

_LDD_PATH = re.compile(r"=>\s*(/\S+)\s+\(0x[0-9a-f]+\)")
_PT_INTERP = 3


class UntrustedProgram(AgentError):
    """A program the agent would run with privileges is not one only root can change."""


@dataclass(frozen=True)
class Program:
    """A program resolved in the agent's namespaces: what ``ns_exec`` opens before entering."""

    path: str  # absolute, symlinks resolved
    loader: str = ""  # its ELF interpreter ("" for a static executable)
    libdirs: tuple[str, ...] = ()  # where its libraries were found here

    def ns_exec_argv(
        self, target: int, args: list[str], *, python: str = sys.executable
    ) -> list[str]:
        """The command that runs this program with ``args`` in host pid ``target``'s PID,
        mount, network, IPC and UTS namespaces (``ns_exec``)."""
        argv = [python, "-I", "-S", str(NS_EXEC_SCRIPT), "--target", str(target)]
        argv += ["--program", self.path]
        if self.loader:
            argv += ["--loader", self.loader]
        for directory in self.libdirs:
            argv += ["--libdir", directory]
        return [*argv, "--", *args]


def which(name: str) -> str:
    """``name``'s absolute path on ``FIXED_PATH`` (a path is taken as is); "" if none."""
    if os.sep in name:
        return os.path.abspath(name)
    return shutil.which(name, path=FIXED_PATH) or ""


def check_trusted(path: str, *, kind: str = "file") -> None:
    """Raise ``UntrustedProgram`` unless ``path`` and every directory above it belong to
    root or to this process's user and cannot be written by anyone else."""
    owners = {0, os.getuid()}
    current = Path(path)
    for place in (current, *current.parents):
        try:
            st = os.lstat(place)
        except OSError as exc:
            raise UntrustedProgram(f"cannot inspect {place}: {exc}") from exc
        if stat.S_ISLNK(st.st_mode):
            raise UntrustedProgram(f"{place} is a symbolic link (resolve {path} first)")
        if st.st_uid not in owners:
            raise UntrustedProgram(
                f"the {kind} {path} is not trusted: {place} belongs to uid {st.st_uid}"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UntrustedProgram(
                f"the {kind} {path} is not trusted: {place} is writable by others "
                f"(mode {stat.filemode(st.st_mode)})"
            )


def elf_interpreter(path: str) -> str:
    """The ELF interpreter (``PT_INTERP``) of executable ``path``; "" for a static one.
    Raises ``UntrustedProgram`` for a file that is not an ELF executable (a script's
    interpreter would be looked up in the rank's view)."""
    try:
        with open(path, "rb") as f:
            header = f.read(64)
            if header[:4] != b"\x7fELF" or len(header) < 52:
                raise UntrustedProgram(f"{path} is not an ELF executable")
            wide = header[4] == 2
            order = "<" if header[5] == 1 else ">"
            if wide:
                phoff, phentsize, phnum = struct.unpack_from(order + "Q14xHH", header, 32)
                entry = order + "II QQQQ"
            else:
                phoff, phentsize, phnum = struct.unpack_from(order + "I10xHH", header, 28)
                entry = order + "I IIIII"
            for i in range(phnum):
                f.seek(phoff + i * phentsize)
                raw = f.read(phentsize)
                fields = struct.unpack_from(entry, raw)
                p_type = fields[0]
                offset, size = (fields[2], fields[5]) if wide else (fields[1], fields[4])
                if p_type == _PT_INTERP:
                    f.seek(offset)
                    return f.read(size).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError) as exc:
        raise UntrustedProgram(f"cannot read {path} as an ELF executable: {exc}") from exc
    return ""


def library_dirs(path: str) -> tuple[str, ...]:
    """The directories (symlinks resolved) where this machine's loader finds ``path``'s
    libraries, in the order ``ldd`` lists them."""
    try:
        answer = subprocess.run(
            ["ldd", path],
            capture_output=True,
            check=False,
            timeout=30,
            env={"PATH": FIXED_PATH},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UntrustedProgram(f"cannot list the libraries of {path}: {exc}") from exc
    dirs: dict[str, None] = {}
    for lib in _LDD_PATH.findall(answer.stdout.decode(errors="surrogateescape")):
        dirs.setdefault(os.path.dirname(os.path.realpath(lib)), None)
    return tuple(dirs)


@functools.cache
def resolve(name: str) -> Program:
    """``name`` (a path, or looked up on ``FIXED_PATH``) as a ``Program`` whose every file
    only root or this user can change (raises ``UntrustedProgram``). Blocking; cached."""
    found = which(name)
    if not found or not os.path.isfile(found):
        raise UntrustedProgram(f"{name} not found (looked up on {FIXED_PATH})")
    path = os.path.realpath(found)
    check_trusted(path, kind="program")
    loader = elf_interpreter(path)
    libdirs: tuple[str, ...] = ()
    if loader:
        loader = os.path.realpath(loader)
        check_trusted(loader, kind="dynamic loader")
        libdirs = library_dirs(path)
        for directory in libdirs:
            check_trusted(directory, kind="library directory")
    return Program(path, loader, libdirs)
