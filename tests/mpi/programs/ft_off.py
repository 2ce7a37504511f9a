"""Every kind of determinant in a few lines: ANY_SOURCE receives, Wtime, Iprobe, Test, a
non-blocking collective (asynchronous rounds) and an Issend (match notices). Prints how many
determinant frames this rank wrote, from the runtime's own count."""

import sys

import numpy as np
from mpi4py import MPI

from vpool.mpi import environment

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
t0 = MPI.Wtime()
total = 0
if rank == 0:
    for _ in range(3 * (size - 1)):
        total += comm.recv(source=MPI.ANY_SOURCE, tag=1)
    while not comm.Iprobe(source=MPI.ANY_SOURCE, tag=2):
        pass
    total += comm.recv(source=MPI.ANY_SOURCE, tag=2)
else:
    for i in range(3):
        comm.send(rank * 10 + i, dest=0, tag=1)
    if rank == 1:
        req = comm.issend(1000, dest=0, tag=2)
        while not req.Test():
            pass
a, b = np.full(2, float(rank + 1)), np.empty(2)
red = comm.Iallreduce(a, b, op=MPI.SUM)
got = comm.sendrecv(rank, dest=(rank + 1) % size, source=(rank - 1) % size)
assert got == (rank - 1) % size
while not red.Test():
    comm.Iprobe(source=MPI.ANY_SOURCE, tag=7)
value = int(b[0])
elapsed = MPI.Wtime() - t0
assert elapsed >= 0
expected = sum(r * 10 + i for r in range(1, size) for i in range(3)) + 1000
if rank == 0:
    assert total == expected, (total, expected)
# One write per line: the ranks share the test's output file, and print() writes the text and
# the newline separately (unbuffered), so lines of different ranks could interleave.
sys.stdout.write(f"rank {rank} sum {value} dets {environment.engine().transport.det_sent}\n")
sys.stdout.flush()
