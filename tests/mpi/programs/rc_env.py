"""MPI4PY_RC_* variables as mpi4py reads them: the test sets INITIALIZE=false,
THREAD_LEVEL=funneled and ERRORS=fatal; the program checks each, then starts MPI itself."""

import mpi4py
from mpi4py import MPI

assert not MPI.Is_initialized(), "MPI4PY_RC_INITIALIZE=false: no MPI at import"
assert mpi4py.rc.initialize is False and mpi4py.rc.errors == "fatal"
provided = MPI.Init_thread(MPI.THREAD_FUNNELED)
assert provided == MPI.Query_thread() == MPI.THREAD_FUNNELED
comm = MPI.COMM_WORLD
assert comm.Get_errhandler() == MPI.ERRORS_ARE_FATAL
total = comm.allreduce(comm.Get_rank() + 1)
if comm.Get_rank() == 0:
    print("rc ok", total)
