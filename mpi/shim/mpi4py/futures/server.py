# Author:  Lisandro Dalcin
# Contact: dalcinl@gmail.com
# Copyright (c) 2026, Lisandro Dalcin. BSD-3-Clause: see ../LICENSE.mpi4py.
# Vendored from mpi4py 4.1.2 (src/mpi4py/futures/server.py) into vpool's mpi4py shim.
# vpool's changes: none.
"""Entry point for MPI workers."""


def main():
    """Entry point for worker processes."""
    # pylint: disable=import-outside-toplevel
    from . import _core

    _core.server_main()


if __name__ == "__main__":
    main()
