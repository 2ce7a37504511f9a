"""A failing rank ends the whole job promptly on a local pool: an uncaught exception (its
traceback on vsdk's stderr), MPI.Abort(code) (the job's exit code), a non-zero sys.exit, and the
same under mpi4py's runner (`python -m mpi4py`). The other ranks, blocked in a receive that nothing
will match, are stopped at once: the coordinator answers their agents' held heartbeats with stop
orders as soon as the job fails, instead of at each agent's next heartbeat.

The failing rank fails when the test tells it to (SIGUSR1: a rank has no network), so the clock
starts at a known moment; the test then watches every rank's process end through pidfds (ranks
run in their sandboxes under the agents, not as the test's children).
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Pool

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
PROGRAM = Path(__file__).resolve().parent / "programs" / "fail_on_cue.py"
RANKS = 4
# The default heartbeat interval is 2 s: an end that waited for the agents' next heartbeats
# would often miss this; measured ends are about 0.1-0.2 s.
PROMPT = 1.0


@dataclass
class Ended:
    code: int
    stdout: str
    stderr: str
    ranks_gone: dict[int, float]  # rank -> seconds from the cue to its process's end
    job_end: float  # seconds from the cue to vsdk's exit

    def __str__(self) -> str:
        return (
            f"exit {self.code}; ranks gone after {self.ranks_gone}; vsdk done after "
            f"{self.job_end:.2f} s\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )


def _read_pids(proc: subprocess.Popen, deadline: float) -> tuple[dict[int, int], bytes]:
    assert proc.stdout is not None
    fd, got = proc.stdout.fileno(), b""
    while True:
        pids = {int(r): int(p) for r, p in re.findall(rb"^pid (\d+) (\d+)$", got, re.M)}
        if len(pids) == RANKS:
            return pids, got
        left = deadline - time.monotonic()
        assert left > 0, f"ranks did not start: {got!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"vsdk ended early: {got!r} {proc.stderr.read() if proc.stderr else ''}"
            got += chunk


def _watch_ends(pidfds: dict[int, int], start: float, deadline: float) -> dict[int, float]:
    poller, by_fd, ended = select.poll(), {fd: rank for rank, fd in pidfds.items()}, {}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    while len(ended) < len(by_fd):
        left = deadline - time.monotonic()
        assert left > 0, f"ranks still running: {set(pidfds) - set(ended)}"
        for fd, _ in poller.poll(left * 1000):
            ended[by_fd[fd]] = time.monotonic() - start
            poller.unregister(fd)
    return ended


def run_and_fail(pool: Pool, program: Path, *args: str, before: tuple[str, ...] = ()) -> Ended:
    """Submit ``program *before *args`` with --wait, cue the failing rank, time the job's end."""
    cmd = [str(BIN / "vsdk"), "submit", str(program), "--ranks", str(RANKS), "--wait"]
    proc = subprocess.Popen(
        [*cmd, "--", *before, *args],
        env=pool.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pidfds: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 60
        _, seen = _read_pids(proc, deadline)
        # The pids the ranks print are their sandboxes'; these are the test's view of them.
        pids = pool.rank_pids()
        assert sorted(pids) == list(range(RANKS)), pids
        pidfds = {rank: os.pidfd_open(pid) for rank, pid in pids.items()}
        os.kill(pids[2], signal.SIGUSR1)
        start = time.monotonic()
        gone = _watch_ends(pidfds, start, deadline)
        out, err = proc.communicate(timeout=60)
        job_end = time.monotonic() - start
    finally:
        for fd in pidfds.values():
            os.close(fd)
        if proc.poll() is None:
            proc.kill()
        with proc:  # its pipes closed, whatever ended the test
            proc.wait()
    return Ended(proc.returncode, (seen + out).decode(), err.decode(), gone, job_end)


def _assert_prompt(res: Ended) -> None:
    assert max(res.ranks_gone.values()) < PROMPT, res
    assert res.job_end < PROMPT, res


def test_uncaught_exception_ends_the_job_promptly_with_its_traceback(pool: Pool) -> None:
    res = run_and_fail(pool, PROGRAM, "raise")
    assert res.code == 1, res
    assert "Traceback (most recent call last)" in res.stderr, res
    assert "ValueError: boom in rank 2" in res.stderr, res
    assert "rank 2 exited with code 1" in res.stderr, res
    _assert_prompt(res)


def test_abort_ends_the_job_promptly_with_its_code(pool: Pool) -> None:
    res = run_and_fail(pool, PROGRAM, "abort", "5")
    assert res.code == 5, res
    assert "rank 2 called MPI.Abort(5)" in res.stderr, res
    _assert_prompt(res)


def test_nonzero_exit_ends_the_job_promptly_with_its_code(pool: Pool) -> None:
    res = run_and_fail(pool, PROGRAM, "exit", "9")
    assert res.code == 9, res
    assert "rank 2 exited with code 9" in res.stderr, res
    _assert_prompt(res)


RUNNER_MAIN = "from mpi4py.run import main\n\nmain()\n"


@pytest.fixture
def under_mpi4py_runner(tmp_path: Path) -> Path:
    """A bundle whose entry is what `python -m mpi4py` runs (mpi4py/__main__.py calls
    mpi4py.run.main), with the program as its first argument: `python -m mpi4py app.py ...`."""
    bundle = tmp_path / "runner.zip"
    with zipfile.ZipFile(bundle, "w") as zf:
        zf.writestr("__main__.py", RUNNER_MAIN)
        zf.write(PROGRAM, "app.py")
    return bundle


def test_mpi4py_runner_in_a_pool_aborts_on_an_uncaught_exception(
    pool: Pool, under_mpi4py_runner: Path
) -> None:
    # Without the runner the rank just exits 1; with it, it prints the traceback and aborts.
    res = run_and_fail(pool, under_mpi4py_runner, "raise", before=("app.py",))
    assert res.code == 1, res
    assert "ValueError: boom in rank 2" in res.stderr, res
    assert "rank 2 called MPI.Abort(1)" in res.stderr, res
    assert res.stderr.index("ValueError") < res.stderr.index("MPI.Abort(1)"), res
    _assert_prompt(res)


def test_mpi4py_runner_in_a_pool_runs_a_program(pool: Pool, under_mpi4py_runner: Path) -> None:
    res = pool.vsdk(
        "submit",
        str(under_mpi4py_runner),
        "--ranks",
        "2",
        "--wait",
        "--",
        "-c",
        "import sys\nfrom mpi4py import MPI\nprint(MPI.COMM_WORLD.allreduce(1), sys.argv)",
        "x",
    )
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().splitlines() == ["2 ['-c', 'x']"] * 2
