"""mpi4py.futures with workers that SIGKILL themselves (vpool's re-dispatch and elasticity).

``python futures_lost.py MODE DIR``, spawn form unless said (DIR: a directory for marker files):

- ``once``: 20 tasks, task 7 kills its worker the first time it runs: the answer is still
  right, the task was re-dispatched once;
- ``always``: task 3 kills every worker it runs on: its future gets WorkerLost after the
  default retries (3), the other tasks complete;
- ``grow``: a worker is lost, num_workers drops, then the pool asks for another and grows
  back to its maximum (run with ``--universe 3``: two workers);
- ``comm``: MPICommExecutor (run with ``--on-failure ulfm`` on 4 ranks), task 5 kills its
  worker once;
- ``all``: MPICommExecutor, every task kills its worker: once they are all lost the futures
  fail with BrokenExecutor.

Rank 0 prints the outcome; the stderr of the run has the re-dispatch line."""

import os
import signal
import sys
import time
from pathlib import Path

from mpi4py import MPI
from mpi4py.futures import BrokenExecutor, MPICommExecutor, MPIPoolExecutor, WorkerLost


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def task(x, kill, marker):
    if x == kill:
        mark = Path(marker)
        if not mark.exists():
            mark.write_text("x")
            die()
    return x * x


def doomed(x):
    if x == 3:
        die()
    return x * x


def always_die(x):
    die()


def where(x):
    return x, MPI.COMM_WORLD.Get_rank()


def run_once(executor, kill, marker, n=20):
    fs = [executor.submit(task, x, kill, marker) for x in range(n)]
    got = [f.result() for f in fs]
    print("answer", got == [x * x for x in range(n)])


def main(mode, dirpath):
    marker = os.path.join(dirpath, f"{mode}.killed")
    if mode == "once":
        with MPIPoolExecutor(max_workers=3) as ex:
            run_once(ex, 7, marker)
        print("redispatched", ex.redispatched, "lost", ex.workers_lost)
    elif mode == "always":
        with MPIPoolExecutor(max_workers=4, grow_interval=3600) as ex:
            fs = [ex.submit(doomed, x) for x in range(8)]
            for x, f in enumerate(fs):
                exc = f.exception()
                if exc is None:
                    print(x, f.result())
                else:
                    both = isinstance(exc, WorkerLost) and isinstance(exc, BrokenExecutor)
                    print(x, type(exc).__name__, both, exc.tries)
                    print("names", "worker" in str(exc) and f"retries={exc.tries - 1}" in str(exc))
        print("redispatched", ex.redispatched, "lost", ex.workers_lost)
    elif mode == "grow":
        with MPIPoolExecutor(grow_interval=0.2) as ex:
            before = ex.num_workers
            ex.submit(task, 1, 1, marker).exception()  # its worker dies: re-dispatched
            # Tasks waiting make the pool grow back: wait for it, with a deadline.
            deadline = time.monotonic() + 60
            while ex.num_workers < before and time.monotonic() < deadline:
                list(ex.map(abs, range(-20, 0)))
            print("workers", before, ex.num_workers, "lost", ex.workers_lost)
    elif mode in ("comm", "all"):
        with MPICommExecutor(MPI.COMM_WORLD, root=0) as ex:
            if ex is not None:
                if mode == "comm":
                    run_once(ex, 5, marker)
                    print("redispatched", ex.redispatched, "lost", ex.workers_lost)
                else:
                    fs = [ex.submit(always_die, x) for x in range(6)]
                    kinds = {type(f.exception()).__name__ for f in fs}
                    print("kinds", sorted(kinds))
                    try:
                        ex.submit(abs, 1)
                    except BrokenExecutor as exc:
                        print("broken", exc)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
