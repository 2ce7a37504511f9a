"""Workers report progress while rank 0 polls: ``Waitany`` over open receives and ``Iprobe``.

    mpiexec -n 8 python poll.py [ROUNDS]

Each worker computes ROUNDS partial sums and sends each one to rank 0 as soon as it is ready.
Rank 0 keeps one ``Irecv`` open per worker and takes whichever completes first with
``Request.Waitany``; between rounds it also polls with ``Iprobe`` for a worker's "done" note.
The order in which results arrive depends on timing, so rank 0 prints per-worker totals and a
checksum, which do not.
"""

import sys

import numpy as np
from mpi4py import MPI

RESULT, DONE = 1, 2

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 50


def partial(worker, k):
    x = np.arange(1000, dtype=np.float64) + worker * 7 + k
    return float(np.sum(np.sqrt(x)))


def worker():
    for k in range(rounds):
        comm.Send(np.array([partial(rank, k)]), dest=0, tag=RESULT)
    comm.send(rank, dest=0, tag=DONE)


def master():
    totals = {w: 0.0 for w in range(1, size)}
    counts = {w: 0 for w in range(1, size)}
    bufs = {w: np.zeros(1) for w in range(1, size)}
    workers = list(range(1, size))
    reqs = [comm.Irecv(bufs[w], source=w, tag=RESULT) for w in workers]
    remaining = rounds * len(workers)
    done = set()
    polls = 0
    while remaining:
        i = MPI.Request.Waitany(reqs)
        w = workers[i]
        totals[w] += bufs[w][0]
        counts[w] += 1
        remaining -= 1
        if counts[w] < rounds:
            reqs[i] = comm.Irecv(bufs[w], source=w, tag=RESULT)
        else:
            reqs[i] = MPI.REQUEST_NULL
        polls += 1
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=DONE):
            done.add(comm.recv(source=MPI.ANY_SOURCE, tag=DONE))
    while len(done) < len(workers):
        done.add(comm.recv(source=MPI.ANY_SOURCE, tag=DONE))
    for w in workers:
        print(f"worker {w}: {counts[w]} results, total {totals[w]:.6f}")
    print(f"checksum {sum(totals.values()):.6f} after {polls} results")


if size == 1:
    print(f"checksum {sum(partial(0, k) for k in range(rounds)):.6f}")
elif rank == 0:
    master()
else:
    worker()
