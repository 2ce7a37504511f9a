"""Every rank prints its pid, then waits in a receive that nothing will ever match; rank 2, when
the test sends it SIGUSR1 (ranks have no network: the cue is a signal), fails as MODE says:
`raise` (an uncaught exception), `abort CODE` (MPI.Abort) or `exit CODE` (sys.exit).

    fail_on_cue.py MODE [CODE]
"""

import os
import signal
import sys

from mpi4py import MPI

# Blocked from the start: a cue that comes before the wait below stays pending, never lost.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
comm = MPI.COMM_WORLD
mode = sys.argv[1]
VICTIM = 2
sys.stdout.write(f"pid {comm.rank} {os.getpid()}\n")  # one write: ranks share the output
sys.stdout.flush()
comm.Barrier()
if comm.rank == VICTIM:
    signal.sigwait({signal.SIGUSR1})
    if mode == "raise":
        raise ValueError(f"boom in rank {comm.rank}")
    if mode == "abort":
        comm.Abort(int(sys.argv[2]))
    sys.exit(int(sys.argv[2]))
comm.recv(source=VICTIM)
