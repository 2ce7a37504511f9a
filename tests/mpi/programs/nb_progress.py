"""A rank blocked in Recv keeps its open Iallreduce going: its peer needs the next round.

Rank 0 starts an Iallreduce and blocks in Recv for messages every other rank sends only after
its own Wait on the Iallreduce returned. From 3 ranks on, some peer needs a later round from
rank 0: unless rank 0's blocking Recv advances the schedule, that peer and rank 0 wait forever."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

for rounds in range(3):
    data = np.full(8, rank + 1, dtype="d")
    out = np.empty_like(data)
    req = comm.Iallreduce(data, out, op=MPI.SUM)
    if rank == 0:
        for src in range(1, size):
            got = comm.recv(source=src, tag=7)
            assert got == ("done", rounds), got
        req.Wait()
    else:
        req.Wait()
        comm.send(("done", rounds), dest=0, tag=7)
    assert (out == size * (size + 1) / 2).all(), out[:4]

if rank == 0:
    print(f"nb progress ok {size}")
