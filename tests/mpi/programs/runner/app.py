"""Run by ``python -m mpi4py runner/app.py``: imports a module next to itself (the runner puts
the script's directory first on sys.path) and sends a function defined in __main__ by reference."""

import sys

import helper
from mpi4py import MPI

comm = MPI.COMM_WORLD


def add(x):
    return x + helper.VALUE


got = comm.bcast(add if comm.rank == 0 else None)(1)
sys.stdout.write(f"{comm.rank} {sys.argv[1:]} {got}\n")  # one write: ranks share the terminal
sys.stdout.flush()
if sys.argv[1:2] == ["raise"] and comm.rank == 1:
    raise ValueError("boom from the runner's program")
if sys.argv[1:2] == ["exit"] and comm.rank == 1:
    sys.exit(6)
comm.Barrier()  # the others wait here until the job ends
