"""Collective algorithms end to end at 1..8 ranks, non-powers of two included: real rank
processes through ``vpool.sdk.mpiexec`` (see ``programs/coll_conformance.py`` for what the
program checks on every rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

PROGRAM = Path(__file__).resolve().parent / "programs" / "coll_conformance.py"


pytestmark = pytest.mark.large


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
async def test_collectives_conformance(n: int) -> None:
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), "--", str(PROGRAM)]
    with trio.fail_after(240):
        proc = await trio.run_process(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert out == f"coll conformance ok {n}\n", f"{out}\n{err}"
