"""The ``mpi4py.MPI`` namespace served by vpool's runtime.

Rank processes get this module as ``mpi4py.MPI`` through the shim package (``shim/mpi4py``).
Importing it initializes MPI (connects to the agent), as importing mpi4py.MPI does, unless the
program set ``mpi4py.rc.initialize = False`` first.
"""

from __future__ import annotations

import operator
from typing import Any

# Re-exports: this module is a namespace.
from vpool.mpi import environment as _env
from vpool.mpi.buffers import BOTTOM, BUFFER_AUTOMATIC, IN_PLACE  # noqa: F401
from vpool.mpi.comm import Comm, Intercomm, Intracomm  # noqa: F401
from vpool.mpi.constants import *  # noqa: F403
from vpool.mpi.datatypes import *  # noqa: F403
from vpool.mpi.datatypes import Datatype  # noqa: F401
from vpool.mpi.derived import address as Get_address  # noqa: F401
from vpool.mpi.distgraph import UNWEIGHTED, WEIGHTS_EMPTY, Distgraphcomm  # noqa: F401
from vpool.mpi.envelope import typealign as _typealign  # noqa: F401
from vpool.mpi.envelope import typecode as _typecode  # noqa: F401
from vpool.mpi.errors import *  # noqa: F403
from vpool.mpi.errors import MPIException as Exception
from vpool.mpi.errors import add_error_class as Add_error_class  # noqa: F401
from vpool.mpi.errors import add_error_string as Add_error_string  # noqa: F401
from vpool.mpi.errors import error_class as Get_error_class  # noqa: F401
from vpool.mpi.errors import error_string as Get_error_string  # noqa: F401
from vpool.mpi.grequest import Grequest  # noqa: F401
from vpool.mpi.group import GROUP_EMPTY, GROUP_NULL, Group  # noqa: F401
from vpool.mpi.handles import (  # noqa: F401  # noqa: F401
    ERRHANDLER_NULL,
    ERRORS_ABORT,
    ERRORS_ARE_FATAL,
    ERRORS_RETURN,
    INFO_ENV,
    INFO_NULL,
    Errhandler,
    Info,
)
from vpool.mpi.message import MESSAGE_NO_PROC, MESSAGE_NULL, Message  # noqa: F401
from vpool.mpi.ops import *  # noqa: F403
from vpool.mpi.ops import Op  # noqa: F401
from vpool.mpi.outofscope import *  # noqa: F403
from vpool.mpi.request import REQUEST_NULL, Prequest, Request  # noqa: F401
from vpool.mpi.serialization import Pickle  # noqa: F401
from vpool.mpi.serialization import public_pickle as pickle  # noqa: F401
from vpool.mpi.status import Status  # noqa: F401
from vpool.mpi.topology import Cartcomm, Graphcomm, Topocomm  # noqa: F401
from vpool.mpi.topology import compute_dims as Compute_dims  # noqa: F401
from vpool.mpi.typedict import typedict as _typedict  # noqa: F401
from vpool.mpi.typedict import typedict_c as _typedict_c  # noqa: F401
from vpool.mpi.typedict import typedict_f as _typedict_f  # noqa: F401

COMM_WORLD = _env.COMM_WORLD
COMM_SELF = _env.COMM_SELF
COMM_NULL = Comm()

Init = _env.init
Finalize = _env.finalize
Is_initialized = _env.is_initialized
Is_finalized = _env.is_finalized
Init_thread = _env.init_thread
Query_thread = _env.query_thread
Is_thread_main = _env.is_thread_main
Wtime = _env.wtime
Wtick = _env.wtick
Get_processor_name = _env.processor_name
Attach_buffer = _env.attach_buffer
Detach_buffer = _env.detach_buffer
Flush_buffer = _env.flush_buffer
Iflush_buffer = _env.iflush_buffer


def Get_version() -> tuple[int, int]:
    return (VERSION, SUBVERSION)  # noqa: F405


def Get_library_version() -> str:
    return "vpool MPI runtime (mpi4py-compatible, messages through vpool relays)"


def get_vendor() -> tuple[str, tuple[int, int, int]]:
    """Not a vendor mpi4py knows: no test or program takes an MPICH/Open MPI code path for it."""
    return ("vpool", (0, 1, 0))


def Get_hw_resource_info() -> Info:
    """MPI 4.1's hardware resource info: what this rank's process may use."""
    import os

    return Info.Create({"mpi_hw_resource_type": "cpu", "ncpus": str(os.cpu_count() or 1)})


def Aint_add(base: int, disp: int) -> int:
    return operator.index(base) + operator.index(disp)


def Aint_diff(addr1: int, addr2: int) -> int:
    return operator.index(addr1) - operator.index(addr2)


def Pcontrol(level: int) -> None:
    pass


def Alloc_mem(size: int, info: Any = None) -> Any:
    """A ``buffer`` of ``size`` zeroed bytes (plain process memory: there is no RDMA to pin)."""
    from vpool.mpi.mpibuffer import buffer

    n = operator.index(size)
    if n < 0:
        raise Exception(ERR_ARG, f"Alloc_mem: negative size {n}")  # noqa: F405
    return buffer.allocate(n, clear=True)


def Free_mem(mem: Any) -> None:
    from vpool.mpi.mpibuffer import buffer

    if not isinstance(mem, buffer):
        raise TypeError(f"Free_mem: expected an MPI.buffer, got {type(mem).__name__}")
    mem.release()


def __getattr__(name: str) -> Any:
    # ``buffer`` (alias ``memory``) is a numpy array subclass: numpy loads on first use only.
    if name in ("buffer", "memory"):
        from vpool.mpi.mpibuffer import buffer

        return buffer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _comm_lock(comm: Comm, key: Any = None) -> Any:
    from vpool.mpi.comm import comm_lock

    return comm_lock(comm._core(), key)


def _comm_lock_table(comm: Comm) -> dict[Any, Any]:
    return comm._core().locks


def _initialize_on_import() -> None:
    """Start MPI as importing mpi4py.MPI does, following ``mpi4py.rc`` (``rcopts``)."""
    from vpool.mpi import rcopts

    policy = rcopts.errors()
    if policy != "exception":
        handler = ERRORS_ABORT if policy == "abort" else ERRORS_ARE_FATAL
        _env.default_errhandler = handler
    if not rcopts.initialize() or _env.is_initialized():
        return
    level = rcopts.thread_level()
    _env.init_thread(0 if level is None else level)  # threads off: THREAD_SINGLE


_initialize_on_import()
