"""A CPU-busy MPI program for ``benchmarks/suspend_costs.py``; an unmodified mpi4py program.

    busy.py [STEPS] [WORK]

Each rank spins a pure-Python loop of WORK iterations (default 200,000: some tens of
milliseconds of CPU), then takes part in an ``allreduce``; STEPS times (default 50,000: far
longer than the benchmark, which cancels the job, yet a bound). Rank 0 prints a line every 100
steps. The number of steps is the only thing that ends it, so every rank stops at the same one,
whatever was frozen, checkpointed or restored on the way.
"""

import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
work = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000

x = rank + 1
for step in range(1, steps + 1):
    for i in range(work):
        x = (x * 1103515245 + 12345 + i) & 0xFFFFFFFF
    total = comm.allreduce(x & 0xFF, op=MPI.SUM)
    if rank == 0 and step % 100 == 0:
        print(f"step {step}: {total}", flush=True)
if rank == 0:
    print(f"done: {steps} steps")
