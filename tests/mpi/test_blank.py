"""FT-MPI's blank communicators end to end: real rank processes through ``vpool.sdk.mpiexec``
run ``programs/blank_coll.py``, which makes communicators with holes out of COMM_WORLD (no real
failure: the holes' processes sit the case out) and checks every collective and constructor on
them against plain Python; in the last case the holes are also failed ranks in the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

PROGRAM = Path(__file__).resolve().parent / "programs" / "blank_coll.py"

CASES = {
    # Each case: the ranks left as holes. One and two holes, rank 0 among them; with 3 ranks
    # the last case leaves a single live member.
    3: ["0", "1", "0,2"],
    4: ["0", "2", "1,3", "0,3"],
}


pytestmark = pytest.mark.large


def _checked(rank: int, cases: list[str]) -> str:
    """The cases ``rank`` takes part in: those it is live in (a hole of the last stops)."""
    holes = [{int(r) for r in case.split(",")} for case in cases]
    if rank in holes[-1]:
        holes = holes[:-1]
    return ",".join(str(k) for k, h in enumerate(holes) if rank not in h)


@pytest.mark.parametrize("n", sorted(CASES))
async def test_blank_collectives_and_constructors(n: int) -> None:
    cases = CASES[n]
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), "--", str(PROGRAM), *cases]
    with trio.fail_after(60):
        proc = await trio.run_process(
            cmd, stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False
        )
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    want = [f"blank ok {r} cases={_checked(r, cases)}" for r in range(n)]
    assert sorted(out.splitlines()) == want, f"{out}\n{err}"
