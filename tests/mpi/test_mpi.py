"""The MPI runtime end to end: real rank processes through ``vpool.sdk.mpiexec``.

Each program asserts its own results on every rank and prints one line at rank 0; a failed
assertion anywhere ends the job with a non-zero exit code and its traceback on stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

import vpool.mpi

PROGRAMS = Path(__file__).resolve().parent / "programs"


pytestmark = pytest.mark.large


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


async def mpiexec(
    n: int,
    program: str,
    *args: str,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
    deadline: float = 60,
) -> Result:
    """Run ``programs/<program>`` (or ``-m module``) with ``n`` ranks through
    ``python -m vpool.sdk.mpiexec``."""
    target = [program] if program.startswith("-") else [str(PROGRAMS / program)]
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), "--", *target, *args]
    full_env = {**os.environ, **(env or {})}
    with trio.fail_after(deadline):
        proc = await trio.run_process(
            cmd,
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=full_env,
        )
    return Result(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


SHIM_INIT = vpool.mpi.SHIM_DIR / "mpi4py" / "__init__.py"


def _same_file(a: str, b: Path) -> bool:
    return Path(a).resolve() == b.resolve()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_point_to_point(n: int) -> None:
    res = await mpiexec(n, "p2p.py")
    assert res.returncode == 0, res
    assert res.stdout == f"p2p ok {n}\n", res


@pytest.mark.parametrize("n", [1, 3, 8])
async def test_any_source_farm(n: int) -> None:
    res = await mpiexec(n, "farm.py")
    assert res.returncode == 0, res
    assert res.stdout == "farm ok 300\n", res


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
async def test_collectives(n: int) -> None:
    res = await mpiexec(n, "coll.py", deadline=90)
    assert res.returncode == 0, res
    assert res.stdout == f"coll ok {n}\n", res


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_communicators(n: int) -> None:
    res = await mpiexec(n, "comms.py")
    assert res.returncode == 0, res
    assert res.stdout == f"comms ok {n}\n", res


async def test_large_messages_both_ways_at_once() -> None:
    res = await mpiexec(2, "big.py", "64", deadline=90)
    assert res.returncode == 0, res
    assert res.stdout == "big ok 64\n", res


async def test_large_messages_odd_size() -> None:
    res = await mpiexec(3, "big.py", "3")
    assert res.returncode == 0, res


async def test_abort_ends_the_job_with_its_code() -> None:
    res = await mpiexec(3, "abort.py", "7")
    assert res.returncode == 7, res
    assert "aborting" in res.stdout
    assert "MPI.Abort(7)" in res.stderr


async def test_exception_in_one_rank_ends_the_job_promptly() -> None:
    start = time.monotonic()
    res = await mpiexec(4, "fail.py", "raise")
    assert res.returncode != 0, res
    assert "RuntimeError: boom in rank 1" in res.stderr
    assert "Traceback" in res.stderr
    assert time.monotonic() - start < 20


async def test_exit_code_of_the_first_failing_rank() -> None:
    res = await mpiexec(3, "fail.py", "3")
    assert res.returncode == 3, res
    assert "rank 1 exited with code 3" in res.stderr


async def test_runtime_and_environment_of_ranks(tmp_path: Path) -> None:
    # A "real" mpi4py on the path must lose against vpool's shim.
    fake = tmp_path / "mpi4py"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the real mpi4py was imported')\n")
    res = await mpiexec(3, "whoami.py", env={"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 0, res
    lines = [line.split("|") for line in res.stdout.splitlines()]
    assert len(lines) == 3
    for rank, line in enumerate(lines):
        assert line[:2] == [str(rank), "3"]
        assert _same_file(line[2], SHIM_INIT)
        assert line[3] == "4.1.2"
        assert line[5:] == ["0", str(rank), "True", "False"]


async def test_stdin_goes_to_rank_zero_only() -> None:
    res = await mpiexec(3, "stdin.py", stdin=b"hello ranks\n")
    assert res.returncode == 0, res
    assert res.stdout == repr(["hello ranks\n", "", ""]) + "\n"


async def test_program_without_mpiexec_runs_as_a_single_rank() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL_")}
    env["PYTHONPATH"] = vpool.mpi.SHIM_DIR.as_posix()
    with trio.fail_after(60):
        proc = await trio.run_process(
            [sys.executable, str(PROGRAMS / "p2p.py")],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == b"p2p ok 1\n"


@pytest.mark.parametrize("n", [1, 4, 6])
async def test_topologies_persistent_requests_and_errors(n: int) -> None:
    res = await mpiexec(n, "topo.py")
    assert res.returncode == 0, res
    assert res.stdout == f"topo ok {n}\n", res


async def test_mpi4py_runner_aborts_the_job_on_an_exception() -> None:
    res = await mpiexec(3, "-m", "mpi4py", str(PROGRAMS / "fail.py"), "raise")
    assert res.returncode == 1, res
    assert "RuntimeError: boom in rank 1" in res.stderr
    assert "MPI.Abort(1)" in res.stderr


async def test_runtime_gaps_real_programs_hit() -> None:
    res = await mpiexec(2, "gaps.py")
    assert res.returncode == 0, res
    assert res.stdout == "gaps ok\n", res


async def test_mpi4py_rc_environment_variables() -> None:
    env = {
        "MPI4PY_RC_INITIALIZE": "false",
        "MPI4PY_RC_THREAD_LEVEL": "funneled",
        "MPI4PY_RC_ERRORS": "fatal",
    }
    res = await mpiexec(2, "rc_env.py", env=env)
    assert res.returncode == 0, res
    assert res.stdout == "rc ok 3\n", res
