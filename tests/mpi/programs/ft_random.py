"""Not deterministic: sends random numbers. A replay re-sends different bytes."""

import os

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
for _ in range(50):
    if rank == 0:
        comm.send(os.urandom(16), dest=1)
    elif rank == 1:
        comm.recv(source=0)
comm.Barrier()
if rank == 0:
    print("random done")
