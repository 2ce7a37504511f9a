"""A small, slow stencil for the checkpoint tests: deterministic output, time to checkpoint it.

    ckpt_stencil.py STEPS [COLS] [DELAY]

Each rank holds 16 rows of COLS doubles (default 1024); every step it swaps its edge rows with
both neighbours (``Sendrecv``: messages of COLS x 8 bytes), averages, and sleeps DELAY seconds
(default 0.05: computation time, in which a checkpoint signal finds no MPI call on the stack).
Rank 0 alone prints a line every 10 steps (so the merged output does not depend on timing, and
a restored rank 0 must neither repeat nor lose lines) and a checksum at the end. Rank 0 also reads
one line of its stdin per step and prints the last one read with its line: given a file larger
than Python's read-ahead buffer (``vsdk submit --stdin``), a restored rank 0 must read on from
where its image stood.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
steps = int(sys.argv[1])
cols = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
up = rank - 1 if rank > 0 else MPI.PROC_NULL
down = rank + 1 if rank < size - 1 else MPI.PROC_NULL

u = np.zeros((18, cols))
u[1:-1] = np.sin(np.arange(16 * cols).reshape(16, cols) * (rank + 1) * 1e-3)
if rank == 0:
    u[0] = 1.0
for step in range(1, steps + 1):
    comm.Sendrecv(u[1], dest=up, sendtag=1, recvbuf=u[-1], source=down, recvtag=1)
    comm.Sendrecv(u[-2], dest=down, sendtag=2, recvbuf=u[0], source=up, recvtag=2)
    u[1:-1] = 0.5 * u[1:-1] + 0.25 * (u[:-2] + u[2:])
    time.sleep(delay)
    line = sys.stdin.readline().strip() if rank == 0 else ""
    if rank == 0 and step % 10 == 0:
        print(f"step {step}: {float(u[1:-1].sum()):.12e} {line}".rstrip(), flush=True)
parts = comm.gather(float((u[1:-1] * np.arange(1, cols + 1)).sum()), root=0)
if rank == 0:
    print(f"checksum {sum(parts):.12e}")
