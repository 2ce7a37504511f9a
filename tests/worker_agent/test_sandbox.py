"""The rank sandbox itself (``sandbox``, ``sandbox_init``, ``sandboxed``), with real bwrap."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from vpool.worker_agent import criu, sandbox, sandboxed

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed")


async def run(
    iso: sandboxed.Isolation,
    rank: tuple[Path, Path],
    code: str,
    *,
    limits: sandboxed.RankLimits | None = None,
    linger: float = 0,
    data: int = 0,
) -> tuple[sandboxed.Sandboxed, bytes]:
    """``code`` as a sandboxed rank, to its end; its handle (closed) and its output."""
    d, sock_path = rank
    (d / "work" / "prog.py").write_text(code)
    limits = limits or sandboxed.RankLimits(processes=64, tmp=16 * 1024**2, open_files=256)
    box = await sandboxed.start(
        iso,
        sandbox.Mounts(d, sock_path),
        lambda fd: sandbox.init_argv(
            sys.executable,
            [sys.executable, "prog.py"],
            status_fd=fd,
            linger=linger,
            stdin=False,
            nofile=limits.open_files,
            fsize=limits.disk,
            sched_idle=True,
            data=data,
        ),
        name=f"test-{os.getpid()}",
        limits=limits,
        env={"PATH": os.environ["PATH"]},
        cwd=d / "work",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out = b""
    try:
        assert box.process.stdout is not None
        with trio.fail_after(60):
            while chunk := await box.process.stdout.receive_some(65536):
                out += chunk
            await box.wait_ended()
    finally:
        await box.aclose()
    return box, out


async def test_the_view_is_built_from_nothing(
    iso: sandboxed.Isolation, rank_dir: tuple[Path, Path]
) -> None:
    code = (
        "import json, os, sys\n"
        "print(json.dumps({'root': sorted(os.listdir('/')), 'vpool': sorted(os.listdir('/vpool')),"
        " 'cwd': os.getcwd(), 'etc': sorted(os.listdir('/etc')), 'pid': os.getpid(),"
        " 'passwd': open('/etc/passwd').read()}))\n"
    )
    box, out = await run(iso, rank_dir, code)
    seen = json.loads(out)
    assert seen["cwd"] == "/vpool/rank/work" and seen["pid"] == 2
    assert seen["vpool"] == ["agent.sock", "rank"]
    assert "home" not in seen["root"] and "shadow" not in seen["etc"]
    # The machine's users are not named: only the rank's own and nobody.
    assert [line.split(":")[0] for line in seen["passwd"].splitlines()] in (
        ["rank", "nobody"],
        ["rank"],
    )
    assert box.returncode() == 0


async def test_init_reports_exit_codes_and_signals(
    iso: sandboxed.Isolation, rank_dir: tuple[Path, Path]
) -> None:
    box, _ = await run(iso, rank_dir, "import sys; sys.exit(7)")
    assert box.returncode() == 7
    box, _ = await run(iso, rank_dir, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert box.returncode() == -signal.SIGKILL


async def test_nothing_the_rank_started_outlives_it(
    iso: sandboxed.Isolation, rank_dir: tuple[Path, Path]
) -> None:
    marker = f"vpool-orphan-{os.getpid()}"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', '{marker}'],"
        " start_new_session=True)\n"
        "print('started', flush=True)\n"
    )
    box, out = await run(iso, rank_dir, code)
    assert out == b"started\n" and box.returncode() == 0
    # The init's death ended the PID namespace, and the kernel killed everything in it
    # before bwrap, waiting for the init, could end (aclose waited for bwrap).
    left = _processes_with(marker.encode())
    assert left == []


def _processes_with(marker: bytes) -> list[str]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker in f.read():
                    found.append(entry)
        except OSError:
            continue
    return found


async def test_init_lingers_for_a_clone_the_agent_may_still_dump(
    iso: sandboxed.Isolation, rank_dir: tuple[Path, Path]
) -> None:
    """The rank dies with a checkpoint clone alive: its end is reported at once, and the
    sandbox (its namespaces) stays while the clone lives, for at most ``linger``."""
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    time.sleep(600)\n"
        "print('forked', flush=True)\nos._exit(3)\n"
    )
    d, sock_path = rank_dir
    (d / "work" / "prog.py").write_text(code)
    limits = sandboxed.RankLimits(processes=64)
    box = await sandboxed.start(
        iso,
        sandbox.Mounts(d, sock_path),
        lambda fd: sandbox.init_argv(
            sys.executable,
            [sys.executable, "prog.py"],
            status_fd=fd,
            linger=60,
            stdin=False,
            nofile=0,
            fsize=0,
            sched_idle=False,
        ),
        name=f"test-linger-{os.getpid()}",
        limits=limits,
        env={"PATH": os.environ["PATH"]},
        cwd=d / "work",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with trio.fail_after(30):
            await box.wait_ended()
        assert box.returncode() == 3
        assert box.process.poll() is None  # the clone keeps the sandbox
        assert criu.process_tree_pids(box.init_pid)  # and it is there, under the init
    finally:
        await box.aclose()
    assert box.process.returncode is not None


async def test_without_a_cgroup_rlimits_bound_memory(
    iso: sandboxed.Isolation, rank_dir: tuple[Path, Path]
) -> None:
    code = (
        "try:\n    x = bytearray(512 * 1024**2)\n    print('allocated')\n"
        "except MemoryError:\n    print('refused')\n"
    )
    _, out = await run(iso, rank_dir, code, data=128 * 1024**2)
    assert out.strip() == b"refused"
    _, out = await run(iso, rank_dir, code)
    assert out.strip() == b"allocated"
