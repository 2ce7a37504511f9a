import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
data = sys.stdin.read()
everyone = comm.gather(data)
if comm.rank == 0:
    print(repr(everyone))
