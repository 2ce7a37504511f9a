"""A rank of another job, running beside one that goes past a limit: it waits until the test
puts a file named "go" in its work directory (it sees no other), then ends normally."""

import os
import time

from mpi4py import MPI

print("waiting", flush=True)
while not os.path.exists("go"):
    time.sleep(0.05)
MPI.COMM_WORLD.Barrier()
print("done", flush=True)
