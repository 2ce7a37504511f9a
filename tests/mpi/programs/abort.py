import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
print("rank", comm.rank, "up", flush=True)
comm.Barrier()
if comm.rank == comm.size - 1:
    print("aborting", flush=True)
    comm.Abort(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
comm.recv(source=MPI.ANY_SOURCE)  # never satisfied: only the abort ends this rank
