"""mpi4py 4.1.2's own ``demo/futures`` programs, unmodified, on a real local pool: the spawn form
(``vsdk submit run_X.py -n 1``: MPIPoolExecutor asks the pool for its workers) and the
``-m mpi4py.futures`` form at 5 ranks print what they print under ``vsdk mpiexec``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Pool

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from conformance import ensure_sdist  # noqa: E402

pytestmark = pytest.mark.slow

# run_crawl.py fetches public web sites; run_julia.py and run_mandelbrot.py print timings.
DEMOS = ["run_cpi.py", "run_hello.py", "run_primes.py"]


@pytest.fixture(scope="module")
def demos() -> Path:
    return ensure_sdist() / "demo" / "futures"


def _local(demos: Path, ranks: int, *argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(ranks), "--", *argv],
        cwd=demos,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


@pytest.mark.parametrize("demo", DEMOS)
def test_a_demo_spawning_its_workers_from_the_pool(pool: Pool, demos: Path, demo: str) -> None:
    reference = _local(demos, 1, demo)
    res = pool.vsdk("submit", str(demos / demo), "--ranks", "1", "--wait", timeout=300)
    assert res.returncode == 0, f"{res.stderr.decode()}\n{pool.logs()}"
    assert res.stdout.decode() == reference


@pytest.mark.parametrize("demo", DEMOS)
def test_a_demo_run_as_python_m_mpi4py_futures(pool: Pool, demos: Path, demo: str) -> None:
    reference = _local(demos, 5, "-m", "mpi4py.futures", demo)
    res = pool.vsdk(
        "submit", str(demos / demo), "-m", "mpi4py.futures", "--ranks", "5", "--wait", timeout=300
    )
    assert res.returncode == 0, f"{res.stderr.decode()}\n{pool.logs()}"
    assert res.stdout.decode() == reference
