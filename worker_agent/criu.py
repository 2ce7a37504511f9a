"""CRIU for checkpoints: capability check, environment fingerprint, dump, restore command.

A checkpoint image is the memory of a forked clone of the rank (see "Checkpoints (issue 5)" in
``docs/internals.md``). It can only come back on a machine whose mapped files are the same
bytes at the same paths: the fingerprint is a hash of those files (the interpreter, its shared
libraries, every extension module it may have loaded, the ``vpool`` sources), so the
coordinator restores an image only where the fingerprint matches.

Restoring runs ``unshare --pid --fork --mount-proc python -m vpool.worker_agent.restore_init``:
the image's pids are free in a fresh PID namespace, and ``restore_init`` is that namespace's
init, which alone can see the restored process end (CRIU's exit code says nothing about it)
and writes its exit status to a file (``read_status``).

Errors: ``CriuError`` (a dump failed; its message ends with the tail of CRIU's log).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import trio

from vpool.niceness import nice_command
from vpool.worker_agent import privileged
from vpool.worker_agent.errors import AgentError
from vpool.worker_agent.restore_init import PIDFILE_NAME, RESTORE_LOG_NAME, log_tail

__all__ = ["PIDFILE_NAME", "RESTORE_LOG_NAME", "CriuError", "log_tail"]

log = logging.getLogger("vpool.agent")

DUMP_LOG_NAME = "dump.log"

# What the fingerprint hashes of the vpool tree: the packages a rank and its restore run.
_VPOOL_PACKAGES = ("vpool", "vpool.protocol", "vpool.mpi", "vpool.worker_agent")
_SITE_DIRS = frozenset({"site-packages", "dist-packages"})
_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")
_LDD_PATH = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")

# Asked of the rank interpreter once per fingerprint: where its libraries live. The base
# installation's stdlib counts too (a venv's interpreter loads its extensions), its
# site-packages only when they are on the interpreter's path.
_PATHS_QUERY = """
import json, site, sys, sysconfig
stdlib, sites = set(), set(site.getsitepackages())
for extra in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
    paths = sysconfig.get_paths(vars=extra)
    stdlib.update(paths[k] for k in ("stdlib", "platstdlib"))
sites.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
print(json.dumps({"executable": sys.executable, "stdlib": sorted(stdlib), "site": sorted(sites)}))
"""

# path -> (size, mtime_ns, sha256 hex): a file that kept both is not hashed again.
_HASH_CACHE: dict[str, tuple[int, int, str]] = {}


class CriuError(AgentError):
    """A CRIU operation failed; the message ends with the relevant tail of CRIU's log."""


# -- pages through a pipe -------------------------------------------------------------------

PAGES_NAME = "pages-1.img"  # the dumped tree's first process: a rank's clone is that process
_PIPE_SIZE = 1 << 20
_WAIT = 0.1  # s between looks at ``abandon``/the end of the dump while nothing comes


class PagesPipe:
    """``pages-1.img`` of a dump as a FIFO the agent reads while CRIU writes it.

    CRIU writes a process's memory with ``splice`` from the pipes it filled with ``vmsplice``
    into the pages image; into a FIFO that moves page references instead of copying 200 MB into
    freshly allocated tmpfs pages, which was most of CRIU's CPU under load (and half its
    memory traffic), and the agent reads the pages once, as it did from the file. CRIU opens
    and writes the image like a file (``open(O_CREAT|O_TRUNC)`` of an existing FIFO opens it;
    it never seeks in it). Processes after the first get regular ``pages-N.img`` files.

    ``read_into`` (a ``ckpt_image.Stream``) blocks until CRIU writes, and returns 0 once CRIU
    closed the image, or when the dump ``ended`` without opening it; ``wait_pages`` waits for
    the first of those, ``wait_dump`` for ``ended``, and both raise the dump's error. Reading
    must go on while the dump runs: CRIU waits for room in the pipe.
    """

    def __init__(self, images_dir: Path) -> None:
        self.path = images_dir / PAGES_NAME
        os.mkfifo(self.path, 0o600)
        # Non-blocking: opening does not wait for CRIU, and neither does anything else here.
        self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        except OSError:
            pass  # a smaller pipe: more, shorter reads
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._connected = False
        self._ended = threading.Event()
        self._error: BaseException | None = None
        self.abandoned = False
        self.size = 0

    def wait_pages(self) -> bool:
        """Wait until CRIU writes the pages (True) or the dump ended without (False: raises
        the dump's error if it failed)."""
        while not self._connected:
            if self.abandoned:
                raise CriuError("the checkpoint was abandoned before CRIU wrote its pages")
            # Until CRIU opens it, a read would say "end": poll says nothing instead (a FIFO
            # that never had a writer reports no hang-up).
            if self._poll.poll(_WAIT * 1000):
                self._connected = True
            elif self._ended.is_set():
                if self._error is not None:
                    raise self._error
                return False
        return True

    def read_into(self, view: memoryview) -> int:
        while True:
            if self.abandoned:
                raise CriuError("the checkpoint was abandoned while CRIU wrote its pages")
            if not self.wait_pages():
                return 0
            try:
                n = os.readv(self.fd, [view])
            except BlockingIOError:
                self._poll.poll(_WAIT * 1000)
                continue
            self.size += n
            return n

    def ended(self, error: BaseException | None) -> None:
        """The dump is over (``error``: why it failed); from any thread."""
        self._error = error
        self._ended.set()

    def wait_dump(self) -> None:
        """Wait for the dump's end; raise its error."""
        while not self._ended.wait(_WAIT):
            if self.abandoned:
                raise CriuError("the checkpoint was abandoned while CRIU dumped")
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        os.close(self.fd)


# -- capability ---------------------------------------------------------------------------


async def criu_check(criu: str = "criu") -> str:
    """CRIU's version (e.g. "4.1.1") when ``criu check`` passes here, else "" (logged why).
    ``criu`` is looked up on ``privileged.FIXED_PATH``, as every use of it is."""
    criu = privileged.which(criu) or criu
    try:
        with trio.fail_after(30):
            version = await trio.run_process(
                [criu, "--version"], capture_stdout=True, capture_stderr=True, check=False
            )
            if version.returncode != 0:
                log.warning(
                    "checkpoints disabled: %s --version failed: %s",
                    criu,
                    _text(version.stderr or version.stdout),
                )
                return ""
            check = await trio.run_process(
                [criu, "check"], capture_stdout=True, capture_stderr=True, check=False
            )
    except OSError as exc:
        log.warning("checkpoints disabled: cannot run %s: %s", criu, exc)
        return ""
    except trio.TooSlowError:
        log.warning("checkpoints disabled: %s did not answer within 30 s", criu)
        return ""
    if check.returncode != 0:
        log.warning(
            "checkpoints disabled: `%s check` failed: %s",
            criu,
            _text(check.stdout + check.stderr)[-2000:],
        )
        return ""
    match = re.search(r"Version:\s*(\S+)", version.stdout.decode(errors="replace"))
    if match is None:
        log.warning("checkpoints disabled: no version in %r", _text(version.stdout))
        return ""
    try:
        # What a dump of a sandboxed rank runs as root: said now, not at every checkpoint.
        await trio.to_thread.run_sync(privileged.resolve, criu)
    except privileged.UntrustedProgram as exc:
        log.warning("checkpoints disabled: %s", exc)
        return ""
    return match.group(1)


# -- fingerprint --------------------------------------------------------------------------


def file_sha256(path: str) -> str:
    """SHA-256 of a file, cached by (path, size, mtime_ns)."""
    st = os.stat(path)
    cached = _HASH_CACHE.get(path)
    if cached is not None and cached[0] == st.st_size and cached[1] == st.st_mtime_ns:
        return cached[2]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    sha = digest.hexdigest()
    _HASH_CACHE[path] = (st.st_size, st.st_mtime_ns, sha)
    return sha


def tree_files(
    root: str, suffix: re.Pattern[str], *, prune: frozenset[str] = frozenset()
) -> list[str]:
    """Regular files under ``root`` (symlinks not followed) whose name matches ``suffix``,
    not looking into ``__pycache__`` or directories named in ``prune``."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and d not in prune]
        for name in filenames:
            if suffix.search(name):
                path = os.path.join(dirpath, name)
                if os.path.isfile(path):
                    found.append(path)
    return found


def hash_files(paths: list[str]) -> dict[str, str]:
    """{path: sha256} of the files that can be read (a vanished one is left out)."""
    hashes: dict[str, str] = {}
    for path in paths:
        if path in hashes:
            continue
        try:
            hashes[path] = file_sha256(path)
        except OSError as exc:
            log.debug("fingerprint: skipping %s: %s", path, exc)
    return hashes


def combine(hashes: dict[str, str], *, rank_root: str, salt: str = "") -> str:
    """The fingerprint of a set of file hashes plus the rank root and the salt."""
    digest = hashlib.sha256()
    for path in sorted(hashes):
        digest.update(path.encode(errors="surrogateescape") + b"\0")
        digest.update(hashes[path].encode() + b"\n")
    digest.update(b"rank_root\0" + rank_root.encode(errors="surrogateescape") + b"\n")
    digest.update(b"salt\0" + salt.encode(errors="surrogateescape") + b"\n")
    return digest.hexdigest()


def with_environment(fingerprint: str, env_digest: str) -> str:
    """The fingerprint of images of ranks that ran in a job environment (``environments``):
    this agent's, and the environment's contents, so that an image is restored only where the
    same files are at ``/vpool/env``."""
    return hashlib.sha256(f"{fingerprint}|env:{env_digest}".encode()).hexdigest()


def environment_fingerprint(
    python: str, *, rank_root: str, salt: str = ""
) -> tuple[str, dict[str, str]]:
    """(hex SHA-256, {path: sha256}) of what a restored rank maps. Blocking: run in a thread."""
    answer = subprocess.run(
        [python, "-c", _PATHS_QUERY], capture_output=True, check=False, timeout=60
    )
    if answer.returncode != 0:
        raise CriuError(f"cannot ask {python} for its paths: {_text(answer.stderr)[-500:]}")
    info = json.loads(answer.stdout)
    interpreter = os.path.realpath(info["executable"] or python)
    paths = [interpreter, *_ldd(interpreter)]
    for directory in info["stdlib"]:
        paths.extend(tree_files(directory, _SHARED_OBJECT, prune=_SITE_DIRS))
    for directory in info["site"]:
        paths.extend(tree_files(directory, _SHARED_OBJECT))
    for directory in vpool_dirs():
        paths.extend(tree_files(directory, re.compile(r"\.py$")))
    hashes = hash_files(paths)
    return combine(hashes, rank_root=rank_root, salt=salt), hashes


def _ldd(executable: str) -> list[str]:
    try:
        answer = subprocess.run(["ldd", executable], capture_output=True, check=False, timeout=30)
    except OSError as exc:
        log.warning("fingerprint: cannot run ldd: %s", exc)
        return []
    # A statically linked interpreter has no libraries: ldd says so and fails.
    return _LDD_PATH.findall(answer.stdout.decode(errors="surrogateescape"))


def vpool_dirs() -> list[str]:
    dirs: set[str] = set()
    for name in _VPOOL_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.update(os.path.realpath(p) for p in spec.submodule_search_locations)
    # Nested locations (a regular install keeps every subpackage under vpool/) walk once.
    return [d for d in sorted(dirs) if not any(d.startswith(o + os.sep) for o in dirs)]


# -- dump ---------------------------------------------------------------------------------


async def dump(
    pid: int,
    images_dir: Path,
    *,
    criu: str = "criu",
    log_dir: Path | None = None,
    timeout: float = 120,  # noqa: ASYNC109 (the agent's API: one knob per dump)
    enter: int | None = None,
    nice: int = 0,
) -> float:
    """``criu dump`` process ``pid`` (a process group leader) into ``images_dir``.

    ``enter``: a host pid whose namespaces CRIU runs in (``privileged``: from the agent's own
    files, never the rank's), ``pid`` being a pid of that namespace: the clone of a sandboxed
    or restored rank lives in the rank's namespaces, and CRIU cannot dump it from outside
    (its files are on the namespace's mounts).
    CRIU kills the process once it is dumped. ``nice``: CRIU runs that much nicer than the
    agent (``vpool.niceness``). Returns the seconds it took; raises CriuError.
    """
    await trio.Path(images_dir).mkdir(parents=True, exist_ok=True)
    log_file = (log_dir if log_dir is not None else images_dir) / DUMP_LOG_NAME
    pass_fds: list[int] = []
    images_arg, log_arg = str(images_dir), str(log_file.absolute())
    program: privileged.Program | None = None
    if enter is not None:
        # CRIU runs in the rank's namespaces, mount namespace included (its files are the
        # sandbox's), where every path is the rank's to plant: ``ns_exec`` runs it from the
        # agent's own files (``privileged``), and it reaches the agent's directories through
        # descriptors opened here, as /proc/self/fd/N (a magic link: it leads to the
        # directory whatever the mount namespace).
        try:
            program = await trio.to_thread.run_sync(privileged.resolve, criu)
        except privileged.UntrustedProgram as exc:
            raise CriuError(f"will not run {criu} in a rank's namespaces: {exc}") from exc
        images_fd = os.open(images_dir, os.O_RDONLY | os.O_DIRECTORY)
        log_fd = os.open(log_file.parent, os.O_RDONLY | os.O_DIRECTORY)
        pass_fds = [images_fd, log_fd]
        images_arg = f"/proc/self/fd/{images_fd}"
        log_arg = f"/proc/self/fd/{log_fd}/{log_file.name}"
    args = [
        "dump",
        "-t",
        str(pid),
        "-D",
        images_arg,
        "-o",
        log_arg,
        # Not /etc/criu/default.conf, ~/.criu/default.conf or $CRIU_CONFIG_FILE: only what
        # is said here (in a rank's view, the rank could have written them).
        "--no-default-config",
        # Cgroups differ between machines; the restored rank joins its agent's instead.
        "--manage-cgroups=ignore",
        # The clone's session is its agent's (the rank's): the restore puts it in the
        # restoring agent's session instead of making one (restore_init).
        "--shell-job",
    ]
    # Every namespace of the rank's: CRIU then has none of them to dump (it could not:
    # the rank is not the init of its PID namespace), only the process.
    command = (
        program.ns_exec_argv(enter, args)
        if program is not None
        else [privileged.which(criu) or criu, *args]
    )
    command = nice_command(command, nice)
    started = time.monotonic()
    try:
        with trio.fail_after(timeout):
            result = await trio.run_process(
                command,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                pass_fds=pass_fds,
                env={"PATH": privileged.FIXED_PATH},
            )
    except OSError as exc:
        raise CriuError(f"cannot run {criu}: {exc}") from exc
    except trio.TooSlowError:
        raise CriuError(
            f"criu dump of {pid} took more than {timeout} s: {log_tail(log_file)}"
        ) from None
    finally:
        for fd in pass_fds:
            os.close(fd)
    if program is not None and result.returncode == privileged.EXIT_REFUSED:
        raise CriuError(f"criu dump of {pid} refused: {_text(result.stderr)[-1000:]}")
    if result.returncode != 0:
        raise CriuError(
            f"criu dump of {pid} failed (exit {result.returncode}): "
            f"{log_tail(log_file) or _text(result.stderr)[-1000:]}"
        )
    return time.monotonic() - started


# -- restore ------------------------------------------------------------------------------


def restore_command(
    images_dir: Path,
    status_file: Path,
    *,
    criu: str = "criu",
    python: str = sys.executable,
) -> list[str]:
    """The command that restores the image in ``images_dir`` and waits for the process.

    Its exit status mirrors the restored process (code N, or 128 + signal); 2 with no status
    file means the restore itself failed (CRIU's log tail is on its stderr).
    """
    return [
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        python,
        "-m",
        "vpool.worker_agent.restore_init",
        "--criu",
        privileged.which(criu) or criu,
        "--images",
        str(images_dir),
        "--status",
        str(status_file),
    ]


def read_status(status_file: Path) -> int | None:
    """The restored process's exit as a returncode (negative: killed by that signal)."""
    try:
        status = json.loads(status_file.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict):
        return None
    code, signal = status.get("code"), status.get("signal")
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    if isinstance(signal, int) and not isinstance(signal, bool) and signal > 0:
        return -signal
    return None


def process_tree_pids(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children first, breadth-first); [] once it is gone."""
    children = _children_map()
    found: list[int] = []
    queue = [pid]
    for parent in queue:
        for child in children(parent):
            if child not in found and child != pid:
                found.append(child)
                queue.append(child)
    return found


def restored_host_pid(root_pid: int, images_dir: Path) -> int | None:
    """The host pid of the process ``restore_init`` restored under ``root_pid`` (the unshare
    process), or None while CRIU has not written it or once it is gone."""
    try:
        ns_pid = int((images_dir / PIDFILE_NAME).read_text().strip())
    except (OSError, ValueError):
        return None
    for pid in process_tree_pids(root_pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        match = re.search(r"^NSpid:\s*(.*)$", status, re.MULTILINE)
        # Host pid first, the pid in the restore's namespace last.
        ids = match.group(1).split() if match else []
        if len(ids) >= 2 and ids[-1] == str(ns_pid):
            return pid
    return None


def nested_pid_namespace(pid: int) -> bool:
    """Whether process ``pid`` lives in another PID namespace than the agent (a restored rank
    does: its pids, such as a clone's in ``CkptForked``, are that namespace's)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    except OSError:
        return False


def namespace_pid(pid: int) -> int | None:
    """Host process ``pid``'s pid in its own PID namespace (the last ``NSpid`` entry)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^NSpid:\s*(.*)$", status, re.MULTILINE)
    ids = match.group(1).split() if match else []
    return int(ids[-1]) if ids else None


def descendant_host_pid(parent: int, ns_pid: int) -> int | None:
    """The host pid of the descendant of ``parent`` whose pid in its own namespace (the last
    ``NSpid`` entry) is ``ns_pid``; None if there is none."""
    for pid in process_tree_pids(parent):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        match = re.search(r"^NSpid:\s*(.*)$", status, re.MULTILINE)
        ids = match.group(1).split() if match else []
        if ids and ids[-1] == str(ns_pid):
            return pid
    return None


def _children_map() -> Callable[[int], list[int]]:
    if Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        return _children_from_proc
    # Kernels without CONFIG_PROC_CHILDREN: one pass over /proc/*/stat for the parent links.
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may itself hold spaces or parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        parents.setdefault(int(fields[1]), []).append(int(entry))
    return lambda pid: parents.get(pid, [])


def _children_from_proc(pid: int) -> list[int]:
    children: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return children
    for task in tasks:
        try:
            children.extend(
                int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            )
        except OSError:
            continue
    return children


def _text(data: bytes) -> str:
    return data.decode(errors="replace").strip()
