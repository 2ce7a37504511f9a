"""Distributed statistics with numpy buffers: Bcast, Allreduce, Gather.

    mpiexec -n 8 python stats.py [SAMPLES_PER_RANK]

Rank 0 broadcasts the parameters; each rank makes its share of a deterministic data set, the
sums are combined with Allreduce (integers, so exact whatever the reduction order) and each
rank's own sum is gathered to rank 0, which prints the result.
"""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

params = np.zeros(2, dtype=np.int64)
if rank == 0:
    params[:] = [int(sys.argv[1]) if len(sys.argv) > 1 else 10_000, 1009]
comm.Bcast(params, root=0)
per_rank, modulus = int(params[0]), int(params[1])

# Sample k of the whole data set is (k * k) % modulus; rank r holds k in [r*per_rank, ...).
k = np.arange(rank * per_rank, (rank + 1) * per_rank, dtype=np.int64)
data = (k * k) % modulus

local = np.array([data.size, data.sum(), (data * data).sum()], dtype=np.int64)
total = np.zeros(3, dtype=np.int64)
comm.Allreduce(local, total, op=MPI.SUM)

sums = np.zeros(size, dtype=np.int64) if rank == 0 else None
comm.Gather(local[1:2], sums, root=0)

count, s1, s2 = (int(v) for v in total)
mean = s1 / count
var = s2 / count - mean * mean
if rank == 0:
    print(f"{count} samples on {size} ranks")
    print(f"sum {s1}, sum of squares {s2}")
    print(f"mean {mean:.6f}, variance {var:.6f}")
    print(f"sum per rank: {sums.tolist()}")
