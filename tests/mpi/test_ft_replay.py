"""Restart with replay through the router (the replay bench ``tests/mpi/bench/replay.py``,
``--kill``): each program is killed at some point on some rank and restarted; it must end as an
unkilled run does, without the router seeing a re-sent message that differs from the logged one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.mpi.test_mpi import PROGRAMS, Result, mpiexec

ROOT = Path(__file__).resolve().parents[2]  # the repository: ``tests`` is importable from it


async def bench(
    n: int,
    program: str,
    *args: str,
    kill: str | None = None,
    ckpt: str | None = None,
    deadline: float = 60,
) -> Result:
    """Run ``programs/<program>`` with ``n`` ranks through the replay bench,
    ``python -m tests.mpi.bench.replay [--kill RANK:N] [--ckpt RANK:N:M[:orphan]]``."""
    options = ["--kill", kill] if kill is not None else []
    options += ["--ckpt", ckpt] if ckpt is not None else []
    target = str(PROGRAMS / program)
    cmd = [sys.executable, "-m", "tests.mpi.bench.replay", *options, "-n", str(n), "--"]
    with trio.fail_after(deadline):
        proc = await trio.run_process(
            [*cmd, target, *args],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=ROOT,
        )
    return Result(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


CASES = [
    ("farm.py", 4, "farm ok 300\n", ["0:1", "0:150", "2:10", "3:1"]),
    ("ft_poll.py", 3, "poll ok 1305\n", ["0:10", "1:7", "2:25"]),
    ("ft_halo.py", 4, "halo ok 384.000000\n", ["0:30", "3:100"]),
    ("ft_nbc.py", 3, "nbc ok 975.0\n", ["0:10", "1:40", "2:77"]),
    ("ft_issend.py", 3, "issend ok 1395\n", ["0:10", "1:7", "2:59"]),
]


@pytest.mark.parametrize(
    ("program", "n", "expected", "kill"),
    [(p, n, e, k) for p, n, e, kills in CASES for k in kills],
)
@pytest.mark.large
async def test_killed_rank_replays(program: str, n: int, expected: str, kill: str) -> None:
    res = await bench(n, program, kill=kill, deadline=90)
    assert res.returncode == 0, res
    assert res.stdout == expected, res
    rank = kill.split(":")[0]
    assert f"restarting rank {rank} (incarnation 2) with replay" in res.stderr, res
    assert "not deterministic" not in res.stderr, res


@pytest.mark.parametrize(("program", "n", "expected"), [(p, n, e) for p, n, e, _ in CASES])
@pytest.mark.large
async def test_unkilled_runs_agree(program: str, n: int, expected: str) -> None:
    res = await mpiexec(n, program)
    assert res.returncode == 0, res
    assert res.stdout == expected, res


@pytest.mark.large
async def test_replay_router_without_kill_is_transparent() -> None:
    # "RANK:0" never fires: the logging router alone, determinants acked, nothing restarted.
    res = await bench(3, "ft_poll.py", kill="0:0")
    assert res.returncode == 0, res
    assert res.stdout == "poll ok 1305\n", res
    assert "restarting" not in res.stderr, res


@pytest.mark.large
async def test_nondeterministic_program_fails_clearly() -> None:
    res = await bench(2, "ft_random.py", kill="0:20")
    assert res.returncode != 0, res
    assert (
        "program is not deterministic: rank 0 re-sent message 1 to rank 1 (channel 0->1) "
        "with different content" in res.stderr
    ), res


@pytest.mark.large
async def test_output_shown_once() -> None:
    # Rank 0 prints one line per task handed out; the restarted rank prints them again, the
    # router shows only what is new.
    res = await bench(3, "ft_print.py", kill="0:20")
    assert res.returncode == 0, res
    assert res.stdout == "".join(f"line {i}\n" for i in range(40)) + "print ok\n", res


@pytest.mark.large
async def test_bad_kill_spec_is_refused() -> None:
    res = await bench(2, "ft_print.py", kill="x")
    assert res.returncode != 0
    assert "expected RANK:MESSAGES" in res.stderr, res


def test_the_benches_are_not_shipped() -> None:
    # The SDK has no fault-injection switch: the benches live here, under tests/.
    for name in ("mpiexec_replay", "mpiexec_replay_router", "mpiexec_ckpt"):
        assert importlib.util.find_spec(f"vpool.sdk.{name}") is None, name
