"""An iterative computation that survives failed ranks the FT-MPI way: on an error, rebuild
``MPI.COMM_WORLD`` with ``MPI.COMM_WORLD.Dup()`` and go on, whatever the job's failure mode.

    vsdk submit ftmpi_modes.py --ranks 8 --on-failure shrink --wait -- [N] [ITERATIONS]
    python -m vpool.sdk.mpiexec -n 4 --on-failure rebuild -- ftmpi_modes.py 100000 20 --die 2:5

Every iteration sums f(it, j) over j in [0, N), each live rank a contiguous block of j, and
combines the partial sums with ``allreduce``. A failure makes the operations of every survivor
on the world fail (``MPI.ERR_PROC_FAILED``); each then calls ``MPI.COMM_WORLD.Dup()``, which
rebuilds the world as the job's mode says:

- ``blank``: same size, the lost ranks are holes (``allgather`` gives None for them, so the
  program cuts the blocks among the others; ``allreduce`` skips them);
- ``shrink``: the lost ranks are gone and the others renumbered;
- ``rebuild``: a fresh process takes each lost rank's place; it knows it is one because
  ``MPI.Comm.Get_parent()`` is not ``MPI.COMM_NULL``, and joins the recovery with the same
  ``MPI.COMM_WORLD.Dup()``.

A failure may end an iteration at some ranks and not at others, so after a recovery the ranks
agree where to resume: the least iteration completed everywhere, whose running total every
rank that completed it kept (a replacement has none, and takes it from the others). Integer
arithmetic: the total printed does not depend on which ranks died or when.

``--die RANK:ITERATION`` (repeatable) makes world rank RANK kill itself (SIGKILL) as it starts
that iteration, for trying it out (a replacement, which is a fresh process, does not); a pool's
chaos test kills ranks from outside instead. Recoveries are reported on stderr; stdout has only
the final line, from rank 0 of the last world.
"""

import os
import signal
import sys

from mpi4py import MPI


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
    return it, [*[0] * it, total]  # only totals[it] matters from now on


def recover(totals):
    """Rebuild the world and agree where to go on; again if another rank fails meanwhile
    (``Dup`` or the agreement then raises ``ERR_PROC_FAILED``, and calling ``Dup`` again
    recovers from both failures)."""
    while True:
        try:
            comm = MPI.COMM_WORLD.Dup()
            return (comm, *resume(comm, totals))
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_PROC_FAILED:
                raise


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
    world_rank = comm.Get_rank()  # the rank --die names
    totals = [0]  # totals[it]: the running total before iteration it
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:  # a replacement (rebuild): join the recovery
        deaths = set()
        comm, it, totals = recover([])
        print(f"rank {comm.Get_rank()}: replacement started", file=sys.stderr)
    it = len(totals) - 1
    while it < iterations:
        if (world_rank, it) in deaths:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            live = live_ranks(comm)
            me, size = live.index(comm.Get_rank()), len(live)
            step = comm.allreduce(block_sum(it, n * me // size, n * (me + 1) // size))
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_PROC_FAILED:
                raise
            before, failed_at = comm.Get_size(), it
            comm, it, totals = recover(totals)
            print(
                f"rank {comm.Get_rank()}: iteration {failed_at} failed, world rebuilt with "
                f"{comm.Get_size()} ranks (was {before}), going on from iteration {it}",
                file=sys.stderr,
            )
            continue
        totals.append(totals[it] + step)
        it += 1
    if comm.Get_rank() == min(live_ranks(comm)):
        print(f"ftmpi_modes: n={n} iterations={iterations} total={totals[iterations]}")


if __name__ == "__main__":
    main(sys.argv[1:])
