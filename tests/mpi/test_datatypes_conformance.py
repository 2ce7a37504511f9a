"""Derived datatypes, null-handle error classes and Alltoallw end to end: real rank processes
through ``vpool.sdk.mpiexec`` (``programs/datatypes_conformance.py`` checks every rank)."""

from __future__ import annotations

import pytest

from tests.mpi.test_mpi import mpiexec

pytestmark = pytest.mark.large


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_datatypes_conformance(n: int) -> None:
    result = await mpiexec(n, "datatypes_conformance.py", deadline=120)
    assert result.returncode == 0, str(result)
    assert result.stdout == f"datatypes ok {n}\n", str(result)
