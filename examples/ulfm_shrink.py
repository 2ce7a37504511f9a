"""An iterative computation that survives failed ranks the ULFM way: revoke, agree, shrink,
redistribute the work, go on (in the style of ULFM's examples).

    vsdk submit ulfm_shrink.py --ranks 8 --on-failure ulfm --wait -- [N] [ITERATIONS]
    python -m vpool.sdk.mpiexec -n 4 --on-failure ulfm -- ulfm_shrink.py 100000 20 --die 2:5

Every iteration sums f(it, j) over j in [0, N), each rank a contiguous block of j. The partial
sums are combined with ``allreduce``; then the ranks agree (``Iagree``, fault tolerant) whether
the iteration succeeded everywhere. A rank that saw a failure (``ERR_PROC_FAILED``) revokes the
communicator, so that ranks waiting in it stop waiting; the agreement then says 0, everyone
acknowledges the failures, shrinks the communicator to the survivors and does the iteration
again over them (the blocks are cut anew). Integer arithmetic: the total printed at the end does
not depend on how many ranks took part or which died, as long as one survives.

``--die RANK:ITERATION`` (repeatable) makes world rank RANK kill itself (SIGKILL) as it starts
that iteration, for trying it out; a pool's chaos test kills ranks from outside instead.
Recoveries are reported on stderr; stdout has only the final line, from rank 0 of the last
communicator.
"""

import os
import signal
import sys
from array import array

from mpi4py import MPI


def f(it, j):
    return (j * 2654435761 + it * 40503 + (j ^ it)) % 1_000_003


def block_sum(it, lo, hi):
    return sum(f(it, j) for j in range(lo, hi))


def agree(comm, flag):
    """The AND of ``flag`` over the survivors; the value is agreed even when the call reports
    a failure not acknowledged yet (ERR_PROC_FAILED), which the caller then handles."""
    buf = array("i", [flag])
    try:
        comm.Iagree(buf).Wait()
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_PROC_FAILED:
            raise
    return buf[0]


def main(argv):
    args = [a for a in argv if not a.startswith("--die")]
    deaths = set()
    for i, a in enumerate(argv):
        if a == "--die":
            rank, it = argv[i + 1].split(":")
            deaths.add((int(rank), int(it)))
            args.remove(argv[i + 1])
    n = int(args[0]) if args else 100_000
    iterations = int(args[1]) if len(args) > 1 else 20
    world_rank = MPI.COMM_WORLD.Get_rank()
    comm = MPI.COMM_WORLD
    total = 0
    it = 0
    while it < iterations:
        if (world_rank, it) in deaths:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        size, rank = comm.Get_size(), comm.Get_rank()
        lo, hi = n * rank // size, n * (rank + 1) // size
        ok = 1
        try:
            step = comm.allreduce(block_sum(it, lo, hi))
        except MPI.Exception as exc:
            if exc.Get_error_class() not in (MPI.ERR_PROC_FAILED, MPI.ERR_REVOKED):
                raise
            ok = 0
            comm.Revoke()  # the others may be waiting in the allreduce: stop them
        if agree(comm, ok):
            total += step
            it += 1
            continue
        comm.Ack_failed()
        shrunk = comm.Shrink()
        print(
            f"rank {world_rank}: iteration {it} failed, going on with "
            f"{shrunk.Get_size()} of {comm.Get_size()} ranks",
            file=sys.stderr,
        )
        comm = shrunk
    if comm.Get_rank() == 0:
        print(f"ulfm_shrink: n={n} iterations={iterations} total={total}")


if __name__ == "__main__":
    main(sys.argv[1:])
