"""A farm of small tasks with mpi4py.futures, for benchmarks/futures_farm.py.

    python -m mpi4py.futures futures_tasks.py N            (the other ranks are the workers)
    python futures_tasks.py N --spawn W                     (MPIPoolExecutor spawns W workers)

Each task is a few thousand integer operations (about 50 us of CPU). Rank 0 submits N of them,
waits for every result and prints one JSON line: how many results, a checksum over them (which
says every task id came back exactly once with its value), the tasks per second between the
first submission and the last result (workers already started: one task is run on each first),
and, on vpool, the tasks re-dispatched after lost workers (``executor.redispatched``).
"""

import json
import sys
import time

from mpi4py.futures import MPIPoolExecutor, as_completed


def task(i):
    s = 0
    for k in range(100):
        s += (i * 2654435761 + k * 40503) % 1000003
    return i, s


def expected(n):
    return sum(i * 7919 + task(i)[1] for i in range(n))


def main(argv):
    n = int(argv[0])
    spawn = int(argv[argv.index("--spawn") + 1]) if "--spawn" in argv else None
    executor = MPIPoolExecutor(max_workers=spawn) if spawn else MPIPoolExecutor()
    with executor:
        warm = [executor.submit(task, -1) for _ in range(executor.num_workers or 1)]
        for f in warm:
            f.result()
        start = time.perf_counter()
        futures = [executor.submit(task, i) for i in range(n)]
        got = {}
        for f in as_completed(futures):
            i, s = f.result()
            got[i] = got.get(i, 0) + s
        seconds = time.perf_counter() - start
        redispatched = getattr(executor, "redispatched", 0)
    checksum = sum(i * 7919 + s for i, s in got.items())
    report = {
        "tasks": len(got),
        "right": len(got) == n and checksum == expected(n),
        "seconds": seconds,
        "tasks_per_s": n / seconds,
        "redispatched": redispatched,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
