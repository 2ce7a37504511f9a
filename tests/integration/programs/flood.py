"""Rank 0 sends argv[1] messages of 1 MiB that rank 1 never receives, then both meet at a
barrier: the messages pile up in rank 1's log at its home relay (a flood)."""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
if comm.Get_rank() == 0:
    buf = np.zeros(1 << 20, dtype=np.uint8)
    MPI.Request.Waitall([comm.Isend(buf, dest=1, tag=i) for i in range(int(sys.argv[1]))])
comm.Barrier()
print("flood done", comm.Get_rank())
