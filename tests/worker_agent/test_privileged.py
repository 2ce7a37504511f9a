"""Privileged helpers never run a rank's code (``privileged``, ``ns_exec``, ``criu.dump``).

The attacks of issue 35, each against the real thing (bwrap, CRIU, the dynamic loader):
a rank that plants ``/etc/ld.so.preload`` in its view, and one that puts a ``criu`` on a
``PATH`` directory it can write, before its agent checkpoints it as root. Each attack is first
shown to work the old way (``nsenter`` then ``criu``), so that these tests cannot pass for
want of a working attack.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from vpool.worker_agent import criu, privileged, sandbox, sandboxed

CRIU = privileged.which("criu")
needs_root_criu = pytest.mark.skipif(
    os.geteuid() != 0 or not CRIU or not shutil.which("bwrap") or not shutil.which("gcc"),
    reason="needs root, CRIU, bwrap and gcc (a checkpoint of a sandboxed rank runs as root)",
)

# A library whose constructor leaves a mark wherever it is loaded.
EVIL_C = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    int fd = open("/out/pwned", O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) { write(fd, "loaded as root\n", 15); close(fd); }
}
"""


# -- resolution, in the agent's namespaces ---------------------------------------------------


def test_which_ignores_the_agents_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = tmp_path / "criu"
    planted.write_text("#!/bin/sh\nexit 0\n")
    planted.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert shutil.which("criu") == str(planted)  # what nsenter's execvp would have run
    assert privileged.which("criu") != str(planted)
    assert privileged.which(str(planted)) == str(planted)  # a path is taken as is


def test_a_program_others_can_write_is_not_trusted(tmp_path: Path) -> None:
    program = tmp_path / "tool"
    shutil.copy("/bin/true", program)
    os.chmod(program, 0o755)
    # tmp_path lies under /tmp, which everyone can write: so can the program's directory.
    with pytest.raises(privileged.UntrustedProgram, match="writable by others"):
        privileged.check_trusted(str(program))
    os.chmod(program, 0o775)
    with pytest.raises(privileged.UntrustedProgram, match=r"tool is writable by others"):
        privileged.check_trusted(str(program))
    privileged.check_trusted(os.path.realpath("/bin/true"))


def test_elf_interpreter() -> None:
    python = os.path.realpath(sys.executable)
    loader = privileged.elf_interpreter(python)
    assert (loader.startswith("/") and "ld-linux" in loader) or loader.startswith("/lib/ld")
    script = Path(privileged.NS_EXEC_SCRIPT)
    with pytest.raises(privileged.UntrustedProgram, match="not an ELF executable"):
        privileged.elf_interpreter(str(script))


@pytest.mark.large
def test_resolve_finds_the_loader_and_library_dirs() -> None:
    program = privileged.resolve("true")
    assert program.path == os.path.realpath(shutil.which("true") or "")
    assert program.loader == os.path.realpath(privileged.elf_interpreter(program.path))
    libc_dirs = [d for d in program.libdirs if any(Path(d).glob("libc.so*"))]
    assert libc_dirs, program
    argv = program.ns_exec_argv(1234, ["--version"])
    assert argv[argv.index("--target") + 1] == "1234" and argv[-2:] == ["--", "--version"]
    with pytest.raises(privileged.UntrustedProgram, match="not found"):
        privileged.resolve("no-such-program-anywhere")


# -- the attacks ------------------------------------------------------------------------------


@pytest.fixture
def evil(tmp_path: Path) -> Path:
    source = tmp_path / "evil.c"
    source.write_text(EVIL_C)
    lib = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    return lib


@pytest.fixture
def writable_root_sandbox(tmp_path: Path, evil: Path) -> Iterator[tuple[int, Path]]:
    """A sandbox whose root the rank can write (the sandbox before issue 35), in which a rank
    planted ``/etc/ld.so.preload`` naming ``evil.so``: (host pid of its init, the host
    directory seen at /out)."""
    out = tmp_path / "out"
    out.mkdir()
    info_r, info_w = os.pipe()
    links = [a for target, link in sandbox._usr_links() for a in ("--symlink", target, link)]
    command = [
        "bwrap",
        *("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--as-pid-1"),
        *("--cap-drop", "ALL", "--proc", "/proc", "--dev", "/dev", "--ro-bind", "/usr", "/usr"),
        *links,
        *("--dir", "/etc", "--bind", str(out), "/out", "--ro-bind", str(evil), "/evil.so"),
        *("--info-fd", str(info_w), "--", "/bin/sh", "-c"),
        # Planted once sleep runs (echo is the shell's own): nothing of the sandbox loads it.
        'sleep 600 & until [ "$(cat /proc/$!/comm)" = sleep ]; do :; done; '
        "echo /evil.so > /etc/ld.so.preload && echo planted > /out/ready; wait",
    ]
    proc = subprocess.Popen(command, pass_fds=[info_w], stdin=subprocess.DEVNULL)
    os.close(info_w)
    try:
        with os.fdopen(info_r) as f:
            init = int(json.loads(f.read().split("\n}")[0] + "}")["child-pid"])
        _wait_for(out / "ready", proc)
        yield init, out
    finally:
        proc.kill()
        proc.wait()


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the sandbox ended early"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@needs_root_criu
def test_nsenter_then_criu_loads_a_planted_preload(writable_root_sandbox: tuple[int, Path]) -> None:
    """The attack itself, the way dumps ran before: CRIU loaded by the loader of the rank's view."""
    init, out = writable_root_sandbox
    nsenter = ["nsenter", "-t", str(init), "-p", "-m", "-n", "-i", "-u", CRIU, "--version"]
    subprocess.run(nsenter, capture_output=True, check=False, timeout=30)
    assert "loaded as root" in (out / "pwned").read_text()


@needs_root_criu
async def test_a_dump_refuses_a_view_where_a_preload_can_be_planted(
    writable_root_sandbox: tuple[int, Path], tmp_path: Path
) -> None:
    init, out = writable_root_sandbox
    with pytest.raises(criu.CriuError, match=r"refused: .*the rank's / is writable"):
        await criu.dump(2, tmp_path / "images", criu="criu", log_dir=tmp_path, enter=init)
    assert not (out / "pwned").exists()


@needs_root_criu
def test_ns_exec_loads_nothing_of_the_view(writable_root_sandbox: tuple[int, Path]) -> None:
    """Even were the view's root read-only with a preload list in it, ns_exec would refuse:
    the list is the one file the loader reads whatever it is told."""
    init, out = writable_root_sandbox
    program = privileged.resolve("criu")
    result = subprocess.run(
        program.ns_exec_argv(init, ["--version"]), capture_output=True, check=False, timeout=30
    )
    assert result.returncode == privileged.EXIT_REFUSED, result
    assert b"writable" in result.stderr
    assert not (out / "pwned").exists()


# A rank of a real sandbox: it forks a clone to be dumped (its own process group, stdio on
# /dev/null, as a checkpoint clone is), then tries to plant a preload list and puts a `criu`
# on a PATH directory it can write, and says what happened.
PLANTING_RANK = r"""
import json, os, sys, time
clone = os.fork()
if clone == 0:
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    time.sleep(600)
    os._exit(0)
seen = {"clone": clone}
try:
    open("/etc/ld.so.preload", "w").write("/vpool/rank/work/evil.so\n")
    seen["preload"] = "ok"
except OSError as exc:
    seen["preload"] = type(exc).__name__ + " " + str(exc.errno)
os.makedirs("/tmp/bin", exist_ok=True)
with open("/tmp/bin/criu", "w") as f:
    f.write("#!/bin/sh\necho ran as $(id -u) > /vpool/rank/work/pwned\nexit 0\n")
os.chmod("/tmp/bin/criu", 0o755)
print(json.dumps(seen), flush=True)
time.sleep(600)
"""


@needs_root_criu
async def test_a_rank_can_plant_nothing_a_checkpoint_runs(
    iso: sandboxed.Isolation,
    rank_dir: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rank's view is read-only but for its own places (the preload list cannot be
    written), and the `criu` it put on a directory of the agent's PATH never runs: the dump
    runs the agent's CRIU, and succeeds."""
    d, sock_path = rank_dir
    (d / "work" / "prog.py").write_text(PLANTING_RANK)
    monkeypatch.setenv("PATH", f"/tmp/bin:{os.environ['PATH']}")
    limits = sandboxed.RankLimits(processes=64, tmp=16 * 1024**2, open_files=256)
    box = await sandboxed.start(
        iso,
        sandbox.Mounts(d, sock_path),
        lambda fd: sandbox.init_argv(
            sys.executable,
            [sys.executable, "-I", "prog.py"],
            status_fd=fd,
            linger=0,
            stdin=False,
            nofile=256,
            fsize=0,
            sched_idle=True,
        ),
        name=f"test-plant-{os.getpid()}",
        limits=limits,
        env={"PATH": os.environ["PATH"]},
        cwd=d / "work",
        stdout=subprocess.PIPE,
    )
    try:
        assert box.process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while b"\n" not in line:
                chunk = await box.process.stdout.receive_some(4096)
                assert chunk, f"the rank said nothing: {line!r}"
                line += chunk
        seen = json.loads(line)
        assert seen["preload"].startswith("OSError 30"), seen  # EROFS
        # The old way finds the rank's criu: nsenter looks it up on PATH in the rank's view.
        nsenter = ["nsenter", "-t", str(box.init_pid), "-p", "-m", "-n", "-i", "-u", "criu"]
        await trio.run_process([*nsenter, "--version"], capture_stdout=True, check=False)
        assert (d / "work" / "pwned").read_text() == "ran as 0\n"
        (d / "work" / "pwned").unlink()
        images = tmp_path / "images"
        await criu.dump(seen["clone"], images, criu="criu", log_dir=tmp_path, enter=box.init_pid)
        assert (images / "core-{}.img".format(seen["clone"])).exists()
        assert not (d / "work" / "pwned").exists()
    finally:
        await box.aclose()
