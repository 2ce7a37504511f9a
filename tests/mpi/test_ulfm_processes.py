"""ULFM end to end: real rank processes through ``vpool.sdk.mpiexec --on-failure ulfm``, where a
rank SIGKILLs itself and the survivors carry on (``programs/ulfm_failures.py`` says what each
scenario checks on every rank), the failure modes ``abort`` and ``transparent`` of mpiexec, and
``examples/ulfm_shrink.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from .failing_runs import expected_total, mpiexec

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).resolve().parent / "programs" / "ulfm_failures.py"
EXAMPLE = ROOT / "examples" / "ulfm_shrink.py"


pytestmark = pytest.mark.large


@pytest.mark.parametrize("scenario", ["recv", "revoke_die", "agree_during"])
@pytest.mark.parametrize("n", [2, 3, 4])
async def test_survivors_carry_on(scenario: str, n: int) -> None:
    code, out, err = await mpiexec(n, "ulfm", str(PROGRAM), scenario)
    assert code == 0, f"exit {code}\n{out}\n{err}"
    lines = sorted(out.splitlines())
    assert [line.split()[:3] for line in lines] == [
        [scenario, "ok", str(r)] for r in range(n - 1)
    ], f"{out}\n{err}"
    assert len({tuple(line.split()[3:]) for line in lines}) == 1, out  # the same everywhere
    assert (
        f"rank {n - 1} was killed by signal SIGKILL: declared failed, the other ranks go on" in err
    ), err


@pytest.mark.parametrize("mode", ["abort", None])
async def test_abort_mode_ends_the_job_naming_the_dead_rank(mode: str | None) -> None:
    code, out, err = await mpiexec(3, mode, str(PROGRAM), "abort")
    assert code == 128 + 9, f"exit {code}\n{out}\n{err}"
    shown = mode or "transparent"  # mpiexec's default: the same as abort here
    assert f"rank 2 was killed by signal SIGKILL: the job ends (--on-failure {shown})" in err
    assert "not ended" not in out


@pytest.mark.parametrize(
    "deaths",
    [[], ["--die", "1:3"], ["--die", "0:2", "--die", "3:5"], ["--die", "3:0", "--die", "2:9"]],
)
async def test_example_ulfm_shrink_gives_the_same_answer(deaths: list[str]) -> None:
    code, out, err = await mpiexec(4, "ulfm", str(EXAMPLE), "20000", "10", *deaths)
    assert code == 0, f"exit {code}\n{out}\n{err}"
    assert (
        out == f"ulfm_shrink: n=20000 iterations=10 total={expected_total(EXAMPLE, 20000, 10)}\n"
    ), err
    assert err.count("declared failed") == len(deaths) // 2, err


REPLAY_PROGRAM = Path(__file__).resolve().parent / "programs" / "ft_revoke.py"


@pytest.mark.parametrize("kill", [None, "0:3", "1:30", "2:60", "3:40"])
async def test_transparent_revocation_and_agreement_replay(kill: str | None) -> None:
    """In a transparent job a rank killed mid-way replays its revocations, Is_revoked polls and
    agreements exactly (the replay bench compares every re-sent message)."""
    options = ["--kill", kill] if kill is not None else []
    cmd = [sys.executable, "-m", "tests.mpi.bench.replay", *options, "-n", "4", "--"]
    with trio.fail_after(120):
        proc = await trio.run_process(
            [*cmd, str(REPLAY_PROGRAM), "4"],
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=ROOT,
        )
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert out == "revoke ok 240\n", f"{out}\n{err}"
    if kill is not None:
        assert f"restarting rank {kill[0]} (incarnation 2) with replay" in err, err
    assert "not deterministic" not in err, err
