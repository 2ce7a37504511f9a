"""Cartesian topologies, persistent requests, error classes, Info, misc environment calls."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size

assert MPI.Compute_dims(12, [0, 0]) == [4, 3]
assert MPI.Compute_dims(16, 3) == [4, 2, 2]
assert MPI.Compute_dims(6, [0, 3]) == [2, 3]
dims = MPI.Compute_dims(size, 2)
cart = comm.Create_cart(dims, periods=[True, False])
assert isinstance(cart, MPI.Cartcomm) and cart.Get_topology() == MPI.CART
assert cart.dims == dims and cart.periods == [1, 0]
coords = cart.Get_coords(cart.rank)
assert cart.coords == coords and cart.Get_cart_rank(coords) == cart.rank
src, dst = cart.Shift(0, 1)
assert dst == cart.Get_cart_rank([(coords[0] + 1) % dims[0], coords[1]])
src, dst = cart.Shift(1, 1)
if coords[1] == dims[1] - 1:
    assert dst == MPI.PROC_NULL
# A halo exchange along the periodic dimension.
left, right = cart.Shift(0, 1)
got = cart.sendrecv(cart.rank, dest=right, source=left)
assert got == left
row = cart.Sub([False, True])
assert row.size == dims[1] and row.allgather(coords[0]) == [coords[0]] * dims[1]

# Persistent requests.
peer_r, peer_l = (rank + 1) % size, (rank - 1) % size
sbuf = np.zeros(3, dtype="i")
rbuf = np.zeros(3, dtype="i")
sreq = comm.Send_init(sbuf, dest=peer_r, tag=11)
rreq = comm.Recv_init(rbuf, source=peer_l, tag=11)
for i in range(5):
    sbuf[:] = i * 10 + rank
    MPI.Prequest.Startall([rreq, sreq])
    MPI.Request.Waitall([rreq, sreq])
    assert (rbuf == i * 10 + peer_l).all()
sreq.Free()
rreq.Free()

# Cancelled receive, error classes and strings.
req = comm.irecv(source=peer_l, tag=999)
req.Cancel()
st = MPI.Status()
req.Wait(st)
assert st.Is_cancelled()
try:
    comm.Bcast(np.zeros(1), root=size)
except MPI.Exception as exc:
    assert exc.Get_error_class() == MPI.ERR_ROOT
    assert MPI.Get_error_string(exc.error_code)
else:
    raise AssertionError("no root error")
assert isinstance(MPI.Exception(MPI.ERR_OTHER), RuntimeError)
assert comm.Get_attr(MPI.TAG_UB) >= 32767
assert MPI.Get_version() >= (3, 1)
assert MPI.Query_thread() in (
    MPI.THREAD_SINGLE,
    MPI.THREAD_FUNNELED,
    MPI.THREAD_SERIALIZED,
    MPI.THREAD_MULTIPLE,
)
assert MPI.DOUBLE.Get_size() == 8 and MPI.INT.size == 4 and MPI._typedict["d"] is MPI.DOUBLE
assert MPI.INT.Create_contiguous(4).Commit().size == 16
info = MPI.Info.Create()
info["key"] = "value"
assert info.Get("key") == "value"
info.Free()
x = np.array([1.0, 2.0])
y = np.array([3.0, 4.0])
MPI.SUM.Reduce_local(x, y)
assert list(y) == [4.0, 6.0]
assert MPI.SUM(2, 3) == 5 and MPI.MAXLOC((1, 2), (1, 0)) == (1, 0)
comm.Barrier()
if rank == 0:
    print("topo ok", size)
