# Author:  Lisandro Dalcin
# Contact: dalcinl@gmail.com
# Copyright (c) 2026, Lisandro Dalcin. BSD-3-Clause: see ../LICENSE.mpi4py.
# Vendored from mpi4py 4.1.2 (src/mpi4py/futures/__init__.py) into vpool's mpi4py shim.
# vpool's changes: WorkerLost (a BrokenExecutor: a task's worker was lost more times than
# the executor retries it; _core.py) is exported too, and listed in __all__.
"""Execute computations asynchronously using MPI processes."""
# pylint: disable=redefined-builtin

from ._base import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    BrokenExecutor,
    CancelledError,
    Executor,
    Future,
    InvalidStateError,
    TimeoutError,  # noqa: A004
    as_completed,
    wait,
)
from ._core import WorkerLost  # vpool
from .pool import (
    MPICommExecutor,
    MPIPoolExecutor,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    get_comm_workers,
)
from .util import (
    collect,
    compose,
)

__all__ = [
    "Future",
    "Executor",
    "wait",
    "FIRST_COMPLETED",
    "FIRST_EXCEPTION",
    "ALL_COMPLETED",
    "as_completed",
    "CancelledError",
    "TimeoutError",
    "InvalidStateError",
    "BrokenExecutor",
    "MPIPoolExecutor",
    "MPICommExecutor",
    "ThreadPoolExecutor",
    "ProcessPoolExecutor",
    "get_comm_workers",
    "collect",
    "compose",
    "WorkerLost",  # vpool
]
