"""examples/ftmpi_modes.py with timestamps, for benchmarks/ftmpi_recovery.py.

    vsdk submit ftmpi_timed.py --ranks 4 --on-failure shrink --wait -- N ITERATIONS [--die R:K]

The same computation, recovery and final line on stdout as the example (read its docstring);
on stderr, one machine-readable line per moment the benchmark measures, ``time.time()`` of
this machine (the pool's coordinator stamps its events with the same clock):

- ``ftmpi_timed died rank=R time=T``: rank R, as it kills itself (``--die``);
- ``ftmpi_timed noticed rank=R time=T``: a survivor's operation on the world failed with
  ``MPI.ERR_PROC_FAILED`` (R: its rank in the world it had);
- ``ftmpi_timed rebuilt rank=R time=T``: the survivor left ``MPI.COMM_WORLD.Dup()`` (R: its
  rank in the new world);
- ``ftmpi_timed replacement rank=R started=T0 time=T``: a replacement (rebuild mode) began
  at T0 (module import) and joined the rebuilt world at T.
"""

import time

STARTED = time.time()

import os  # noqa: E402 (after the first clock reading: a replacement's start)
import signal  # noqa: E402
import sys  # noqa: E402

from mpi4py import MPI  # noqa: E402


def f(it, j):
    return (j * 2654435761 + it * 40503 + (j ^ it)) % 1_000_003


def block_sum(it, lo, hi):
    return sum(f(it, j) for j in range(lo, hi))


def live_ranks(comm):
    """The ranks of ``comm`` that are not holes (all of them but in blank mode)."""
    return [r for r, here in enumerate(comm.allgather(1)) if here]


def resume(comm, totals):
    """Where to go on after a recovery: the least iteration every rank completed, and the
    running total up to it (``totals[it]``: the total before iteration ``it``)."""
    it = comm.allreduce(len(totals) - 1 if totals else sys.maxsize, op=MPI.MIN)
    total = comm.allreduce(totals[it] if totals else -1, op=MPI.MAX)
    return it, [*[0] * it, total]


def stamp(what, **fields):
    words = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"ftmpi_timed {what} {words} time={time.time():.6f}", file=sys.stderr, flush=True)


def parse(argv):
    args, deaths = [], set()
    i = 0
    while i < len(argv):
        if argv[i] == "--die":
            rank, it = argv[i + 1].split(":")
            deaths.add((int(rank), int(it)))
            i += 2
        else:
            args.append(argv[i])
            i += 1
    n = int(args[0]) if args else 100_000
    iterations = int(args[1]) if len(args) > 1 else 20
    return n, iterations, deaths


def main(argv):
    n, iterations, deaths = parse(argv)
    comm = MPI.COMM_WORLD
    world_rank = comm.Get_rank()
    totals = [0]
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:  # a replacement (rebuild): join the recovery
        deaths = set()
        comm = MPI.COMM_WORLD.Dup()
        stamp("replacement", rank=comm.Get_rank(), started=f"{STARTED:.6f}")
        it, totals = resume(comm, [])
    it = len(totals) - 1
    while it < iterations:
        if (world_rank, it) in deaths:
            sys.stdout.flush()
            stamp("died", rank=world_rank)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            live = live_ranks(comm)
            me, size = live.index(comm.Get_rank()), len(live)
            step = comm.allreduce(block_sum(it, n * me // size, n * (me + 1) // size))
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_PROC_FAILED:
                raise
            stamp("noticed", rank=comm.Get_rank())
            comm = MPI.COMM_WORLD.Dup()
            stamp("rebuilt", rank=comm.Get_rank())
            it, totals = resume(comm, totals)
            continue
        totals.append(totals[it] + step)
        it += 1
    if comm.Get_rank() == min(live_ranks(comm)):
        print(f"ftmpi_modes: n={n} iterations={iterations} total={totals[iterations]}")


if __name__ == "__main__":
    main(sys.argv[1:])
