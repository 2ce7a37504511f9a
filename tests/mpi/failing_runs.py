"""What the tests of programs that handle failures share (``test_ulfm_processes``,
``test_ftmpi``): a run under ``vsdk mpiexec`` with a failure mode, and an example's answer in
plain Python."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio


async def mpiexec(n: int, mode: str | None, *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``vsdk mpiexec -n N [--on-failure MODE] -- ARGV``."""
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n)]
    if mode is not None:
        cmd += ["--on-failure", mode]
    cmd += ["--", *argv]
    with trio.fail_after(120):
        proc = await trio.run_process(
            cmd, stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False
        )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def expected_total(example: Path, n: int, iterations: int) -> int:
    """The answer of an iterative example (``examples/ulfm_shrink.py``,
    ``examples/ftmpi_modes.py``) from its own ``f`` and ``block_sum``, without MPI."""
    tree = ast.parse(example.read_text())
    funcs = [
        d for d in tree.body if isinstance(d, ast.FunctionDef) and d.name in ("f", "block_sum")
    ]
    space: dict[str, Any] = {}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(example), "exec"), space)
    return sum(space["block_sum"](it, 0, n) for it in range(iterations))
