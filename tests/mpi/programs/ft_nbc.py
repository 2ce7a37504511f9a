"""Non-blocking collectives overlapped with point-to-point (and tested while pending)."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
right, left = (rank + 1) % size, (rank - 1) % size
acc = 0.0
for it in range(25):
    a = np.full(4, float(rank + it))
    b = np.empty(4)
    req = comm.Iallreduce(a, b, op=MPI.SUM)
    bar = comm.Ibarrier()
    got = comm.sendrecv(rank * it, dest=right, source=left)
    assert got == left * it
    polls = 0
    while not req.Test():
        polls += 1
        comm.Iprobe(source=MPI.ANY_SOURCE)
    MPI.Request.Waitall([bar])
    acc += float(b[0])
    x = comm.Ibcast(np.array([it * 1.0]) if rank == 0 else np.empty(1), root=0)
    x.Wait()
expect = sum(sum(r + it for r in range(size)) for it in range(25))
assert acc == expect, (acc, expect)
if rank == 0:
    print("nbc ok", acc)
