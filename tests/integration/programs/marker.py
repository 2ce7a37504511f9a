"""Sends argv[1] around a ring of ranks, as a pickled object and as a raw buffer, waits
argv[2] seconds (the test looks at the relays' logs meanwhile), and prints what came back: the
marker crosses the relays in every message."""

import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
marker = sys.argv[1]
right, left = (rank + 1) % size, (rank - 1) % size
got = comm.sendrecv({"from": rank, "marker": marker}, dest=right, source=left)
raw = np.frombuffer(marker.encode(), dtype=np.uint8)
back = np.empty_like(raw)
comm.Sendrecv(raw, dest=right, recvbuf=back, source=left)
time.sleep(float(sys.argv[2]))
comm.Barrier()
print(rank, got["from"], got["marker"], back.tobytes().decode(), flush=True)
