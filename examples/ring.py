"""A token goes round a ring of ranks; then every rank swaps a numpy array with its neighbours.

    mpiexec -n 8 python ring.py [LAPS]

1. Rank 0 sends a token (a Python int) to rank 1, each rank adds its rank and passes it on
   (lower-case send/recv, pickled objects); after LAPS laps the token is back at rank 0.
2. Every rank sends an array [rank, rank**2, rank**3] to its right neighbour and receives its
   left neighbour's with one Sendrecv (buffers, numpy).
Only rank 0 prints, after gathering what every rank got, so the output is deterministic.
"""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()
laps = int(sys.argv[1]) if len(sys.argv) > 1 else 1
right = (rank + 1) % size
left = (rank - 1) % size

token = 0
for lap in range(laps):
    if size == 1:
        token += rank
    elif rank == 0:
        comm.send(token, dest=right, tag=lap)
        token = comm.recv(source=left, tag=lap)
    else:
        token = comm.recv(source=left, tag=lap)
        token += rank
        comm.send(token, dest=right, tag=lap)

mine = np.array([rank, rank**2, rank**3], dtype=np.int64)
got = np.empty(3, dtype=np.int64)
comm.Sendrecv(mine, dest=right, sendtag=100, recvbuf=got, source=left, recvtag=100)
everything = comm.gather((rank, got.tolist()), root=0)

if rank == 0:
    print(f"ring of {size} ranks, {laps} lap(s)")
    print(f"token back at rank 0: {token} (expected {laps * size * (size - 1) // 2})")
    for r, values in everything:
        print(f"rank {r} got {values} from rank {(r - 1) % size}")
