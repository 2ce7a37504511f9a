"""Point-to-point semantics mpi4py's suite relies on (regressions of the conformance work)."""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

# Synchronous sends complete only once matched: rank 1 posts its receive after a go-ahead
# that rank 0 sends after testing, so the first Test must say "not yet", deterministically.
if rank == 0 and size > 1:
    req = comm.issend("sync", dest=1, tag=1)
    assert req and not req.Test(), "issend completed before the receiver matched it"
    comm.send("go", dest=1, tag=2)
    req.wait()
    assert not req
    sreq = comm.Issend(bytearray(b"raw"), dest=1, tag=3)
    comm.ssend("blocking", dest=1, tag=4)  # returns once matched
    sreq.Wait()
elif rank == 1:
    assert comm.recv(source=0, tag=2) == "go"
    assert comm.recv(source=0, tag=1) == "sync"
    buf = bytearray(3)
    msg = comm.mprobe(source=0, tag=3)  # a matched probe completes a synchronous send too
    msg.Recv(buf)
    assert bytes(buf) == b"raw"
    assert comm.recv(source=0, tag=4) == "blocking"

# Self sends: issend to self completes when the receive matches.
req = comm.issend(rank, dest=rank, tag=5)
assert not req.Test()
assert comm.recv(source=rank, tag=5) == rank
assert req.Test()

# An empty buffer message received as an object is None; MPI.pickle gives bytes.
comm.Send([None, 0, "B"], dest=rank, tag=6)
assert comm.recv(source=rank, tag=6) is None
data = MPI.pickle.dumps({"a": 1})
assert isinstance(data, bytes) and MPI.pickle.loads(data) == {"a": 1}

# Persistent requests stay non-null (inactive) after completion, until freed.
preq = comm.Send_init(b"", MPI.PROC_NULL, 0)
preq.Start()
preq.Wait()
assert preq != MPI.REQUEST_NULL and MPI.Request(preq) == preq
assert MPI.Request.Waitany([preq]) == MPI.UNDEFINED
preq.Free()
assert preq == MPI.REQUEST_NULL

# Status is live memory, as MPICH's MPI_Status.
st = MPI.Status()
st.source, st.tag = 11, 22
mem = st.tomemory()
mem[list(mem).index(11)] = 111
assert st.source == 111

# Predefined communicators cannot be freed.
try:
    MPI.COMM_WORLD.Free()
except MPI.Exception as exc:
    assert exc.Get_error_class() == MPI.ERR_COMM
else:
    raise AssertionError("COMM_WORLD.Free() succeeded")

# Vector specs: (counts, displs) in the counts place; a zero count with no displacements.
comm.Gatherv([None, MPI.INT], [None, (0, None), MPI.INT], root=0)

comm.Barrier()
if rank == 0:
    print("p2p semantics ok", size)
