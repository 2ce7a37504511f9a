"""Derived datatypes, null-handle errors and Alltoallw, checked on every rank."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def raises(cls, fn, *args):
    try:
        fn(*args)
    except MPI.Exception as exc:
        assert exc.Get_error_class() in cls, (fn, exc.Get_error_class())
    else:
        raise AssertionError(f"{fn} did not raise")


# Null and predefined handles raise with MPICH's error classes.
raises([MPI.ERR_TYPE], MPI.DATATYPE_NULL.Commit)
raises([MPI.ERR_TYPE], MPI.DATATYPE_NULL.Dup)
raises([MPI.ERR_TYPE], MPI.INT.Free)
raises([MPI.ERR_KEYVAL], MPI.INT.Get_attr, MPI.KEYVAL_INVALID)
raises([MPI.ERR_TYPE], MPI.Status().Get_count, MPI.DATATYPE_NULL)
raises([MPI.ERR_INFO, MPI.ERR_ARG], MPI.INFO_NULL.Get, "key")
raises([MPI.ERR_INFO_NOKEY], MPI.Info.Create().Delete, "key")
raises([MPI.ERR_REQUEST], MPI.REQUEST_NULL.Free)
raises([MPI.ERR_OP], MPI.SUM.Free)
raises([MPI.ERR_ERRHANDLER, MPI.ERR_ARG], MPI.COMM_WORLD.Set_errhandler, MPI.ERRHANDLER_NULL)
assert MPI.ERR_ERRHANDLER == 1073741823

# Type maps: extents and packing of non-contiguous layouts.
t = MPI.INT.Create_indexed_block(1, [1, 3, 5, 7, 9]).Commit()
assert t.Get_extent() == (4, 36) and t.size == 20
v = MPI.DOUBLE.Create_vector(3, 2, 4).Commit()
assert v.Get_extent() == (0, 80) and v.size == 48
r = MPI.INT.Create_resized(0, 8).Commit()
assert r.extent == 8 and r.size == 4

for root in range(size):
    buf = np.arange(10, dtype="i") if rank == root else np.full(10, -1, dtype="i")
    comm.Bcast([buf, 1, t], root=root)
    expect = [i if i % 2 else (i if rank == root else -1) for i in range(10)]
    assert buf.tolist() == expect, buf
    req = comm.Ibcast([buf, 1, t], root=root)
    req.Wait()
    assert buf.tolist() == expect, buf

    data = np.arange(16, dtype="d") if rank == root else np.zeros(16, dtype="d")
    comm.Bcast([data, 1, v], root=root)
    mask = [(i % 4) < 2 and i < 12 for i in range(16)]
    want = [float(i) if (m or rank == root) else 0.0 for i, m in enumerate(mask)]
    assert data.tolist() == want, data

# Allreduce on a strided layout reduces only the selected elements.
vals = np.full(8, rank + 1, dtype="i")
out = np.zeros(8, dtype="i")
every_other = MPI.INT.Create_vector(4, 1, 2).Commit()
comm.Allreduce([vals, 1, every_other], [out, 1, every_other], op=MPI.SUM)
total = size * (size + 1) // 2
assert out.tolist() == [total, 0] * 4, out
for dt in (t, v, r, every_other):
    dt.Free()
assert t == MPI.DATATYPE_NULL

# Alltoallw with per-peer byte displacements.
n = 2
sbuf = np.full((size, n), rank, dtype="i")
rbuf = np.full((size, n), -1, dtype="i")
displs = [i * n * 4 for i in range(size)]
comm.Alltoallw(
    [sbuf, ([n] * size, displs), [MPI.INT] * size], [rbuf, ([n] * size, displs), [MPI.INT] * size]
)
assert rbuf.tolist() == [[i] * n for i in range(size)], rbuf
assert MPI.Get_address(sbuf) == sbuf.ctypes.data

if rank == 0:
    print(f"datatypes ok {size}")
