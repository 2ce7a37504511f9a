"""``python -m mpi4py ...`` under ``vsdk mpiexec``: every form of mpi4py's runner (a path, ``-m``,
``-c``, ``-``, ``-rc``, the informational options), and its abort on an uncaught exception or a
non-zero ``sys.exit`` (the job ends with that code, the traceback on stderr, no rank left waiting).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

RUNNER = Path(__file__).resolve().parent / "programs" / "runner"


pytestmark = pytest.mark.large


async def mpiexec(n: int, *argv: str, stdin: bytes = b"", cwd: Path = RUNNER):
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), "--", *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL_")}
    with trio.fail_after(60):
        return await trio.run_process(
            cmd,
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            cwd=cwd,
        )


def lines(proc: subprocess.CompletedProcess) -> list[str]:
    return sorted(proc.stdout.decode().splitlines())


@pytest.mark.parametrize("python", [["python"], []], ids=["python -m", "-m"])
async def test_path_form_runs_the_script_with_its_directory_on_sys_path(python) -> None:
    res = await mpiexec(3, *python, "-m", "mpi4py", str(RUNNER / "app.py"), "a", "b", cwd=Path("/"))
    assert res.returncode == 0, res.stderr.decode()
    assert lines(res) == [f"{r} ['a', 'b'] 43" for r in range(3)]


async def test_module_form() -> None:
    res = await mpiexec(2, "python", "-m", "mpi4py", "-m", "app", "x")
    assert res.returncode == 0, res.stderr.decode()
    assert lines(res) == ["0 ['x'] 43", "1 ['x'] 43"]


async def test_command_form_with_argv_and_pickled_main_functions() -> None:
    code = (
        "import sys\nfrom mpi4py import MPI\n"
        "def seven():\n    return 7\n"
        "c = MPI.COMM_WORLD\n"
        "sys.stdout.write(f'{c.rank} {sys.argv} {c.bcast(seven)()}\\n')\n"
    )
    res = await mpiexec(2, "python", "-m", "mpi4py", "-c", code, "x")
    assert res.returncode == 0, res.stderr.decode()
    assert lines(res) == ["0 ['-c', 'x'] 7", "1 ['-c', 'x'] 7"]


async def test_stdin_form() -> None:
    code = b"import sys\nfrom mpi4py import MPI\nprint(MPI.COMM_WORLD.size, sys.argv)\n"
    res = await mpiexec(1, "python", "-m", "mpi4py", "-", "q", stdin=code)
    assert res.returncode == 0, res.stderr.decode()
    assert lines(res) == ["1 ['-', 'q']"]


async def test_rc_option_sets_mpi4py_rc_before_mpi_starts() -> None:
    code = "import mpi4py\nprint(mpi4py.rc.thread_level, mpi4py.rc.recv_mprobe)"
    res = await mpiexec(
        1, "python", "-m", "mpi4py", "-rc", "thread_level=single,recv_mprobe=False", "-c", code
    )
    assert res.returncode == 0, res.stderr.decode()
    assert lines(res) == ["single False"]


@pytest.mark.parametrize(
    ("option", "expected"),
    [("--version", "mpi4py 4.1.2"), ("--mpi-std-version", "MPI 4.1")],
)
async def test_informational_options(option: str, expected: str) -> None:
    res = await mpiexec(1, "python", "-m", "mpi4py", option)
    assert res.returncode == 0, res.stderr.decode()
    assert lines(res) == [expected]


async def test_unknown_option_is_a_usage_error() -> None:
    res = await mpiexec(1, "python", "-m", "mpi4py", "-x")
    assert res.returncode == 1
    assert res.stderr.decode().startswith("Unknown option: -x\nusage: ")


async def test_uncaught_exception_aborts_the_job_after_printing_the_traceback() -> None:
    res = await mpiexec(3, "python", "-m", "mpi4py", "app.py", "raise")
    err = res.stderr.decode()
    assert res.returncode == 1, err
    assert "Traceback (most recent call last)" in err
    assert "ValueError: boom from the runner's program" in err
    # The traceback comes first, then the abort ends the job (the others were in a Barrier).
    assert err.index("ValueError") < err.index("MPI.Abort(1)")


async def test_nonzero_sys_exit_aborts_the_job_with_its_code() -> None:
    res = await mpiexec(3, "python", "-m", "mpi4py", "app.py", "exit")
    assert res.returncode == 6, res.stderr.decode()
    assert "MPI.Abort(6)" in res.stderr.decode()
