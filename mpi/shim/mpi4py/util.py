"""``mpi4py.util``: the helpers programs import from it, as modules of this one.

``pkl5``: mpi4py's large-message pickling; vpool's lower-case calls already use pickle protocol 5
with out-of-band buffers and have no 2 GiB limit, so its communicators are the plain ones.
``dtlib``: datatypes <-> numpy dtypes.
"""

from __future__ import annotations

import sys
import types

from mpi4py import MPI
from vpool.mpi import npdtype as _npdtype

__all__ = ["dtlib", "pkl5"]


class _Comm(MPI.Comm):
    pass


class _Intracomm(MPI.Intracomm):
    pass


class _Intercomm(MPI.Intercomm):
    pass


pkl5 = types.ModuleType("mpi4py.util.pkl5", "Pickle-based communication of large messages.")
pkl5.Comm = _Comm  # type: ignore[attr-defined]
pkl5.Intracomm = _Intracomm  # type: ignore[attr-defined]
pkl5.Intercomm = _Intercomm  # type: ignore[attr-defined]
pkl5.Request = MPI.Request  # type: ignore[attr-defined]
pkl5.Message = MPI.Message  # type: ignore[attr-defined]
pkl5.pickle = MPI.pickle  # type: ignore[attr-defined]


dtlib = _npdtype

# ``import mpi4py.util.pkl5`` finds these once this module is imported.
sys.modules[pkl5.__name__] = pkl5
sys.modules["mpi4py.util.dtlib"] = dtlib
