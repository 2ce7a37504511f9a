"""Master-worker task farm: rank 0 hands out tasks, workers compute and reply.

    mpiexec -n 8 python farm.py [TASKS]

The master keeps every worker busy: it receives replies with ANY_SOURCE and a Status, and sends
the next task to whichever worker answered. Which worker does which task depends on timing, so
the results are printed sorted by task: the output is deterministic.

A task n is "how many Collatz steps does n take to reach 1".
"""

import sys

from mpi4py import MPI

TASK, STOP = 1, 2

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()
ntasks = int(sys.argv[1]) if len(sys.argv) > 1 else 40


def collatz_steps(n):
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def master():
    tasks = list(range(1, ntasks + 1))
    results = {}
    if size == 1:
        return {n: collatz_steps(n) for n in tasks}
    busy = 0
    for worker in range(1, size):
        if tasks:
            comm.send(tasks.pop(0), dest=worker, tag=TASK)
            busy += 1
        else:
            comm.send(None, dest=worker, tag=STOP)
    status = MPI.Status()
    while busy:
        n, steps = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
        results[n] = steps
        worker = status.Get_source()
        if tasks:
            comm.send(tasks.pop(0), dest=worker, tag=TASK)
        else:
            comm.send(None, dest=worker, tag=STOP)
            busy -= 1
    return results


def worker():
    status = MPI.Status()
    while True:
        n = comm.recv(source=0, tag=MPI.ANY_TAG, status=status)
        if status.Get_tag() == STOP:
            return
        comm.send((n, collatz_steps(n)), dest=0, tag=TASK)


if rank == 0:
    results = master()
    print(f"{len(results)} tasks done by {max(size - 1, 1)} worker(s)")
    for n in sorted(results):
        print(f"collatz({n}) = {results[n]} steps")
    best = max(sorted(results), key=lambda k: results[k])
    print(f"longest: {best} with {results[best]} steps")
else:
    worker()
