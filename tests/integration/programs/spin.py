"""Runs until killed (bounded at 120 s): a ring exchange every 50 ms. Each rank prints 'ready R'
once the first exchange is done, so a test can wait for the job to be really running."""

import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
deadline = time.monotonic() + 120
first = True
while time.monotonic() < deadline:
    comm.sendrecv(rank, dest=(rank + 1) % size, source=(rank - 1) % size)
    if first:
        print(f"ready {rank}", flush=True)
        first = False
    time.sleep(0.05)
