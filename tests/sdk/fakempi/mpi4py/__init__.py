"""A tiny in-process stand-in for mpi4py, for testing the examples without any MPI.

Ranks are threads of one process (see ``sdk_fakempi.run_ranks``); only what the examples use
is here. It is not vpool's runtime (``vpool.mpi``), which has its own tests.
"""
