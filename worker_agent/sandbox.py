"""The rank's sandbox: what a rank process sees of the volunteer's machine, and how.

Every rank runs under bubblewrap (``bwrap``) in namespaces of its own (PID, network, IPC, UTS,
mount, cgroup), with no capabilities, ``no_new_privs`` and a seccomp filter (``seccomp``). Its
view of the machine is built from nothing (docs/internals.md, "Sandbox"):

- read-only: ``/usr`` (and the ``/bin``, ``/lib``... links into it), a few files of ``/etc``
  the C library and Python need, the interpreter's installation and the ``vpool`` packages;
  ``/etc/passwd`` and ``/etc/group`` are the agent's own two-line files, not the machine's;
- ``/vpool/rank``: the rank's directory (``work``: its program and files, the cwd; ``home``),
  the only place it can write to that outlives it;
- ``/vpool/agent.sock``: the agent's socket, its one channel out (the network namespace has
  only a loopback interface);
- ``/tmp`` and ``/dev/shm``: private tmpfs of a bounded size; a minimal ``/dev``; ``/proc`` of
  its own PID namespace;
- ``/vpool/io`` (a restore only): the FIFOs a restored rank writes its output to;
  ``/vpool/stdin``: rank 0's stdin file, read-only.

The paths inside are the same on every agent, whatever the agent's own layout: a checkpoint
made in one sandbox restores in another machine's (``RANK_DIR`` is what an image records).

The sandbox's pid 1 is ``sandbox_init`` (a fresh start) or ``restore_init`` (a restore, which
alone keeps capabilities in there: CRIU needs them, and gives the restored rank back exactly
the credentials, filter and limits it was dumped with).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from vpool.worker_agent.errors import AgentError

ROOT = "/vpool"
RANK_DIR = "/vpool/rank"
SOCKET = "/vpool/agent.sock"
IO_DIR = "/vpool/io"
STDIN = "/vpool/stdin"
ENV_DIR = "/vpool/env"  # the job's environment (``environments``), read-only
HOSTNAME = "vpool-rank"
INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")

# What of /etc a Python program needs: the dynamic loader's cache and config, the time zone,
# Debian's alternatives (MPICH's libraries are reached through them), fonts and MIME types
# (matplotlib, mimetypes). Nothing that names the volunteer's users or holds secrets.
_ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "alternatives",
    "fonts",
    "mime.types",
    "nsswitch.conf",
    "host.conf",
)
_USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_PRIVATE = ("/tmp", "/dev/shm")  # the rank's own tmpfs
# Host-wide kernel settings and triggers under /proc, read-only in the view: a rank is uid 0
# without capabilities, and writes there check file modes only (a core_pattern of
# "|program" would run as root on the host at the next crash).
_PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
BOOT_ID = "/proc/sys/kernel/random/boot_id"  # the agent's own, not the machine's

# Asked of the rank interpreter: the directories its installation spans.
_PATHS_QUERY = """
import json, sys
print(json.dumps({
    "prefixes": [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix],
    "executable": sys.executable,
    "path": [p for p in sys.path if p],
}))
"""


class SandboxError(AgentError):
    """The sandbox cannot be set up here (bwrap missing or refused, the view incomplete)."""


@dataclass(frozen=True)
class View:
    """The read-only part of a rank's view: host paths bound at the same place inside."""

    ro: tuple[str, ...]
    links: tuple[tuple[str, str], ...]  # (target, link) for /bin -> usr/bin and the like
    etc_dir: Path  # the agent's passwd and group for the sandbox

    @property
    def dirs(self) -> tuple[str, ...]:
        """Every directory that must exist inside for the binds (parents first)."""
        seen: dict[str, None] = {}
        for path in self.ro:
            parts = Path(path).parts
            for i in range(2, len(parts)):
                seen.setdefault(str(Path(*parts[:i])), None)
        return tuple(seen)


@dataclass
class Mounts:
    """The rank's own paths on the host, bound into its sandbox."""

    rank_dir: Path  # at RANK_DIR, read-write
    socket: Path  # at SOCKET
    stdin: Path | None = None  # at STDIN, read-only
    io_dir: Path | None = None  # at IO_DIR, read-only (a restore's FIFOs)
    env_dir: Path | None = None  # at ENV_DIR, read-only (the job's installed requirements)
    extra_ro: tuple[str, ...] = field(default_factory=tuple)


def discover_view(python: str, vpool_dirs: list[str], etc_dir: Path, *extra: str) -> View:
    """The view for ranks run by ``python`` (blocking: asks the interpreter for its paths).

    ``vpool_dirs``: where the ``vpool`` packages live (an editable install has them outside
    the interpreter's prefix); ``extra``: more host paths to show read-only (CRIU's binary, for
    dumps run inside the sandbox's namespaces)."""
    try:
        answer = subprocess.run(
            [python, "-I", "-c", _PATHS_QUERY], capture_output=True, check=False, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"cannot ask {python} for its paths: {exc}") from exc
    if answer.returncode != 0:
        raise SandboxError(
            f"cannot ask {python} for its paths: {answer.stderr.decode(errors='replace')[-500:]}"
        )
    info = json.loads(answer.stdout)
    wanted = [*info["prefixes"], os.path.dirname(info["executable"]), *info["path"]]
    wanted += [*vpool_dirs, *extra]
    _write_etc(etc_dir)
    return View(ro=_roots(wanted), links=_usr_links(), etc_dir=etc_dir)


def _roots(paths: list[str]) -> tuple[str, ...]:
    """Existing paths (symlinks resolved), covered ones and those under /usr dropped."""
    real = set()
    for path in paths:
        resolved = os.path.realpath(path)
        if os.path.exists(resolved):
            real.add(resolved)
        # A venv's bin/python is a link into the base installation: keep the link's place too.
        if os.path.lexists(path) and os.path.abspath(path) != resolved:
            real.add(os.path.abspath(path))
    real.add("/usr")
    kept: list[str] = []
    for path in sorted(real, key=lambda p: (p.count(os.sep), p)):
        if not any(path == k or path.startswith(k.rstrip(os.sep) + os.sep) for k in kept):
            kept.append(path)
    return tuple(kept)


def _usr_links() -> tuple[tuple[str, str], ...]:
    links = []
    for name in _USR_LINKS:
        path = f"/{name}"
        if os.path.islink(path):
            links.append((os.readlink(path), path))
    return tuple(links)


def _write_etc(etc_dir: Path) -> None:
    """passwd and group that name the rank's one user and nobody of the machine."""
    etc_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    uid, gid = os.getuid(), os.getgid()
    home = f"{RANK_DIR}/home"
    files = {
        "passwd": f"rank:x:{uid}:{gid}:vpool rank:{home}:/bin/sh\n"
        + ("" if uid == 65534 else "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"),
        "group": f"rank:x:{gid}:\n" + ("" if gid == 65534 else "nogroup:x:65534:\n"),
        "hosts": f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost\n",
        "hostname": f"{HOSTNAME}\n",
        # Fixed per agent: nothing to tell one boot of the volunteer's machine from another.
        "boot_id": f"{uuid.uuid5(uuid.NAMESPACE_URL, f'vpool-rank:{etc_dir}')}\n",
    }
    for name, text in files.items():
        path = etc_dir / name
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text(text)
            tmp.chmod(0o644)
            os.replace(tmp, path)


def command(
    view: View,
    mounts: Mounts,
    argv: list[str],
    *,
    bwrap: str = "bwrap",
    privileged: bool = False,
    tmp_size: int = 0,
    seccomp_fd: int | None = None,
    info_fd: int | None = None,
) -> list[str]:
    """The ``bwrap`` command line that runs ``argv`` (pid 1) in a rank's sandbox.

    ``privileged``: the init keeps its capabilities (a restore: CRIU runs in there); else it
    has only ``CAP_SETPCAP``, with which ``sandbox_init --drop-bounding`` empties the bounding
    set before it drops it too (as root: bwrap leaves the bounding set full).

    The view is read-only but for the rank's directory, ``/tmp`` and ``/dev/shm``
    (``--remount-ro /``): nothing can be planted where a privileged helper that enters the
    rank's namespaces would look (``privileged``), and ``/proc``'s host-wide settings are
    read-only too. ``tmp_size``: bytes of ``/tmp`` and of ``/dev/shm`` each (0: no bound).
    ``seccomp_fd``: a descriptor holding the filter's BPF program; ``info_fd``: bwrap writes
    ``{"child-pid": N}`` there, N the init's host pid."""
    cmd = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        HOSTNAME,
        # A session of its own: no TIOCSTI into the agent's terminal, no signals to its group.
        "--new-session",
        "--as-pid-1",
        # No --die-with-parent: CRIU restores the parent-death signal, and a restored rank's
        # parent is the restore's init, so it would die the moment CRIU lets go of it.
    ]
    if os.getuid() != 0:
        cmd.append("--unshare-user")
    if privileged:
        cmd += ["--cap-add", "ALL"]
    else:
        cmd += ["--cap-drop", "ALL"]
        if os.getuid() == 0:
            cmd += ["--cap-add", "CAP_SETPCAP"]  # for sandbox_init --drop-bounding only
    # The private file systems first: an installation that lives under /tmp (a checkout, a
    # CI clone) is bound on top of the rank's /tmp, not hidden by it.
    cmd += ["--proc", "/proc"]
    for path in _PROC_READ_ONLY:
        if os.path.exists(path):
            cmd += ["--ro-bind", path, path]
    if os.path.exists(BOOT_ID):
        cmd += ["--ro-bind", str(view.etc_dir / "boot_id"), BOOT_ID]
    cmd += ["--dev", "/dev"]
    for place in _PRIVATE:
        if tmp_size > 0:
            cmd += ["--size", str(tmp_size)]
        cmd += ["--perms", "1777", "--tmpfs", place]
    for path in view.dirs:
        if (
            path not in _PRIVATE
            and path != "/dev"
            and path != "/usr"
            and not path.startswith("/usr/")
        ):
            cmd += ["--perms", "0755", "--dir", path]
    for path in view.ro:
        cmd += ["--ro-bind", path, path]
    for target, link in view.links:
        cmd += ["--symlink", target, link]
    for name in _ETC:
        path = f"/etc/{name}"
        if os.path.exists(path):
            cmd += ["--ro-bind", path, path]
    for name in ("passwd", "group", "hosts", "hostname"):
        cmd += ["--ro-bind", str(view.etc_dir / name), f"/etc/{name}"]
    for path in mounts.extra_ro:
        cmd += ["--ro-bind", path, path]
    cmd += ["--perms", "0755", "--dir", ROOT, "--bind", str(mounts.rank_dir), RANK_DIR]
    cmd += ["--bind", str(mounts.socket), SOCKET]
    if mounts.stdin is not None:
        cmd += ["--ro-bind", str(mounts.stdin), STDIN]
    if mounts.io_dir is not None:
        cmd += ["--ro-bind", str(mounts.io_dir), IO_DIR]
    if mounts.env_dir is not None:
        cmd += ["--ro-bind", str(mounts.env_dir), ENV_DIR]
    # Last: the root and /dev read-only (the mounts made above keep their own flags).
    cmd += ["--remount-ro", "/dev", "--remount-ro", "/"]
    cmd += ["--chdir", f"{RANK_DIR}/work"]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        cmd += ["--info-fd", str(info_fd)]
    return [*cmd, "--", *argv]


def init_argv(
    python: str,
    program: list[str],
    *,
    status_fd: int,
    linger: float,
    stdin: bool,
    nofile: int,
    fsize: int,
    sched_idle: bool,
    data: int = 0,
    nproc: int = 0,
) -> list[str]:
    """``sandbox_init``'s command line (its options: see that module)."""
    argv = [python, "-I", "-S", str(INIT_SCRIPT), "--status-fd", str(status_fd)]
    argv += ["--linger", f"{linger:g}", "--nofile", str(nofile), "--fsize", str(fsize)]
    if data > 0:
        argv += ["--data", str(data)]
    if nproc > 0:
        argv += ["--nproc", str(nproc)]
    if stdin:
        argv += ["--stdin", STDIN]
    if sched_idle:
        argv.append("--sched-idle")
    if os.getuid() == 0:
        argv.append("--drop-bounding")  # with the CAP_SETPCAP ``command`` leaves it
    return [*argv, "--", *program]


def check(bwrap: str, python: str = sys.executable) -> str:
    """Why a sandbox cannot be made here ("" = it can): runs ``true`` in a minimal one."""
    if not bwrap:
        return "bubblewrap (bwrap) is not installed"
    probe = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--as-pid-1",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        "/usr",
        "/usr",
        *[arg for t, link in _usr_links() for arg in ("--symlink", t, link)],
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--",
        "/usr/bin/true",
    ]
    if os.getuid() != 0:
        probe.insert(1, "--unshare-user")
    try:
        result = subprocess.run(probe, capture_output=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {bwrap}: {exc}"
    if result.returncode != 0:
        return f"{bwrap} cannot make a sandbox here: " + (
            result.stderr.decode(errors="replace").strip()[-300:] or f"exit {result.returncode}"
        )
    return ""
