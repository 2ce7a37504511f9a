"""Rank 1 sends a few messages, then computes without any MPI call (a pure Python loop bounded
by its iteration count), then sends the result and a few more messages. A checkpoint requested
after its first messages can only be taken by the signal handler, during the loop."""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.rank
FIRST = 5
AFTER = 20
ITERATIONS = 4_000_000
if rank == 1:
    for i in range(FIRST):
        comm.send(i, dest=0, tag=1)
    acc = 0
    for i in range(ITERATIONS):
        acc = (acc * 31 + i) % 1_000_003
    comm.send(acc, dest=0, tag=2)
    for i in range(AFTER):
        comm.send(i * i, dest=0, tag=3)
elif rank == 0:
    assert [comm.recv(source=1, tag=1) for _ in range(FIRST)] == list(range(FIRST))
    acc = comm.recv(source=1, tag=2)
    assert [comm.recv(source=1, tag=3) for _ in range(AFTER)] == [i * i for i in range(AFTER)]
    print("compute ok", acc)
