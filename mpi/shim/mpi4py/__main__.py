"""``python -m mpi4py [options] <pyfile | -m mod | -c cmd | -> [arg] ...``: see ``mpi4py.run``."""

from mpi4py.run import main

if __name__ == "__main__":
    main()
