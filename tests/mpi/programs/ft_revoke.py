"""ULFM calls in a transparent job, for restart with replay (``test_ulfm_replay.py``): a revoke
that others notice while waiting on each other, ANY_SOURCE receives racing the revocation,
Is_revoked polls, agreements (blocking and overlapped with other traffic) and a shrink with
nobody failed. Whatever the timing, the output is the same; a killed rank must replay it all.

Prints ``revoke ok <sum>`` on rank 0.
"""

from __future__ import annotations

import sys

from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
total = 0

for r in range(rounds):
    comm = world.Dup()
    # Some traffic on the new communicator, with ANY_SOURCE receives.
    comm.send((r, rank), (rank + 1) % size, 1)
    got = comm.recv(source=MPI.ANY_SOURCE, tag=1)
    total += got[0] + got[1]
    world.Barrier()  # everyone took its message before the revocation (else: ERR_REVOKED)
    revoker = r % size
    if rank == revoker:
        comm.Revoke()
    # Everyone else waits on its left neighbour, who never sends: only the revocation (the
    # revoker's notice, or the neighbour's forward) ends it.
    buf = bytearray(8)
    if rank != revoker:
        try:
            comm.Recv(buf, (rank - 1) % size, 2)
            raise AssertionError("a receive on a revoked communicator completed")
        except MPI.Exception as exc:
            assert exc.Get_error_class() == MPI.ERR_REVOKED, exc.Get_error_class()
    polls = 0
    while not comm.Is_revoked():
        polls += 1  # a logged test: replays the same number of times
    try:
        comm.Barrier()
        raise AssertionError("a barrier on a revoked communicator completed")
    except MPI.Exception as exc:
        assert exc.Get_error_class() == MPI.ERR_REVOKED
    flag = comm.Agree(0b1111 if rank != revoker else 0b0110)
    assert flag == 0b0110, flag
    shrunk = comm.Shrink()
    assert shrunk.Get_size() == size
    req = shrunk.Iagree(memoryview(bytearray(4)).cast("i"))
    total += shrunk.allreduce(rank + r)
    req.Wait()
    shrunk.Free()
    comm.Free()

total = world.allreduce(total)
if rank == 0:
    print(f"revoke ok {total}")
