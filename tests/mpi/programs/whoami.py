import os
import sys

import mpi4py
from mpi4py import MPI

comm = MPI.COMM_WORLD
line = "|".join(
    [
        str(comm.rank),
        str(comm.size),
        mpi4py.__file__,
        mpi4py.__version__,
        MPI.__name__,
        os.environ.get("PYTHONHASHSEED", ""),
        os.environ.get("VPOOL_RANK", ""),
        str(MPI.Is_initialized()),
        str(MPI.Is_finalized()),
    ]
)
lines = comm.gather(line)
if comm.rank == 0:
    print("\n".join(lines))
MPI.Finalize()
assert MPI.Is_finalized()
sys.stdout.flush()
