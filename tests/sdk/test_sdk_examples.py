"""The examples are plain mpi4py programs with deterministic output.

Expected outputs are computed here in plain Python. Every example runs on thread ranks over a
tiny fake mpi4py (no MPI needed), and under a real ``mpiexec`` when one is available
(``VPOOL_TEST_MPIEXEC=/path/to/mpiexec`` and ``VPOOL_TEST_MPI_PYTHON=/path/to/python`` with
mpi4py; else ``mpiexec`` on PATH with an mpi4py importable by this Python).
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def expected_pi(size: int, n: int = 1_000_000) -> str:
    h = 1.0 / n
    parts = [
        h * math.fsum(4.0 / (1.0 + ((i + 0.5) * h) ** 2) for i in range(r, n, size))
        for r in range(size)
    ]
    pi = sum(parts)
    return (
        f"pi is approximately {pi:.12f}, error {abs(pi - math.pi):.0e}\n"
        f"({n} intervals over {size} ranks)\n"
    )


def expected_ring(size: int, laps: int = 1) -> str:
    token = laps * sum(range(size))
    lines = [
        f"ring of {size} ranks, {laps} lap(s)",
        f"token back at rank 0: {token} (expected {laps * size * (size - 1) // 2})",
    ]
    for r in range(size):
        left = (r - 1) % size
        lines.append(f"rank {r} got {[left, left**2, left**3]} from rank {left}")
    return "\n".join(lines) + "\n"


def collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def expected_farm(size: int, ntasks: int = 40) -> str:
    res = {n: collatz(n) for n in range(1, ntasks + 1)}
    lines = [f"{ntasks} tasks done by {max(size - 1, 1)} worker(s)"]
    lines += [f"collatz({n}) = {s} steps" for n, s in res.items()]
    best = max(sorted(res), key=lambda k: res[k])
    lines.append(f"longest: {best} with {res[best]} steps")
    return "\n".join(lines) + "\n"


def expected_stats(size: int, per_rank: int = 10_000, modulus: int = 1009) -> str:
    data = [
        [(k * k) % modulus for k in range(r * per_rank, (r + 1) * per_rank)] for r in range(size)
    ]
    flat = [x for part in data for x in part]
    count, s1, s2 = len(flat), sum(flat), sum(x * x for x in flat)
    mean = s1 / count
    var = s2 / count - mean * mean
    return (
        f"{count} samples on {size} ranks\n"
        f"sum {s1}, sum of squares {s2}\n"
        f"mean {mean:.6f}, variance {var:.6f}\n"
        f"sum per rank: {[sum(part) for part in data]}\n"
    )


CASES = {
    "pi.py": expected_pi,
    "ring.py": expected_ring,
    "farm.py": expected_farm,
    "stats.py": expected_stats,
}


@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("example", sorted(CASES))
def test_example_on_thread_ranks(run_ranks: Any, example: str, size: int) -> None:
    outs = run_ranks(EXAMPLES / example, size)
    assert outs[0] == CASES[example](size)
    assert all(outs[r] == "" for r in range(1, size)), "only rank 0 prints"


def test_examples_take_arguments(run_ranks: Any) -> None:
    assert run_ranks(EXAMPLES / "pi.py", 4, ["1000"])[0] == expected_pi(4, 1000)
    assert run_ranks(EXAMPLES / "ring.py", 4, ["3"])[0] == expected_ring(4, 3)
    assert run_ranks(EXAMPLES / "farm.py", 2, ["7"])[0] == expected_farm(2, 7)
    assert run_ranks(EXAMPLES / "stats.py", 2, ["50"])[0] == expected_stats(2, 50)


def test_examples_import_only_standard_mpi4py() -> None:
    """Unmodified programs: nothing from vpool, only mpi4py (and numpy, stdlib)."""
    for example in CASES:
        text = (EXAMPLES / example).read_text()
        assert "vpool" not in text
        assert "from mpi4py import MPI" in text


def _real_mpi() -> tuple[str, str] | None:
    mpiexec = os.environ.get("VPOOL_TEST_MPIEXEC")
    python = os.environ.get("VPOOL_TEST_MPI_PYTHON", sys.executable)
    if mpiexec:
        return mpiexec, python
    found = shutil.which("mpiexec")
    if found and importlib.util.find_spec("mpi4py") is not None:
        return found, sys.executable
    return None


@pytest.mark.skipif(_real_mpi() is None, reason="no real mpiexec with mpi4py here")
@pytest.mark.parametrize("example", sorted(CASES))
@pytest.mark.large
def test_example_under_real_mpiexec(example: str) -> None:
    real = _real_mpi()
    assert real is not None
    mpiexec, python = real
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [mpiexec, "-n", "8", python, str(EXAMPLES / example)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == CASES[example](8)
