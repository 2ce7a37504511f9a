"""Non-blocking collectives progress while their rank blocks in something else (see
``programs/nb_progress.py``): a deadlock here ends at the deadline."""

from __future__ import annotations

import pytest

from tests.mpi.test_mpi import mpiexec

pytestmark = pytest.mark.large


@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_iallreduce_progresses_during_blocking_recv(n: int) -> None:
    result = await mpiexec(n, "nb_progress.py", deadline=60)
    assert result.returncode == 0, str(result)
    assert result.stdout == f"nb progress ok {n}\n", str(result)
