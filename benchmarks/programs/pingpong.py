"""Round trip and streaming bandwidth between ranks 0 and 1; an unmodified mpi4py program.

Prints one JSON line from rank 0: {"rtt_64": s, "rtt_1m": s, "bw_mib": MiB/s}. Arguments:
[iterations_small iterations_large stream_messages].
"""

import json
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
small_iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
large_iters = int(sys.argv[2]) if len(sys.argv) > 2 else 50
stream_n = int(sys.argv[3]) if len(sys.argv) > 3 else 200


def rtt(size, iters):
    buf = np.zeros(size, dtype=np.uint8)
    comm.Barrier()
    for _ in range(max(1, iters // 10)):  # warm-up
        if rank == 0:
            comm.Send(buf, dest=1, tag=1)
            comm.Recv(buf, source=1, tag=1)
        elif rank == 1:
            comm.Recv(buf, source=0, tag=1)
            comm.Send(buf, dest=0, tag=1)
    comm.Barrier()
    t0 = MPI.Wtime()
    for _ in range(iters):
        if rank == 0:
            comm.Send(buf, dest=1, tag=1)
            comm.Recv(buf, source=1, tag=1)
        elif rank == 1:
            comm.Recv(buf, source=0, tag=1)
            comm.Send(buf, dest=0, tag=1)
    return (MPI.Wtime() - t0) / iters


def bandwidth(size, count):
    buf = np.ones(size, dtype=np.uint8)
    ack = np.zeros(1, dtype=np.uint8)
    comm.Barrier()
    t0 = MPI.Wtime()
    if rank == 0:
        reqs = [comm.Isend(buf, dest=1, tag=2) for _ in range(count)]
        MPI.Request.Waitall(reqs)
        comm.Recv(ack, source=1, tag=3)
    elif rank == 1:
        for _ in range(count):
            comm.Recv(buf, source=0, tag=2)
        comm.Send(ack, dest=0, tag=3)
    return count * size / (MPI.Wtime() - t0) / 2**20


result = {
    "rtt_64": rtt(64, small_iters),
    "rtt_1m": rtt(2**20, large_iters),
    "bw_mib": bandwidth(2**20, stream_n),
}
if rank == 0:
    print(json.dumps(result), flush=True)
