"""Point-to-point: objects and buffers, wildcards, statuses, requests, probes, ordering."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert comm.rank == rank and comm.size == size
right, left = (rank + 1) % size, (rank - 1) % size

# Objects around a ring, with statuses.
comm.send({"from": rank, "data": list(range(rank))}, dest=right, tag=7)
st = MPI.Status()
obj = comm.recv(source=left, tag=7, status=st)
assert obj == {"from": left, "data": list(range(left))}, obj
assert st.Get_source() == left and st.source == left
assert st.Get_tag() == 7 and st.tag == 7
assert st.Get_count() > 0

# Buffers: numpy with and without datatype specs, bytearray, memoryview.
a = np.arange(10, dtype="d") * (rank + 1)
b = np.empty(10, dtype="d")
comm.Send(a, dest=right, tag=1)
comm.Recv(b, source=left, tag=1, status=st)
assert np.array_equal(b, np.arange(10, dtype="d") * (left + 1))
assert st.Get_count(MPI.DOUBLE) == 10 and st.Get_count(MPI.BYTE) == 80
comm.Send([a, MPI.DOUBLE], dest=right, tag=2)
comm.Recv([b, MPI.DOUBLE], source=left, tag=2)
assert np.array_equal(b, np.arange(10, dtype="d") * (left + 1))
ia = np.arange(8, dtype="i") + rank
ib = np.zeros(8, dtype="i")
comm.Send([ia, 5, MPI.INT], dest=right, tag=3)
comm.Recv([ib, 8, MPI.INT], source=left, tag=3, status=st)
assert st.Get_count(MPI.INT) == 5
assert list(ib[:5]) == list(range(left, left + 5)) and not ib[5:].any()
comm.Send(bytearray(b"hello %d" % rank), dest=right, tag=4)
buf = bytearray(16)
comm.Recv(memoryview(buf), source=left, tag=4, status=st)
assert bytes(buf[: st.Get_count()]) == b"hello %d" % left
# A 2-D Fortran-ordered array travels as its bytes.
f = np.asfortranarray(np.arange(12, dtype="i8").reshape(3, 4)) + rank
g = np.empty((3, 4), dtype="i8", order="F")
comm.Sendrecv(f, dest=right, sendtag=5, recvbuf=g, source=left, recvtag=5)
assert np.array_equal(g, np.arange(12).reshape(3, 4) + left)

# Zero-size messages, objects None.
comm.Send(np.empty(0), dest=right, tag=9)
comm.Recv(np.empty(0), source=left, tag=9, status=st)
assert st.Get_count() == 0
comm.send(None, dest=right, tag=9)
assert comm.recv(source=left, tag=9) is None

# Non-blocking, lower and upper case.
reqs = [comm.irecv(source=left, tag=20 + i) for i in range(3)]
for i in reversed(range(3)):
    comm.isend(("x", rank, i), dest=right, tag=20 + i).wait()
assert [r.wait() for r in reqs] == [("x", left, i) for i in range(3)]
assert all(r == MPI.REQUEST_NULL for r in reqs)
rb = np.zeros(4, dtype="i8")
r1 = comm.Irecv(rb, source=left, tag=30)
r2 = comm.Isend(np.full(4, rank, dtype="i8"), dest=right, tag=30)
MPI.Request.Waitall([r1, r2])
assert (rb == left).all()
r1 = comm.Irecv(rb, source=left, tag=31)
comm.Isend(np.full(4, rank + 100, dtype="i8"), dest=right, tag=31).Wait()
while not r1.Test():
    pass
assert (rb == left + 100).all()
reqs = [comm.irecv(source=left, tag=40), comm.irecv(source=left, tag=41)]
comm.send("b", dest=right, tag=41)
comm.send("a", dest=right, tag=40)
got = {}
for _ in range(2):
    idx, val = MPI.Request.waitany(reqs)
    got[idx] = val
assert got == {0: "a", 1: "b"}
assert MPI.Request.waitany(reqs) == (MPI.UNDEFINED, None)
reqs = [comm.irecv(source=left, tag=42)]
comm.send(42, dest=right, tag=42)
flag, vals = MPI.Request.testall(reqs)
while not flag:
    flag, vals = MPI.Request.testall(reqs)
assert vals == [42]
assert MPI.Request.waitall([comm.isend(1, right, 43), comm.irecv(None, left, 43)]) == [None, 1]

# Probes.
comm.send(np.arange(3), dest=right, tag=50)
comm.Probe(source=left, tag=50, status=st)
assert st.source == left and st.tag == 50
assert comm.iprobe(source=left, tag=50)
assert not comm.iprobe(source=left, tag=51)
assert np.array_equal(comm.recv(source=left, tag=50), np.arange(3))
comm.send("m", dest=right, tag=52)
msg = comm.mprobe(source=MPI.ANY_SOURCE, tag=52, status=st)
assert st.source == left and msg.recv() == "m"

# Non-overtaking: many messages from one source arrive in order, across tags with ANY_TAG.
for i in range(200):
    comm.send(i, dest=right, tag=i % 3)
assert [comm.recv(source=left, tag=MPI.ANY_TAG) for _ in range(200)] == list(range(200))
for i in range(50):
    comm.Send(np.full(3, i, dtype="i"), dest=right, tag=60)
out = np.empty(3, dtype="i")
for i in range(50):
    comm.Recv(out, source=MPI.ANY_SOURCE, tag=60)
    assert (out == i).all()

# Messages to self and to PROC_NULL.
comm.send("me", dest=rank, tag=70)
assert comm.recv(source=rank, tag=70) == "me"
x = np.arange(5.0)
comm.Send(x, dest=rank, tag=71)
x[:] = -1
y = np.empty(5)
comm.Recv(y, source=rank, tag=71)
assert np.array_equal(y, np.arange(5.0))
comm.send("void", dest=MPI.PROC_NULL)
assert comm.recv(source=MPI.PROC_NULL, status=st) is None
assert st.source == MPI.PROC_NULL

# sendrecv and Sendrecv_replace.
assert comm.sendrecv(rank, dest=right, source=left) == left
z = np.full(2, rank, dtype="i")
comm.Sendrecv_replace(z, dest=right, source=left)
assert (z == left).all()

# Truncation is an MPI error of class ERR_TRUNCATE.
comm.Send(np.zeros(8), dest=right, tag=80)
try:
    comm.Recv(np.zeros(2), source=left, tag=80)
except MPI.Exception as exc:
    assert exc.Get_error_class() == MPI.ERR_TRUNCATE
else:
    raise AssertionError("no truncation error")
try:
    comm.send(1, dest=size)
except MPI.Exception as exc:
    assert exc.Get_error_class() == MPI.ERR_RANK
else:
    raise AssertionError("no rank error")

comm.Barrier()
if rank == 0:
    print("p2p ok", size)
