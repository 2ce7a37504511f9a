"""Polling loops whose outcomes depend on timing: Waitany/Testany/Testsome/Iprobe/Test, Wtime."""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
ROUNDS = 30
total = 0
t0 = MPI.Wtime()
for r in range(ROUNDS):
    if rank == 0:
        reqs = [comm.irecv(source=s, tag=r) for s in range(1, size)]
        got = 0
        while got < size - 1:
            if r % 3 == 0:
                i, msg = MPI.Request.waitany(reqs)
            elif r % 3 == 1:
                i, flag, msg = MPI.Request.testany(reqs)
                if not flag:
                    continue
            else:
                idx, msgs = MPI.Request.testsome(reqs)
                if not idx:
                    continue
                for i, msg in zip(idx, msgs, strict=True):
                    total += msg
                    reqs[i] = MPI.REQUEST_NULL
                    got += 1
                continue
            total += msg
            reqs[i] = MPI.REQUEST_NULL
            got += 1
        for s in range(1, size):
            comm.send(total, dest=s, tag=1000 + r)
    else:
        comm.send(rank * r, dest=0, tag=r)
        while not comm.iprobe(source=0, tag=1000 + r):
            MPI.Wtime()
        req = comm.irecv(source=0, tag=1000 + r)
        while True:
            flag, total = req.test()
            if flag:
                break
elapsed = MPI.Wtime() - t0
assert elapsed >= 0
expect = sum(s * r for r in range(ROUNDS) for s in range(1, size))
assert total == expect, (total, expect)
name = MPI.Get_processor_name()
assert name
if rank == 0:
    print("poll ok", total)
