"""ANY_SOURCE task farm: rank 0 hands out tasks to whoever answers first.

Every worker is first given PREFETCH tasks, so each one deposits at least that many results
whatever the scheduling (a kill after N <= PREFETCH messages of a worker always fires)."""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
N = 300
PREFETCH = 10
if rank == 0:
    tasks = list(range(N))
    results = {}
    st = MPI.Status()
    busy = 0
    for _ in range(PREFETCH):
        for w in range(1, size):
            if tasks:
                comm.send(tasks.pop(), dest=w, tag=1)
                busy += 1
    while busy:
        n, sq, who = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
        assert st.source == who and st.tag == 2
        results[n] = sq
        if tasks:
            comm.send(tasks.pop(), dest=st.source, tag=1)
        else:
            busy -= 1
    for w in range(1, size):
        comm.send(None, dest=w, tag=3)
    if size == 1:
        results = {n: n * n for n in range(N)}
    assert results == {n: n * n for n in range(N)}
    print("farm ok", len(results))
else:
    st = MPI.Status()
    while True:
        n = comm.recv(source=0, tag=MPI.ANY_TAG, status=st)
        if st.tag == 3:
            break
        comm.send((n, n * n, rank), dest=0, tag=2)
