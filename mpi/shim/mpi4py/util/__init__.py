"""``mpi4py.util``: miscellaneous utilities, each a submodule as in mpi4py.

``pkl5`` and ``dtlib`` are vpool's own (see each); ``pool`` and ``sync`` are mpi4py 4.1.2's,
vendored (``LICENSE.mpi4py``).
"""
