"""Keeps a secret file in its work directory and lives for argv[1] seconds."""

import sys
import time

from mpi4py import MPI

with open("keeper-secret.txt", "w") as f:
    f.write("the keeper's secret")
time.sleep(float(sys.argv[1]))
MPI.COMM_WORLD.Barrier()
