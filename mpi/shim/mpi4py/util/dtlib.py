"""``mpi4py.util.dtlib`` is vpool's datatype <-> numpy dtype module itself (one module object)."""

import sys

from vpool.mpi import npdtype as _npdtype

sys.modules[__name__] = _npdtype
