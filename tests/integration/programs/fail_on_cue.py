"""Every rank prints its pid, then waits in a receive that nothing will ever match; rank 2 first
connects to the test (127.0.0.1:PORT) and, when the test sends a byte, fails as MODE says:
`raise` (an uncaught exception), `abort CODE` (MPI.Abort) or `exit CODE` (sys.exit).

    fail_on_cue.py PORT MODE [CODE]
"""

import os
import socket
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
port, mode = int(sys.argv[1]), sys.argv[2]
VICTIM = 2
if comm.rank == VICTIM:
    cue = socket.create_connection(("127.0.0.1", port))
sys.stdout.write(f"pid {comm.rank} {os.getpid()}\n")  # one write: ranks share the output
sys.stdout.flush()
comm.Barrier()
if comm.rank == VICTIM:
    cue.recv(1)
    if mode == "raise":
        raise ValueError(f"boom in rank {comm.rank}")
    if mode == "abort":
        comm.Abort(int(sys.argv[3]))
    sys.exit(int(sys.argv[3]))
comm.recv(source=VICTIM)
