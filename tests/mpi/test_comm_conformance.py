"""Communicator construction, topologies and neighbourhood collectives end to end: real rank
processes through ``vpool.sdk.mpiexec`` (see ``programs/comm_conformance.py`` for what the
program checks on every rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

PROGRAM = Path(__file__).resolve().parent / "programs" / "comm_conformance.py"


pytestmark = pytest.mark.large


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_comm_conformance(n: int) -> None:
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), "--", str(PROGRAM)]
    with trio.fail_after(120):
        proc = await trio.run_process(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert out == f"comm conformance ok {n}\n", f"{out}\n{err}"
