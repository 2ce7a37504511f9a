"""What real programs hit (issue 18): mpi4py.rc as a module, float ranks that are whole,
receiving into non-contiguous datatypes (Recv, Irecv, Mrecv), and NotImplementedError, not
AttributeError, for dynamic processes and intercommunicators. Rank 0 prints "gaps ok"."""

import sys

import mpi4py.rc  # a module name, as with mpi4py
import numpy as np
from mpi4py import MPI

assert mpi4py.rc is sys.modules["mpi4py.rc"] and mpi4py.rc.errors == "exception"
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert size == 2
assert comm.Get_errhandler() == MPI.ERRORS_RETURN

# A rank computed as a float, whole: accepted; one that is not: TypeError.
peer = 1 - rank + size / 2 - 1  # 1.0 at rank 0, 0.0 at rank 1
assert isinstance(peer, float)
if rank == 0:
    comm.send("to a float rank", dest=peer)
    try:
        comm.send("x", dest=0.5)
    except TypeError:
        pass
    else:
        raise AssertionError("a rank of 0.5 was accepted")
else:
    assert comm.recv(source=peer) == "to a float rank"
assert comm.bcast(rank * 10 + 7, root=float(0)) == 7

# Receiving into every other element: a vector datatype, three ways.
vector = MPI.DOUBLE.Create_vector(4, 1, 2).Commit()
if rank == 0:
    for tag in (1, 2, 3):
        comm.Send([np.arange(4, dtype="d") + tag, 4, MPI.DOUBLE], dest=1, tag=tag)
else:
    for tag, how in ((1, "Recv"), (2, "Irecv"), (3, "Mrecv")):
        got = np.full(8, -1.0)
        if how == "Recv":
            comm.Recv([got, 1, vector], source=0, tag=tag)
        elif how == "Irecv":
            comm.Irecv([got, 1, vector], source=0, tag=tag).Wait()
        else:
            comm.mprobe(source=0, tag=tag).Recv([got, 1, vector])
        want = [tag, -1, tag + 1, -1, tag + 2, -1, tag + 3, -1]
        assert got.tolist() == want, (how, got.tolist())
vector.Free()

# Absent features say so the way mpi4py's suite expects of an MPI without them.
for call in (
    lambda: MPI.Open_port(),
    lambda: MPI.Lookup_name("vpool"),
):
    try:
        call()
    except NotImplementedError:
        pass
    else:
        raise AssertionError("expected NotImplementedError")

comm.Barrier()
if rank == 0:
    print("gaps ok")
