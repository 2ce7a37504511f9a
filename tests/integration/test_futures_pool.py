"""mpi4py.futures on a real local pool: the forms that need no spawning, as a scientist submits
them (``vsdk submit -m mpi4py.futures``, and MPICommExecutor in a plain program), give what the
same programs give under ``vsdk mpiexec``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Pool

FARM = str(Path(__file__).resolve().parents[1] / "mpi" / "programs" / "futures_farm.py")

pytestmark = pytest.mark.slow


def _local(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", "4", "--", *argv],
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


@pytest.mark.parametrize(
    ("extra", "form"), [(["-m", "mpi4py.futures"], "pool"), ([], "comm")], ids=["module", "comm"]
)
def test_a_futures_farm_gives_on_the_pool_what_it_gives_locally(
    pool: Pool, extra: list[str], form: str
) -> None:
    reference = _local(*extra, FARM, form)
    res = pool.vsdk("submit", FARM, "--ranks", "4", *extra, "--wait", "--", form, timeout=300)
    assert res.returncode == 0, f"{res.stderr.decode()}\n{pool.logs()}"
    assert res.stdout.decode() == reference
