"""Prints where `mpi4py` came from and the rank's environment facts, gathered at rank 0."""

import os

import mpi4py
from mpi4py import MPI

comm = MPI.COMM_WORLD
facts = comm.gather((comm.rank, mpi4py.__file__, os.environ.get("PYTHONHASHSEED")), root=0)
if comm.rank == 0:
    for rank, path, seed in facts:
        print(rank, path, seed)
