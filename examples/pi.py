"""Pi by the midpoint rule, split over the ranks (the classic MPI first program).

    mpiexec -n 8 python pi.py [INTERVALS]
    vsdk submit pi.py --ranks 8 --wait -- [INTERVALS]

Rank r sums the intervals r, r + size, r + 2*size, ...; the partial sums are reduced to rank 0,
which prints pi with 12 digits and the error. Each partial sum is computed with math.fsum, so
the printed result does not depend on the order in which MPI combines them.
"""

import math
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
if n < 1:
    if rank == 0:
        print("usage: pi.py [INTERVALS >= 1]", file=sys.stderr)
    sys.exit(2)

h = 1.0 / n
partial = h * math.fsum(4.0 / (1.0 + ((i + 0.5) * h) ** 2) for i in range(rank, n, size))
pi = comm.reduce(partial, op=MPI.SUM, root=0)

if rank == 0:
    print(f"pi is approximately {pi:.12f}, error {abs(pi - math.pi):.0e}")
    print(f"({n} intervals over {size} ranks)")
