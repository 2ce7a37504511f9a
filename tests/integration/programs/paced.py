"""A ring exchange of argv[1] rounds, each after a pause of argv[2] s; every 10 rounds rank 0
prints the ranks' checksum. Its output is deterministic and the job lasts at least rounds *
pause seconds however fast the machine: tests break things while it runs."""

import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()
rounds = int(sys.argv[1])
pause = float(sys.argv[2])

value = rank + 1
for i in range(1, rounds + 1):
    time.sleep(pause)
    got = comm.sendrecv(value, dest=(rank + 1) % size, source=(rank - 1) % size)
    value = (value * 31 + got + i) % 1_000_003
    if i % 10 == 0:
        total = comm.allreduce(value)
        if rank == 0:
            print(f"round {i}: checksum {total}", flush=True)
