"""Collective algorithms at any size: binomial gather/scatter, recursive-doubling allgather with
the non-power-of-two fold, pipelined (segmented) bcast/reduce/allreduce, rank-order reductions
with a non-commutative user op, IN_PLACE and None as IN_PLACE, and non-blocking collectives
overlapping each other and blocking ones."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

# Objects: every root, binomial trees and recursive doubling.
for root in range(size):
    assert comm.gather(("g", rank), root=root) == (
        [("g", r) for r in range(size)] if rank == root else None
    )
    items = [{"to": r} for r in range(size)] if rank == root else None
    assert comm.scatter(items, root=root) == {"to": rank}
    assert comm.bcast([root] * 3 if rank == root else None, root=root) == [root] * 3
assert comm.allgather(rank * 10) == [r * 10 for r in range(size)]
assert comm.allreduce(rank, MPI.SUM) == size * (size - 1) // 2


# Non-commutative user op: operands strictly in rank order.
def concat(a, b, dt):
    if dt is None:
        return a + b
    raise AssertionError("object op only")


cat = MPI.Op.Create(concat, commute=False)
expect = "".join(chr(65 + r) for r in range(size))
assert comm.allreduce(chr(65 + rank), cat) == expect
for root in range(size):
    got = comm.reduce(chr(65 + rank), cat, root=root)
    assert got == (expect if rank == root else None), got
assert comm.scan(chr(65 + rank), cat) == expect[: rank + 1]
cat.Free()

# Buffers: gather/scatter/allgather in place and not, every root.
for root in range(size):
    buf = np.full((size, 3), -1, dtype="i")
    if rank == root:
        buf[root] = root * 100 + root
        comm.Gather(MPI.IN_PLACE, buf, root=root)
        assert (buf == (np.arange(size)[:, None] + root * 100)).all()
        comm.Gather(None, buf, root=root)  # None at the root is IN_PLACE (mpi4py)
    else:
        mine = np.full(3, root * 100 + rank, dtype="i")
        comm.Gather(mine, None, root=root)
        comm.Gather(mine, None, root=root)
    src = np.arange(size * 2, dtype="d").reshape(size, 2) if rank == root else None
    out = np.zeros(2, dtype="d")
    comm.Scatter(src, out, root=root)
    assert (out == [2 * rank, 2 * rank + 1]).all()
whole = np.full((size, 2), -1, dtype="l")
whole[rank] = rank
comm.Allgather(MPI.IN_PLACE, whole)
assert (whole == np.arange(size)[:, None]).all()
counts = [r + 1 for r in range(size)]
vbuf = np.zeros(sum(counts), dtype="i")
comm.Allgatherv(np.full(rank + 1, rank, dtype="i"), [vbuf, counts])
assert (vbuf == np.repeat(np.arange(size), counts)).all()

# Large payloads take the segmented pipeline (several 1 MiB segments, a ragged last one).
n = (3 << 20) // 8 + 123
big = np.arange(n, dtype="d") if rank == size - 1 else np.zeros(n)
comm.Bcast(big, root=size - 1)
assert big[-1] == n - 1 and big[7] == 7
red = np.empty(n)
comm.Reduce(np.full(n, rank + 1.0), red if rank == 0 else None, MPI.SUM, root=0)
if rank == 0:
    assert (red == size * (size + 1) / 2).all()
m = (5 << 20) // 4
acc = np.full(m, rank, dtype="i")
comm.Allreduce(MPI.IN_PLACE, acc, MPI.MAX)
assert (acc == size - 1).all()

# Non-blocking: several in flight at once, completed out of order, with a blocking one between.
b1 = np.array([rank], dtype="i")
r1 = comm.Iallreduce(MPI.IN_PLACE, b1, MPI.SUM)
b2 = np.array([rank if rank == 0 else -1], dtype="i")
r2 = comm.Ibcast(b2, root=0)
rb = comm.Ibarrier()
assert comm.allreduce(1) == size
MPI.Request.Waitall([rb, r2])
r1.Wait()
assert b1[0] == size * (size - 1) // 2 and b2[0] == 0
out = np.zeros(1, dtype="i")
req = comm.Ireduce(np.array([rank], dtype="i"), out, MPI.MAX, root=size - 1)
while not req.Test():
    pass
assert rank != size - 1 or out[0] == size - 1

if rank == 0:
    print(f"coll conformance ok {size}")
