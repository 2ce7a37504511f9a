"""pi by the midpoint rule: every rank sends its part to every other (tag 7) and prints the sum
it gets (validation by replay, test_validation.py). argv: intervals."""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
h = 1.0 / n
x = h * (np.arange(rank, n, size) + 0.5)
part = np.array([np.sum(4.0 / (1.0 + x * x)) * h])
total = part.copy()
for peer in range(size):
    if peer != rank:
        comm.Send(part, dest=peer, tag=7)
got = np.empty(1)
for peer in range(size):
    if peer != rank:
        comm.Recv(got, source=peer, tag=7)
        total += got
print(f"rank {rank}: pi = {total[0]:.12f}", flush=True)
