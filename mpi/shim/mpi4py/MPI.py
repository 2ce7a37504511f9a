"""``mpi4py.MPI`` is vpool's runtime namespace itself (one module object, not a copy)."""

import sys

from vpool.mpi import MPI as _runtime

sys.modules[__name__] = _runtime
