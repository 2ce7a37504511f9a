"""FT-MPI's modes (--on-failure blank|shrink|rebuild): the last world rank SIGKILLs itself and
the others check, each in its scenario, what the failure does and what ``MPI.COMM_WORLD.Dup()``
rebuilds. Every surviving rank prints ``SCENARIO ok RANK FACTS...``; the facts must be the
same everywhere (the test compares them), and ``RANK`` is the rank in the rebuilt world.

- ``detected``: rank 0 waits for a message from rank 1, which never sends it (rank 1 waits for
  the dying rank): rank 0's receive fails too, as does a later send on a communicator made
  before the failure; both recover.
- ``world``: after the recovery, what the world looks like: its size, the ranks, a ring of
  point-to-point messages over the live ranks, a collective; in blank mode a send to the hole
  raises at once; in rebuild mode the replacement (which prints ``replacement``) takes part.
- ``twice``: two failures one after the other (the last two ranks), two recoveries.
- ``during``: the second failure comes as the survivors start recovering from the first:
  ``Dup`` raises ``ERR_PROC_FAILED`` where it interrupts the recovery, and called again it
  recovers from both.
- ``spawn`` (rebuild mode): an ordinary ``Spawn`` still works; its child is no replacement.
"""

import os
import signal
import sys

from mpi4py import MPI

MODE = os.environ.get("FTMPI_MODE", "")


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def die_when_all_pass(comm, victim: int) -> None:
    """Rank ``victim`` of ``comm`` dies once every other rank has got this far (so that its
    death cannot fail a collective the others are still finishing); the others go on."""
    others = [r for r in live(comm) if r != victim]
    if comm.Get_rank() == victim:
        for r in others:
            comm.recv(source=r, tag=11)
        die()
    comm.send(None, dest=victim, tag=11)


def failed(fn) -> bool:
    try:
        fn()
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_PROC_FAILED, exc
        return True
    return False


def live(comm) -> list:
    return [r for r, x in enumerate(comm.allgather(1)) if x]


def ring(comm, ranks) -> int:
    """Pass a token around the live ranks, each adding its rank + 1; what came back to the
    first, told to all."""
    me = ranks.index(comm.Get_rank())
    nxt, prv = ranks[(me + 1) % len(ranks)], ranks[me - 1]
    token = None
    if me == 0:
        comm.send(comm.Get_rank() + 1, dest=nxt, tag=7)
        token = comm.recv(source=prv, tag=7)
    else:
        comm.send(comm.recv(source=prv, tag=7) + comm.Get_rank() + 1, dest=nxt, tag=7)
    return comm.bcast(token, root=ranks[0])


def facts(comm) -> str:
    """What every rank sees of the rebuilt world."""
    size = comm.Get_size()
    ranks = live(comm)
    total = comm.allreduce(comm.Get_rank())
    token = ring(comm, ranks)
    first = ranks[0]
    hole = ""
    if len(ranks) < size:
        missing = next(r for r in range(size) if r not in ranks)
        hole = f" hole={missing} send_raises={failed(lambda: comm.send(1, dest=missing))}"
    return f"size={size} live={ranks} sum={total} ring={token} first={first}{hole}"


def recover():
    """``MPI.COMM_WORLD.Dup()`` until no failure interrupts it."""
    while True:
        try:
            return MPI.COMM_WORLD.Dup()
        except MPI.Exception as exc:
            assert exc.Get_error_class() == MPI.ERR_PROC_FAILED, exc


def replacement() -> None:
    scenario = sys.argv[1]
    comm = recover() if scenario == "during" else MPI.COMM_WORLD.Dup()
    if scenario == "twice" and comm.Get_rank() == comm.Get_size() - 1:
        # The first failure's replacement: the other dying rank goes after the first facts.
        print(f"{scenario} first {comm.Get_rank()} {facts(comm)}", flush=True)
        die_when_all_pass(comm, comm.Get_size() - 2)
        if failed(lambda: comm.recv(source=comm.Get_size() - 2, tag=99)):
            comm = MPI.COMM_WORLD.Dup()
    print(f"{scenario} ok {comm.Get_rank()} replacement {facts(comm)}", flush=True)


def main(scenario: str) -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    sub = world.Dup()  # made before the failure: stays broken after it
    if scenario == "detected":
        die_when_all_pass(world, size - 1)
        if rank == 0:
            got = failed(lambda: world.recv(source=1, tag=5))
        elif rank == 1:
            got = failed(lambda: world.recv(source=size - 1, tag=5))
        else:
            got = failed(lambda: world.recv(source=size - 1, tag=5))
        assert got
        later = failed(lambda: sub.send(1, dest=(rank + 1) % (size - 1), tag=6))
        comm = MPI.COMM_WORLD.Dup()
        print(f"{scenario} ok {comm.Get_rank()} later={later} {facts(comm)}", flush=True)
    elif scenario == "world":
        die_when_all_pass(world, size - 1)
        assert failed(lambda: world.barrier())
        comm = MPI.COMM_WORLD.Dup()
        same = MPI.COMM_WORLD.Get_size() == comm.Get_size()
        print(f"{scenario} ok {comm.Get_rank()} world_is_rebuilt={same} {facts(comm)}")
    elif scenario == "twice":
        die_when_all_pass(world, size - 1)
        assert failed(lambda: world.barrier())
        comm = MPI.COMM_WORLD.Dup()
        print(f"{scenario} first {comm.Get_rank()} {facts(comm)}", flush=True)
        die_when_all_pass(comm, size - 2)
        assert failed(lambda: comm.recv(source=MPI.ANY_SOURCE, tag=99))
        comm = MPI.COMM_WORLD.Dup()
        print(f"{scenario} ok {comm.Get_rank()} {facts(comm)}", flush=True)
    elif scenario == "during":
        die_when_all_pass(world, size - 1)
        assert failed(lambda: world.barrier())
        if rank == size - 2:
            die()  # as the others start their recovery
        comm = recover()
        print(f"{scenario} ok {comm.Get_rank()} {facts(comm)}", flush=True)
    elif scenario == "spawn":
        child = world.Spawn(sys.executable, [__file__, "child"], maxprocs=1)
        answer = world.bcast(child.recv(source=0, tag=3) if rank == 0 else None)
        child.Disconnect()
        print(f"{scenario} ok {rank} child={answer}", flush=True)
    elif scenario == "child":
        parent = MPI.Comm.Get_parent()
        if parent.Get_rank() == 0:
            parent.send(f"size{MPI.COMM_WORLD.Get_size()}", dest=0, tag=3)
        parent.Disconnect()
    else:
        raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "child" and MPI.Comm.Get_parent() != MPI.COMM_NULL:
        replacement()
    else:
        main(sys.argv[1])
