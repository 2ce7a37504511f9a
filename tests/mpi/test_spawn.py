"""MPI.Comm.Spawn end to end: real rank processes through ``vpool.sdk.mpiexec``, which starts
what they spawn (``programs/spawn_conformance.py`` and ``programs/spawn_failures.py`` say what
each checks), and the pieces of ``vpool.mpi.spawn`` that need no processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from vpool.mpi import errors, spawn
from vpool.sdk import mpiexec
from vpool.sdk.mpiexec_router import python_arguments

PROGRAMS = Path(__file__).resolve().parent / "programs"


async def _run(*args: str) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", *args]
    with trio.fail_after(120):
        proc = await trio.run_process(
            cmd, stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False
        )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.large
async def test_spawn_conformance(n: int) -> None:
    program = str(PROGRAMS / "spawn_conformance.py")
    code, out, err = await _run("--universe", "7", "-n", str(n), "--", program)
    assert code == 0, f"exit {code}\n{out}\n{err}"
    assert out == f"spawn ok {n}\n", f"{out}\n{err}"


@pytest.mark.large
async def test_a_spawned_process_exiting_non_zero_ends_the_job() -> None:
    code, out, err = await _run("-n", "1", str(PROGRAMS / "spawn_failures.py"), "exit")
    assert code == 3, f"{out}\n{err}"
    assert "rank 2 exited with code 3: the job ends" in err, err


@pytest.mark.parametrize("mode", ["transparent", "ulfm"])
@pytest.mark.large
async def test_a_lost_process_of_a_reported_spawn_is_declared_failed(mode: str) -> None:
    program = str(PROGRAMS / "spawn_failures.py")
    code, out, err = await _run("-n", "1", "--on-failure", mode, program, "reported")
    assert code == 0, f"exit {code}\n{out}\n{err}"
    assert out == "reported ok\n", f"{out}\n{err}"
    assert "rank 2 was killed by signal SIGKILL: declared failed" in err, err


def test_soft_gives_the_least_count() -> None:
    assert spawn.least_of(None, 4) == 4
    assert spawn.least_of("1:4", 4) == 1
    assert spawn.least_of("2:8:2", 4) == 2
    assert spawn.least_of("3", 4) == 3
    assert spawn.least_of("4, 2:3", 4) == 2
    assert spawn.least_of("0:4", 4) == 0
    assert spawn.least_of("6", 4) == 4  # never above maxprocs
    for bad in ("x", "1:2:0", "-1", "3:1"):
        with pytest.raises(errors.MPIException):
            spawn.least_of(bad, 4)


def test_spawn_multiple_of_one_command_is_one_request() -> None:
    ask = spawn.ask_multiple(["python3", "python3"], [["a.py"], ["a.py"]], [1, 2], None)
    assert (ask.command, ask.maxprocs, ask.least, ask.counts) == (["python3", "a.py"], 3, 3, [1, 2])
    with pytest.raises(NotImplementedError):
        spawn.ask_multiple(["python3", "python3"], [["a.py"], ["b.py"]], 1, None)
    with pytest.raises(ValueError):
        spawn.ask_multiple("python3", None, 1, None)
    with pytest.raises(ValueError):
        spawn.ask_multiple(["python3"], [["a"], ["b"]], 1, None)


def test_spawned_commands_as_the_pool_runs_them() -> None:
    assert python_arguments(["/usr/bin/python3.12", "-m", "mpi4py.futures.server"]) == [
        "-m",
        "mpi4py.futures.server",
    ]
    assert python_arguments(["/tmp/x/child.py", "a"]) == ["/tmp/x/child.py", "a"]
    assert python_arguments(["/bin/true"]) is None
    assert python_arguments(["python"]) is None


def test_universe_option() -> None:
    with pytest.raises(SystemExit):
        mpiexec.main(["--universe", "-1", "app.py"])


def test_a_replay_drops_what_the_logged_run_dropped_of_a_failed_worker() -> None:
    from vpool.mpi.runtime import Engine
    from vpool.protocol.messages import KIND_BUFFER, Data
    from vpool.protocol.rank_ft import K_TEST, K_WTIME

    eng = Engine(0, 0, 4)
    # Det records as loaded: a Wtime, then failures observed (rank 2 after its message 3).
    eng.load_cuts([[0, 1, K_WTIME, 0.5], [0, 7, K_TEST, {"failed": [[2, 3]]}], [1, 9]])
    assert eng.cut == {2: 3}

    def msg(src: int, seq: int) -> Data:
        return Data(0, src, 0, seq, 0, 0, KIND_BUFFER, [])

    assert not eng._late(msg(2, 3)) and eng._late(msg(2, 4)) and not eng._late(msg(1, 9))
    # In a transparent job a Failed frame waits for a logged test (``observe``).
    eng.on_failed([2, 3])
    assert eng.heard == [2, 3] and not eng.failed
