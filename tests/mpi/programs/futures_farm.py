"""mpi4py.futures task farms. ``comm``: MPICommExecutor on COMM_WORLD, run as a program;
``pool``: MPIPoolExecutor, run as ``-m mpi4py.futures futures_farm.py pool`` (the other ranks
are the shared pool's workers); ``spawn``: MPIPoolExecutor(max_workers=3) run as a program on one
rank, whose workers are spawned. Rank 0 prints what the tasks gave back; the workers print
nothing."""

import sys

from mpi4py import MPI
from mpi4py.futures import (
    FIRST_EXCEPTION,
    MPICommExecutor,
    MPIPoolExecutor,
    as_completed,
    get_comm_workers,
    wait,
)
from mpi4py.futures.aplus import ThenableFuture


def square(x):
    return x * x


def where(_):
    return MPI.COMM_WORLD.Get_rank()


def workers():
    return get_comm_workers().Get_size()


def fail(x):
    raise ValueError(f"bad {x}")


def farm(executor, spawned=False):
    world = MPI.COMM_WORLD.Get_size()
    print("map", list(executor.map(square, range(12))))
    print("chunks", sum(executor.map(square, range(100), chunksize=7)))
    print("unordered", sorted(executor.map(square, range(10), unordered=True)))
    fs = [executor.submit(pow, 2, i) for i in range(16)]
    print("as_completed", sorted(f.result() for f in as_completed(fs)))
    done, _ = wait([executor.submit(fail, 1), *fs], return_when=FIRST_EXCEPTION)
    print("wait", len(done) >= 1)
    ranks = set(executor.map(where, range(4 * world)))
    if spawned:  # the workers' own COMM_WORLD
        print("ranks", ranks <= set(range(executor.num_workers)))
    else:
        print("ranks", ranks <= (set(range(1, world)) if world > 1 else {0}))
    print("workers", executor.submit(workers).result(), executor.num_workers)
    error = executor.submit(fail, 3).exception()
    print("error", type(error).__name__, error, type(error.__cause__).__name__)
    base = ThenableFuture()
    chained = base.then(lambda x: x + 1)
    base.set_result(41)
    print("then", chained.result())


def main(mode):
    if mode == "comm":
        with MPICommExecutor(MPI.COMM_WORLD, root=0) as executor:
            if executor is not None:
                farm(executor)
    elif mode == "pool":
        with MPIPoolExecutor() as executor:
            farm(executor)
    else:
        with MPIPoolExecutor(max_workers=3) as executor:
            farm(executor, spawned=True)


if __name__ == "__main__":
    main(sys.argv[1])
