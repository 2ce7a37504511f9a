"""2-D Jacobi stencil with a large grid per rank: the program the checkpoint benchmarks run.

    mpiexec -n 4 python stencil.py [STEPS] [MB] [PROGRESS]

The grid is split into horizontal strips, one per rank; each rank holds two strips of MB/2
megabytes (MiB) each (the current and the next iterate, MB megabytes in all, default 200). Every
step each rank swaps its edge rows with both neighbours (``Sendrecv``, ``PROC_NULL`` at the
ends) and replaces every interior point by the mean of its four neighbours; the top edge of the
whole grid is held at 1, the other edges at 0. Nothing is printed per step: at the end rank 0
gathers each rank's weighted sum and prints one checksum, the same on every run and any MPI.

With PROGRESS (a file name), rank 0 also appends ``STEP TIME`` (``time.time()``) to that file
every 10 steps and after the last one, opening and closing it each time: ``benchmarks/recovery.py``
reads it to see when the job stood still. Standard output does not change.

With 4 ranks of 200 MB, 1300 steps take about 2 minutes on a local pool of a 2-core machine
(``benchmarks/checkpoint_overhead.py`` and ``benchmarks/recovery.py`` use it that way).
"""

import sys
import time

import numpy as np
from mpi4py import MPI

COLS = 4096  # points per row (32 KiB of float64): each halo message is one row

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
mb = float(sys.argv[2]) if len(sys.argv) > 2 else 200.0
progress = sys.argv[3] if len(sys.argv) > 3 and rank == 0 else ""
PROGRESS_EVERY = 10


def note(step):
    if progress:
        with open(progress, "a") as f:
            f.write(f"{step} {time.time():.3f}\n")


rows = max(1, int(mb * 2**20 / 2 / 8 / COLS) - 2)  # interior rows of this rank's strip
up = rank - 1 if rank > 0 else MPI.PROC_NULL
down = rank + 1 if rank < size - 1 else MPI.PROC_NULL

# Rows 0 and rows+1 are halos (or the fixed top/bottom edge); columns 0 and COLS-1 stay 0.
u = np.zeros((rows + 2, COLS))
first = rank * rows  # global index of this rank's first interior row
y = (np.arange(rows) + first) / (rows * size)
x = np.arange(COLS) / COLS
u[1:-1, 1:-1] = (np.sin(np.pi * y)[:, None] * np.cos(3 * np.pi * x)[None, :])[:, 1:-1]
if rank == 0:
    u[0, 1:-1] = 1.0
v = u.copy()

note(0)
for step in range(1, steps + 1):
    comm.Sendrecv(u[1], dest=up, sendtag=1, recvbuf=u[-1], source=down, recvtag=1)
    comm.Sendrecv(u[-2], dest=down, sendtag=2, recvbuf=u[0], source=up, recvtag=2)
    inner = v[1:-1, 1:-1]
    np.add(u[:-2, 1:-1], u[2:, 1:-1], out=inner)  # in place: no grid-sized temporaries
    inner += u[1:-1, :-2]
    inner += u[1:-1, 2:]
    inner *= 0.25
    u, v = v, u  # both arrays hold the fixed edges; halo rows are refilled every step
    if step % PROGRESS_EVERY == 0 or step == steps:
        note(step)

weights = np.arange(1, rows + 1, dtype=np.float64) + first
local = float(weights @ u[1:-1].sum(axis=1))
parts = comm.gather(local, root=0)
if rank == 0:
    print(f"checksum {sum(parts):.10e} after {steps} steps on {size} ranks x {mb:g} MB")
