"""Round-trip time of small messages between ranks 0 and 1 (printed, not asserted)."""

import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
rank = comm.rank
comm.Barrier()
t = MPI.Wtime()
for i in range(n):
    if rank == 0:
        comm.send(i, dest=1)
        assert comm.recv(source=1) == i
    elif rank == 1:
        comm.send(comm.recv(source=0), dest=0)
t = MPI.Wtime() - t
if rank == 0:
    print(f"pingpong {t / n * 1e6:.1f} us per round trip")
