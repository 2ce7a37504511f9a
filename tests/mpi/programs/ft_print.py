"""Prints as it goes: a restarted rank's output already shown must not show again."""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
for i in range(40):
    if rank == 0:
        print("line", i, flush=True)
        comm.send(i, dest=1 + i % (size - 1))
        assert comm.recv(source=MPI.ANY_SOURCE, tag=7) == i
    elif i % (size - 1) == rank - 1:
        comm.send(comm.recv(source=0), dest=0, tag=7)
comm.Barrier()
if rank == 0:
    print("print ok")
