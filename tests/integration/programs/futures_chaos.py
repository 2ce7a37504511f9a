"""A mpi4py.futures farm for the chaos tests (tests/integration/test_futures_chaos.py): an
MPIPoolExecutor whose workers are spawned (asked of the pool) computes N tasks of about
``pause`` seconds each; rank 0 checks every task id came back exactly once with its value and
prints the answer, then (with ``--report``) how many tasks were re-dispatched. With
``--trickle`` the main thread submits the tasks one by one, 20 ms apart, so when the manager
thread finds its queue empty is timing (a replaying master must see it as the logged run did).

    python futures_chaos.py N WORKERS PAUSE [--report] [--trickle]
"""

import sys
import time

from mpi4py.futures import MPIPoolExecutor


def work(i, pause):
    time.sleep(pause)
    return i, (i * i + 7 * i) % 1009


def main():
    n, workers, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    with MPIPoolExecutor(max_workers=workers, grow_interval=0.5) as ex:
        if "--trickle" in sys.argv:
            futures = []
            for i in range(n):
                futures.append(ex.submit(work, i, pause))
                time.sleep(0.02)
            results = [f.result() for f in futures]
        else:
            results = list(ex.map(work, range(n), [pause] * n))
    ids = sorted(i for i, _ in results)
    print("ids once", ids == list(range(n)))
    print("values", all(v == (i * i + 7 * i) % 1009 for i, v in results))
    print("answer", sum(v for _, v in results))
    if "--report" in sys.argv:
        print("redispatched", ex.redispatched, "lost", ex.workers_lost)


if __name__ == "__main__":
    main()
