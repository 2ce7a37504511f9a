"""1-D heat equation with halo exchanges by ``Sendrecv``; runs for as long as you ask.

    mpiexec -n 8 python heat.py [STEPS] [CELLS_PER_RANK]

The rod is split into one block per rank. Every step each rank swaps its edge cells with both
neighbours (``Sendrecv``, ``PROC_NULL`` at the ends), updates its block, and every 100 steps the
ranks agree on the total heat with ``allreduce``. Rank 0 prints the totals and a final checksum.
The defaults (1000 steps) take a few seconds on 8 ranks of a 2-core machine (about 6 s under
``vsdk mpiexec``; about 20 s under MPICH's ``mpiexec``, whose ranks spin while they wait when
there are more of them than cores); give STEPS for longer runs (20000 for minutes).
"""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
cells = int(sys.argv[2]) if len(sys.argv) > 2 else 2000

left = rank - 1 if rank > 0 else MPI.PROC_NULL
right = rank + 1 if rank < size - 1 else MPI.PROC_NULL

u = np.zeros(cells + 2)
x = (np.arange(cells) + rank * cells) / (cells * size)
u[1:-1] = np.sin(np.pi * x) + (x > 0.4) * (x < 0.6)
alpha = 0.25

for step in range(1, steps + 1):
    comm.Sendrecv(u[1:2], dest=left, sendtag=1, recvbuf=u[-1:], source=right, recvtag=1)
    comm.Sendrecv(u[-2:-1], dest=right, sendtag=2, recvbuf=u[0:1], source=left, recvtag=2)
    u[1:-1] = u[1:-1] + alpha * (u[:-2] - 2 * u[1:-1] + u[2:])
    if step % (steps // 10 or 1) == 0:
        total = comm.allreduce(float(np.sum(u[1:-1])), op=MPI.SUM)
        if rank == 0:
            print(f"step {step}: total heat {total:.9f}")

blocks = comm.gather(u[1:-1].copy(), root=0)
if rank == 0:
    rod = np.concatenate(blocks)
    print(f"checksum {float(np.sum(rod * np.arange(rod.size))):.6f}")
