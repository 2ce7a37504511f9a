"""Regressions found with mpi4py's own test suite (scripts/conformance.py): synchronous sends,
request and status semantics, pickling API, vector buffer specs. Real ranks via mpiexec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = Path(__file__).resolve().parent / "programs" / "p2p_semantics.py"


pytestmark = pytest.mark.large


@pytest.mark.parametrize("n", [1, 2, 3])
def test_p2p_semantics(n: int) -> None:
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), "--", str(PROGRAM)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip() == f"p2p semantics ok {n}"
