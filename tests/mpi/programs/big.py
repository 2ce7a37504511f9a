"""Large messages both ways at once: blocking sends first, so neither rank is receiving."""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
mib = int(sys.argv[1]) if len(sys.argv) > 1 else 64
n = mib * 1024 * 1024 // 8
peer = rank ^ 1
if peer < size:
    out = np.arange(n, dtype="f8") + rank
    comm.Send(out, dest=peer, tag=1)
    got = np.empty(n, dtype="f8")
    comm.Recv(got, source=peer, tag=1)
    assert got[0] == peer and got[-1] == n - 1 + peer and np.array_equal(got, out - rank + peer)
    # Pickled with out-of-band buffers, also both ways at once.
    comm.send({"a": out[: n // 2], "r": rank}, dest=peer, tag=2)
    back = comm.recv(source=peer, tag=2)
    assert back["r"] == peer and np.array_equal(back["a"], got[: n // 2])
    back["a"][0] = -1.0  # received arrays are writable
    # Unexpected large message, received later with a buffer larger than needed.
    comm.Send(out[:1000], dest=peer, tag=3)
    comm.Barrier()
    big = np.zeros(2000)
    st = MPI.Status()
    comm.Recv(big, source=peer, tag=3, status=st)
    assert st.Get_count(MPI.DOUBLE) == 1000 and big[999] == 999 + peer
else:
    comm.Barrier()
comm.Barrier()
if rank == 0:
    print("big ok", mib)
