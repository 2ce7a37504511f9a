"""Rank 1 goes past one limit (argv[1]: memory, fork, bigfile, manyfiles, daemon, nothing)."""

import os
import subprocess
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
what = sys.argv[1]
if comm.rank == 1 and what == "memory":
    hog = []
    while True:
        hog.append(bytearray(16 * 1024**2))  # zero-filled: every page is touched
elif comm.rank == 1 and what == "fork":
    children = []
    while True:
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
elif comm.rank == 1 and what == "bigfile":
    with open("big.bin", "wb") as f:
        for _ in range(128):
            f.write(b"\1" * 1024**2)
elif comm.rank == 1 and what == "manyfiles":
    for i in range(16):
        with open(f"part{i}.bin", "wb") as f:
            f.write(b"\1" * 8 * 1024**2)
    time.sleep(60)  # the agent notices the total within seconds
elif what == "daemon":
    marker = f"vpool-daemon-{os.environ['VPOOL_JOB']}"
    subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", marker],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
comm.Barrier()
print(f"rank {comm.rank} done")
