"""Deliberately non-deterministic: every rank sends rank 0 a fresh random number, forever
(until told to stop). A restarted incarnation re-sends a different number for the same message,
which the relays must catch ("program is not deterministic"), never complete with it."""

import os
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

for round_ in range(600):
    value = int.from_bytes(os.urandom(8), "big")
    if rank == 0:
        got = [comm.recv(source=r, tag=round_) for r in range(1, size)]
        if round_ == 5:
            print("exchanged", flush=True)
    else:
        comm.send(value, dest=0, tag=round_)
    time.sleep(0.05)
print("done", rank)
