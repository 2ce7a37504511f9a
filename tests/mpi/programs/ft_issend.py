"""Synchronous sends: their match notices are sent during progress."""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
right, left = (rank + 1) % size, (rank - 1) % size
total = 0
for it in range(30):
    r = comm.irecv(source=left, tag=it)
    s = comm.issend(rank + it, dest=right, tag=it)
    if it % 2:
        while not s.Test():
            pass
    total += r.wait()
    s.wait()
    s2 = comm.issend(it, dest=right, tag=200)
    assert comm.recv(source=MPI.ANY_SOURCE, tag=200) == it
    s2.wait()
assert total == sum(left + it for it in range(30))
tot = comm.allreduce(total)
if rank == 0:
    print("issend ok", tot)
