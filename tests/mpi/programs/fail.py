import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
mode = sys.argv[1]
comm.Barrier()
if comm.rank == 1 % comm.size:
    if mode == "raise":
        raise RuntimeError(f"boom in rank {comm.rank}")
    sys.exit(int(mode))
comm.Barrier()  # the others wait here until they are stopped
