"""Point-to-point and collective micro-benchmarks; an unmodified mpi4py program.

Run it under any launcher (vpool's ``vsdk``, MPICH's or Open MPI's ``mpiexec``). Rank 0 prints one
JSON line::

    {"size": p, "rtt": {"8": s, ...}, "bw": {"1048576": MiB/s, ...},
     "allreduce_8d": s, "barrier": s}

Arguments: ``[--quick] [--no-p2p]``. Round trips and streaming run between ranks 0 and 1 (the
other ranks wait at a barrier); ``--no-p2p`` measures only the collectives (e.g. at 4 ranks).
Iteration counts depend only on the message size, so every rank computes the same ones.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
nranks = comm.Get_size()
quick = "--quick" in sys.argv
p2p = "--no-p2p" not in sys.argv and nranks >= 2

KiB, MiB = 1024, 1024 * 1024
if quick:
    RTT_SIZES = [8, 512, 32 * KiB, 2 * MiB, 16 * MiB]
    BW_SIZES = [1 * MiB, 16 * MiB]
    RTT_BYTES, BW_BYTES, COLL_ITERS = 24 * MiB, 96 * MiB, 200
else:
    RTT_SIZES = [8, 32, 128, 512, 2 * KiB, 8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB]
    RTT_SIZES += [8 * MiB, 16 * MiB]
    BW_SIZES = [64 * KiB, 1 * MiB, 16 * MiB]
    RTT_BYTES, BW_BYTES, COLL_ITERS = 128 * MiB, 512 * MiB, 1000


def rtt(size):
    iters = max(3, min(1000 if not quick else 300, RTT_BYTES // (2 * size)))
    buf = np.zeros(size, dtype=np.uint8)
    for n in (max(1, iters // 10), iters):  # warm-up, then measured
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(n):
            if rank == 0:
                comm.Send(buf, dest=1, tag=1)
                comm.Recv(buf, source=1, tag=1)
            elif rank == 1:
                comm.Recv(buf, source=0, tag=1)
                comm.Send(buf, dest=0, tag=1)
        elapsed = MPI.Wtime() - t0
    return elapsed / iters


def bandwidth(size):
    count = max(4, BW_BYTES // size)
    buf = np.ones(size, dtype=np.uint8)
    ack = np.zeros(1, dtype=np.uint8)
    window = max(1, min(64, (64 * MiB) // size))  # outstanding Isends, like osu_bw
    comm.Barrier()
    t0 = MPI.Wtime()
    done = 0
    while done < count:
        k = min(window, count - done)
        if rank == 0:
            MPI.Request.Waitall([comm.Isend(buf, dest=1, tag=2) for _ in range(k)])
        elif rank == 1:
            MPI.Request.Waitall([comm.Irecv(buf, source=0, tag=2) for _ in range(k)])
        done += k
    if rank == 0:
        comm.Recv(ack, source=1, tag=3)
    elif rank == 1:
        comm.Send(ack, dest=0, tag=3)
    return count * size / (MPI.Wtime() - t0) / MiB


def allreduce():
    send = np.arange(8, dtype=np.float64) + rank
    recv = np.empty(8, dtype=np.float64)
    for n in (max(1, COLL_ITERS // 10), COLL_ITERS):
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(n):
            comm.Allreduce(send, recv, op=MPI.SUM)
        elapsed = MPI.Wtime() - t0
    expected = 8 * np.arange(8, dtype=np.float64) / 8 * nranks + nranks * (nranks - 1) / 2
    assert np.allclose(recv, expected), (recv, expected)
    return elapsed / COLL_ITERS


def barrier():
    for n in (max(1, COLL_ITERS // 10), COLL_ITERS):
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(n):
            comm.Barrier()
        elapsed = MPI.Wtime() - t0
    return elapsed / COLL_ITERS


result = {"size": nranks}
if p2p:
    result["rtt"] = {str(s): rtt(s) for s in RTT_SIZES}
    result["bw"] = {str(s): bandwidth(s) for s in BW_SIZES}
result["allreduce_8d"] = allreduce()
result["barrier"] = barrier()
if rank == 0:
    print(json.dumps(result), flush=True)
