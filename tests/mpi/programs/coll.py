"""Every collective, objects and buffers, several ops and roots, IN_PLACE, MAXLOC/MINLOC."""

import functools

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
ranks = list(range(size))

# ---- objects ----
comm.barrier()
for root in {0, size - 1, size // 2}:
    assert comm.bcast({"root": root} if rank == root else None, root=root) == {"root": root}
    vals = comm.gather(rank * 10, root=root)
    assert vals == ([r * 10 for r in ranks] if rank == root else None)
    items = [(i, "x" * i) for i in ranks] if rank == root else None
    assert comm.scatter(items, root=root) == (rank, "x" * rank)
    assert comm.reduce(rank + 1, op=MPI.SUM, root=root) == (
        sum(r + 1 for r in ranks) if rank == root else None
    )
    # Non-commutative in rank order: list concatenation.
    assert comm.reduce([rank], op=MPI.SUM, root=root) == (ranks if rank == root else None)
assert comm.allgather(rank) == ranks
assert comm.alltoall([(rank, i) for i in ranks]) == [(i, rank) for i in ranks]
pyops = {
    MPI.SUM: lambda a, b: a + b,
    MPI.PROD: lambda a, b: a * b,
    MPI.MAX: max,
    MPI.MIN: min,
    MPI.BAND: lambda a, b: a & b,
    MPI.BOR: lambda a, b: a | b,
    MPI.BXOR: lambda a, b: a ^ b,
}
for op, f in pyops.items():
    vals = [(r * 7 + 3) % 11 + 1 for r in ranks]
    mine = vals[rank]
    assert comm.allreduce(mine, op=op) == functools.reduce(f, vals), op
    assert comm.scan(mine, op=op) == functools.reduce(f, vals[: rank + 1]), op
    ex = comm.exscan(mine, op=op)
    assert ex == (None if rank == 0 else functools.reduce(f, vals[:rank])), (op, ex)
assert comm.allreduce([rank]) == ranks
assert comm.scan([rank]) == ranks[: rank + 1]
assert comm.allreduce(rank % 2 == 0, op=MPI.LAND) == (size == 1)
assert comm.allreduce(rank == size - 1, op=MPI.LOR) is True
assert comm.allreduce((rank % 3, rank), op=MPI.MAXLOC) == (
    max(r % 3 for r in ranks),
    2 if size > 2 else size - 1,
)
assert comm.allreduce((rank % 3, rank), op=MPI.MINLOC) == (0, 0)
assert comm.allreduce(np.arange(3) * rank) is not None

# ---- buffers ----
for dtype, mpitype in (("f8", MPI.DOUBLE), ("i4", MPI.INT), ("i8", MPI.INT64_T), ("f4", MPI.FLOAT)):
    for n in (0, 1, 5, 1000):
        x = (np.arange(n) % 5 + rank + 1).astype(dtype)
        allx = np.array([(np.arange(n) % 5 + r + 1).astype(dtype) for r in ranks])
        for op, f in ((MPI.SUM, np.sum), (MPI.PROD, np.prod), (MPI.MAX, np.max), (MPI.MIN, np.min)):
            expect = f(allx, axis=0).astype(dtype)
            y = np.empty(n, dtype)
            comm.Allreduce(x, y, op=op)
            assert np.allclose(y, expect), (dtype, n, op)
            comm.Allreduce([x, mpitype], [y, mpitype], op=op)
            assert np.allclose(y, expect)
            z = x.copy()
            comm.Allreduce(MPI.IN_PLACE, z, op=op)
            assert np.allclose(z, expect)
            for root in {0, size - 1}:
                y = np.full(n, -1, dtype)
                comm.Reduce(x, y if rank == root else None, op=op, root=root)
                if rank == root:
                    assert np.allclose(y, expect)
                z = x.copy()
                comm.Reduce(MPI.IN_PLACE if rank == root else z, z, op=op, root=root)
                if rank == root:
                    assert np.allclose(z, expect)
            if op in (MPI.SUM, MPI.MAX):
                s = np.empty(n, dtype)
                comm.Scan(x, s, op=op)
                assert np.allclose(s, f(allx[: rank + 1], axis=0))
                e = np.full(n, -7, dtype)
                comm.Exscan(x, e, op=op)
                if rank > 0:
                    assert np.allclose(e, f(allx[:rank], axis=0))
for op, f in ((MPI.BAND, np.bitwise_and), (MPI.BOR, np.bitwise_or), (MPI.BXOR, np.bitwise_xor)):
    x = np.array([rank * 3 + 1, 255 - rank], dtype="i4")
    y = np.empty_like(x)
    comm.Allreduce(x, y, op=op)
    assert np.array_equal(y, f.reduce([np.array([r * 3 + 1, 255 - r], "i4") for r in ranks]))
x = np.array([rank % 2, 1], dtype="i4")
y = np.empty_like(x)
comm.Allreduce(x, y, op=MPI.LAND)
assert list(y) == [0, 1]
comm.Allreduce(x, y, op=MPI.LOR)
assert list(y) == [int(size > 1), 1]

# MAXLOC / MINLOC on pair types.
pair = np.dtype([("v", "f8"), ("i", "i4")], align=True)
x = np.array([((rank * 5) % 3, rank), (-rank, rank)], dtype=pair)
y = np.empty_like(x)
comm.Allreduce([x, MPI.DOUBLE_INT], [y, MPI.DOUBLE_INT], op=MPI.MAXLOC)
vals = [(r * 5) % 3 for r in ranks]
assert y[0]["v"] == max(vals) and y[0]["i"] == vals.index(max(vals))
assert y[1]["v"] == 0 and y[1]["i"] == 0
comm.Allreduce([x, MPI.DOUBLE_INT], [y, MPI.DOUBLE_INT], op=MPI.MINLOC)
assert y[0]["v"] == min(vals) and y[0]["i"] == vals.index(min(vals))
assert y[1]["v"] == -(size - 1) and y[1]["i"] == size - 1
p2 = np.array([[rank % 2, rank]], dtype="i4")
q2 = np.empty_like(p2)
comm.Allreduce([p2, MPI.TWOINT], [q2, MPI.TWOINT], op=MPI.MAXLOC)
assert list(q2[0]) == [int(size > 1), 1 if size > 1 else 0]

# Bcast, Gather(v), Scatter(v), Allgather(v), Alltoall(v).
for root in {0, size - 1}:
    b = np.arange(100, dtype="i") if rank == root else np.zeros(100, dtype="i")
    comm.Bcast(b, root=root)
    assert np.array_equal(b, np.arange(100))
    comm.Bcast([b, 10, MPI.INT], root=root)
    send = np.full(3, rank, dtype="f8")
    recv = np.empty((size, 3), dtype="f8") if rank == root else None
    comm.Gather(send, recv, root=root)
    if rank == root:
        assert np.array_equal(recv, np.repeat(np.arange(size, dtype="f8"), 3).reshape(size, 3))
    recv = np.zeros((size, 3))
    if rank == root:
        recv[rank] = rank
    comm.Gather(MPI.IN_PLACE if rank == root else send, recv if rank == root else None, root=root)
    if rank == root:
        assert np.array_equal(recv[:, 0], np.arange(size))
    src = np.arange(size * 2, dtype="i8").reshape(size, 2) if rank == root else None
    dst = np.empty(2, dtype="i8")
    comm.Scatter(src, dst, root=root)
    assert list(dst) == [2 * rank, 2 * rank + 1]
    counts = [r + 1 for r in ranks]
    displs = [sum(counts[:r]) for r in ranks]
    vsend = np.full(rank + 1, rank, dtype="i")
    vrecv = np.empty(sum(counts), dtype="i") if rank == root else None
    comm.Gatherv(vsend, [vrecv, counts, displs, MPI.INT] if rank == root else None, root=root)
    if rank == root:
        assert list(vrecv) == [r for r in ranks for _ in range(r + 1)]
    vout = np.empty(rank + 1, dtype="i")
    comm.Scatterv([vrecv, counts, displs, MPI.INT] if rank == root else None, vout, root=root)
    assert (vout == rank).all()
ag = np.empty(size * 2, dtype="i")
comm.Allgather(np.array([rank, -rank], dtype="i"), ag)
assert list(ag) == [v for r in ranks for v in (r, -r)]
ag[:] = 0
ag[2 * rank : 2 * rank + 2] = [rank, rank]
comm.Allgather(MPI.IN_PLACE, ag)
assert list(ag) == [r for r in ranks for _ in range(2)]
counts = [2 if r % 2 else 1 for r in ranks]
agv = np.empty(sum(counts), dtype="f8")
comm.Allgatherv(np.full(counts[rank], rank, dtype="f8"), [agv, counts, None, MPI.DOUBLE])
assert list(agv) == [r for r in ranks for _ in range(counts[r])]
a2a_s = np.array([rank * 100 + i for i in ranks], dtype="i")
a2a_r = np.empty(size, dtype="i")
comm.Alltoall(a2a_s, a2a_r)
assert list(a2a_r) == [i * 100 + rank for i in ranks]
comm.Alltoall(MPI.IN_PLACE, a2a_s)
assert list(a2a_s) == [i * 100 + rank for i in ranks]
scounts = [1] * size
rcounts = [1] * size
comm.Alltoallv(
    [np.arange(size, dtype="d") + rank, scounts, None, MPI.DOUBLE],
    [a := np.empty(size), rcounts, None, MPI.DOUBLE],
)
assert list(a) == [rank + i for i in ranks]
rsb = np.empty(2, dtype="i")
comm.Reduce_scatter_block(np.arange(2 * size, dtype="i"), rsb, op=MPI.SUM)
assert list(rsb) == [size * (2 * rank), size * (2 * rank + 1)]
rs = np.empty(1, dtype="i")
comm.Reduce_scatter(np.arange(size, dtype="i"), rs, recvcounts=[1] * size, op=MPI.SUM)
assert rs[0] == rank * size


# User-defined operation, non-commutative, on buffers and objects.
# Digits written side by side: (value, 10**digits) pairs, associative but not commutative.
def concat_digits(a, b, dt):
    x = np.frombuffer(a, dtype="i8").reshape(-1, 2)
    y = np.frombuffer(b, dtype="i8").reshape(-1, 2)
    y[:, 0] = x[:, 0] * y[:, 1] + y[:, 0]
    y[:, 1] = x[:, 1] * y[:, 1]


myop = MPI.Op.Create(concat_digits, commute=False)
u = np.array([[rank + 1, 10]], dtype="i8")
v = np.empty_like(u)
expect = int("".join(str(r + 1) for r in ranks))
comm.Allreduce(u, v, op=myop)
assert v[0, 0] == expect, (v, expect)
for root in {0, size - 1}:
    comm.Reduce(u, v, op=myop, root=root)
    if rank == root:
        assert v[0, 0] == expect
comm.Scan(u, v, op=myop)
assert v[0, 0] == int("".join(str(r + 1) for r in ranks[: rank + 1]))
concat = MPI.Op.Create(lambda a, b, dt: a + b)
assert comm.allreduce(str(rank), op=concat) == "".join(map(str, ranks))
myop.Free()
t0 = MPI.Wtime()
assert MPI.Wtime() >= t0 and 0 < MPI.Wtick() < 1
comm.Barrier()
if rank == 0:
    print("coll ok", size)
