"""MPI.Comm.Spawn end to end (``tests/mpi/test_spawn.py``): run under ``vsdk mpiexec --universe
7 -n N``; rank 0 of the parents prints ``spawn ok N``. The same file is the workers' program
(``worker`` and ``echo`` modes), so each part knows what the other does.

Parents: Get_parent is COMM_NULL, UNIVERSE_SIZE and APPNUM; COMM_WORLD spawns 3 workers (a spawn
by an N-rank communicator) and talks to them over the intercommunicator: point-to-point both
ways, a bcast with MPI.ROOT, Merge, Disconnect; then two spawns in a row from COMM_SELF (distinct
contexts, both alive at once); then a command that is not a Python program: ERR_SPAWN at every
member of COMM_WORLD, errcodes filled.
"""

import sys

from mpi4py import MPI

UNIVERSE = 7
WORKERS = 3


def worker() -> None:
    world = MPI.COMM_WORLD
    parent = MPI.Comm.Get_parent()
    assert parent != MPI.COMM_NULL and parent.Is_inter()
    assert world.Get_size() == WORKERS, world.Get_size()
    assert parent.Get_size() == WORKERS and parent.Get_rank() == world.Get_rank()
    nparents = parent.Get_remote_size()
    assert world.Get_attr(MPI.UNIVERSE_SIZE) == UNIVERSE
    assert world.Get_attr(MPI.APPNUM) == 0
    # The workers' own COMM_WORLD: collectives among them only.
    assert world.allreduce(world.Get_rank()) == WORKERS * (WORKERS - 1) // 2
    assert world.allgather(world.Get_rank()) == list(range(WORKERS))
    dup = world.Dup()
    assert dup.bcast("w" if dup.Get_rank() == 0 else None, root=0) == "w"
    dup.Free()
    # Point-to-point with the parents, both ways.
    msg = parent.recv(source=0, tag=5)
    assert msg == ("task", world.Get_rank()), msg
    parent.send(("done", world.Get_rank()), dest=0, tag=6)
    # A bcast from the parents' rank 0 (MPI.ROOT there).
    assert parent.bcast(None, root=0) == {"from": "parents"}
    # Merge: the parents first (they pass high=False).
    merged = parent.Merge(high=True)
    assert merged.Get_size() == nparents + WORKERS
    assert merged.Get_rank() == nparents + world.Get_rank()
    assert merged.allreduce(1) == nparents + WORKERS
    merged.Free()
    parent.Disconnect()
    assert parent == MPI.COMM_NULL
    assert MPI.Comm.Get_parent() == MPI.COMM_NULL


def echo() -> None:
    parent = MPI.Comm.Get_parent()
    assert MPI.COMM_WORLD.Get_size() == 1
    parent.send(parent.recv(source=0, tag=1) * 2, dest=0, tag=2)
    parent.Disconnect()


def parents() -> None:
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    assert MPI.Comm.Get_parent() == MPI.COMM_NULL
    assert world.Get_attr(MPI.UNIVERSE_SIZE) == UNIVERSE
    assert world.Get_attr(MPI.APPNUM) == 0

    # COMM_WORLD spawns 3 workers; only the root's arguments count.
    errcodes: list[int] = []
    if rank == 0:
        child = world.Spawn(sys.executable, [__file__, "worker"], WORKERS, errcodes=errcodes)
    else:
        child = world.Spawn(None, None, -1, errcodes=errcodes)
    assert errcodes == [MPI.SUCCESS] * WORKERS, errcodes
    assert child.Is_inter() and child.Get_size() == n and child.Get_rank() == rank
    assert child.Get_remote_size() == WORKERS
    if rank == 0:
        for i in range(WORKERS):
            child.send(("task", i), dest=i, tag=5)
        status = MPI.Status()
        got = set()
        for _ in range(WORKERS):
            got.add(child.recv(source=MPI.ANY_SOURCE, tag=6, status=status))
            assert status.Get_source() in range(WORKERS)
        assert got == {("done", i) for i in range(WORKERS)}, got
        child.bcast({"from": "parents"}, root=MPI.ROOT)
    else:
        child.bcast(None, root=MPI.PROC_NULL)
    merged = child.Merge(high=False)
    assert merged.Get_size() == n + WORKERS and merged.Get_rank() == rank
    assert merged.allreduce(1) == n + WORKERS
    merged.Free()
    child.Disconnect()
    assert child == MPI.COMM_NULL

    # Two spawns in a row, from COMM_SELF: distinct contexts, both alive at once.
    first = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "echo"], 1)
    second = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "echo"], 1)
    assert first.py2f() != second.py2f()
    first.send(10 + rank, dest=0, tag=1)
    second.send(20 + rank, dest=0, tag=1)
    assert second.recv(source=0, tag=2) == 2 * (20 + rank)
    assert first.recv(source=0, tag=2) == 2 * (10 + rank)
    first.Disconnect()
    second.Disconnect()

    # Not a Python program: ERR_SPAWN at every member, the pool's reason as the message.
    codes: list[int] = []
    try:
        world.Spawn("/bin/true", None, 2, root=n - 1, errcodes=codes)
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_SPAWN, exc
        assert "not a Python program" in str(exc), str(exc)
    else:
        raise AssertionError("spawning /bin/true succeeded")
    assert codes == [MPI.ERR_SPAWN] * 2, codes

    world.Barrier()
    if rank == 0:
        print(f"spawn ok {n}", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    {"worker": worker, "echo": echo}.get(mode, parents)()
