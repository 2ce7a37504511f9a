"""ULFM end to end: one rank SIGKILLs itself and the survivors see it the ULFM way
(``tests/mpi/test_ulfm_processes.py`` runs each scenario with ``--on-failure ulfm``).

    ulfm_failures.py recv          ERR_PROC_FAILED in Recv, Barrier and Iallreduce, ANY_SOURCE
                                   pending until acknowledged, Agree, Shrink, then a collective on
                                   the survivors
    ulfm_failures.py revoke_die    the last rank revokes COMM_WORLD and dies at once: the others,
                                   waiting on each other, get ERR_REVOKED (the notice forwarded)
    ulfm_failures.py agree_during  the last rank starts an agreement and dies in it: every
                                   survivor gets the same value
    ulfm_failures.py abort         the last rank dies (run with --on-failure abort: the job ends)

Every survivor prints one line ``<scenario> ok <rank> ...``; a check that fails raises.
"""

from __future__ import annotations

import os
import signal
import sys

from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
victim = size - 1


def sync() -> None:
    """Every rank is past a barrier before the victim acts: a failure or revocation that came
    during the barrier would fail it (rightly, in ULFM), not the call a scenario checks."""
    world.Barrier()
    if rank == victim:
        for r in range(size - 1):
            world.Recv(bytearray(1), r, 99)
    else:
        world.Send(b"r", victim, 99)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def error_class(call, *args):  # type: ignore[no-untyped-def]
    try:
        call(*args)
    except MPI.Exception as exc:
        return exc.Get_error_class()
    return MPI.SUCCESS


def expect(got: int, want: int, what: str) -> None:
    if got != want:
        raise AssertionError(f"rank {rank}: {what}: error class {got}, expected {want}")


def survivors_check(comm: MPI.Intracomm) -> int:
    """A collective on the shrunk communicator: the sum of the survivors' world ranks."""
    total = comm.allreduce(rank)
    want = sum(range(size)) - victim
    assert total == want, (total, want)
    assert comm.Get_size() == size - 1
    assert comm.Get_rank() == rank  # the same order: the victim was last
    return int(total)


def recv() -> None:
    sync()
    if rank == victim:
        die()
    buf = bytearray(4)
    if rank == 0:
        expect(error_class(world.Recv, buf, victim, 7), MPI.ERR_PROC_FAILED, "Recv from it")
    elif rank % 2:
        expect(error_class(world.Barrier), MPI.ERR_PROC_FAILED, "Barrier")
    else:  # a non-blocking collective's schedule fails the same way
        expect(
            error_class(world.Iallreduce(b"\0", bytearray(1)).Wait),
            MPI.ERR_PROC_FAILED,
            "Iallreduce",
        )
    failed = world.Get_failed()
    assert failed.Get_size() == 1, failed.Get_size()
    assert MPI.Group.Translate_ranks(failed, [0], world.Get_group()) == [victim]
    assert error_class(world.Send, buf, victim, 1) == MPI.ERR_PROC_FAILED
    if size >= 3 and rank == 0:
        req = world.Irecv(buf, MPI.ANY_SOURCE, 5)
        expect(error_class(req.Wait), MPI.ERR_PROC_FAILED_PENDING, "ANY_SOURCE Wait")
        expect(error_class(req.Test), MPI.ERR_PROC_FAILED_PENDING, "ANY_SOURCE Test")
        assert world.Ack_failed() == 1
        world.Send(b"go!!", 1, 4)
        status = MPI.Status()
        req.Wait(status)
        assert (status.Get_source(), bytes(buf)) == (1, b"from"), (status.Get_source(), buf)
    elif size >= 3 and rank == 1:
        world.Recv(buf, 0, 4)
        world.Send(b"from", 0, 5)
    # An agreement raises everywhere while a failure is not acknowledged by every member (rank
    # 0 acknowledged it, the others not); once they all have, it agrees.
    expect(error_class(world.Agree, 1), MPI.ERR_PROC_FAILED, "Agree before all acknowledged")
    world.Ack_failed()
    flag = world.Agree(0b1111 if rank else 0b0111)
    assert flag == 0b0111, flag
    shrunk = world.Shrink()
    total = survivors_check(shrunk)
    print(f"recv ok {rank} {total} {flag}")


def revoke_die() -> None:
    sync()
    if rank == victim:
        world.Revoke()
        die()
    buf = bytearray(4)
    # Wait on another survivor that never sends: only the revocation ends this.
    peer = (rank + 1) % (size - 1)
    expect(error_class(world.Recv, buf, peer, 3), MPI.ERR_REVOKED, "Recv on a revoked comm")
    assert world.Is_revoked()
    expect(error_class(world.Send, buf, MPI.PROC_NULL), MPI.ERR_REVOKED, "Send to PROC_NULL")
    expect(error_class(world.Bcast, buf, 0), MPI.ERR_REVOKED, "Bcast")
    shrunk = world.Shrink()
    assert not shrunk.Is_revoked()
    total = survivors_check(shrunk)
    print(f"revoke_die ok {rank} {total}")


def agree_during() -> None:
    sync()
    flag = memoryview(bytearray(4)).cast("i")
    if rank == victim:
        flag[0] = 0b0110
        world.Iagree(flag)  # its first round is on its way
        die()
    flag[0] = 0b1111
    code = error_class(world.Iagree(flag).Wait)
    assert code in (MPI.SUCCESS, MPI.ERR_PROC_FAILED), code
    value = flag[0]
    assert value in (0b0110, 0b1111), value
    world.Ack_failed()
    shrunk = world.Shrink()
    survivors_check(shrunk)
    values = shrunk.allgather((value, code))
    assert len(set(values)) == 1, values  # uniform value and error, whichever they were
    again = shrunk.Agree(0b0011 if rank % 2 else 0b0101)
    assert again == (0b0001 if shrunk.Get_size() > 1 else 0b0101), again
    print(f"agree_during ok {rank} {values[0]}")


def abort() -> None:
    sync()
    if rank == victim:
        die()
    world.Barrier()  # never completes: the job ends first
    print(f"abort not ended {rank}")


{"recv": recv, "revoke_die": revoke_die, "agree_during": agree_during, "abort": abort}[
    sys.argv[1]
]()
