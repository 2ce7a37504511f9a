"""Process-wide MPI state: Init/Finalize, the exit hook, Abort, clocks and processor name.

``init`` connects to the agent named by ``VPOOL_AGENT_SOCKET`` (or, without one, runs as a
single-rank job, like an MPICH singleton) and fills in COMM_WORLD (the welcome's ``world``),
COMM_SELF and, for a spawned process, the intercommunicator to its parents (``Get_parent``).
At interpreter exit the hook flushes the program's output and finalizes: it waits until the
relays have every message this rank sent, so none dies with the process. After an uncaught
exception it only flushes: the process exits non-zero and the job fails anyway.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from typing import Any

from vpool.mpi import errors, ftmpi
from vpool.mpi.comm import Intracomm, _Core
from vpool.mpi.constants import THREAD_SERIALIZED
from vpool.mpi.request import DoneOp, Request
from vpool.mpi.runtime import Engine
from vpool.protocol.rank_ft import K_NAME, K_WTIME

_NOT_STARTED, _RUNNING, _FINALIZED = 0, 1, 2

COMM_WORLD = Intracomm()
COMM_SELF = Intracomm()

_state = _NOT_STARTED
_engine: Engine | None = None
_processor = ""


def engine() -> Engine:
    if _engine is None:
        raise errors.MPIException(errors.ERR_OTHER, "MPI is not initialized")
    return _engine


def fault_tolerant() -> bool:
    """Whether this rank logs determinants: unless ``VPOOL_FT`` is ``0`` (or off/false/no)."""
    return os.environ.get("VPOOL_FT", "1").strip().lower() not in ("0", "off", "false", "no")


def _rank_secret() -> str:
    """The secret that proves to the agent which rank this is: from the file the agent
    wrote (deleted once read, so nothing the program starts later finds it), or, from
    ``vsdk mpiexec``, the environment."""
    path = os.environ.pop("VPOOL_RANK_SECRET_FILE", "")
    if not path:
        return os.environ.get("VPOOL_RANK_SECRET", "")
    try:
        with open(path, encoding="ascii") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise errors.MPIException(
            errors.ERR_OTHER, f"cannot read the rank's secret ({path}): {exc}"
        ) from exc
    try:
        os.unlink(path)
    except OSError:
        pass
    return secret


def init() -> None:
    global _state, _engine, _processor
    if _state != _NOT_STARTED:
        raise errors.MPIException(errors.ERR_OTHER, "MPI_Init called more than once")
    path = os.environ.get("VPOOL_AGENT_SOCKET")
    if path:
        from vpool.mpi import checkpoint
        from vpool.mpi.transport import Transport

        eng = Engine(0, 0, 1)
        secret = _rank_secret()
        transport = Transport.connect(path, secret, eng)
        welcome = transport.welcome
        eng.job, eng.rank, eng.size = transport.job, transport.rank, transport.size
        # COMM_WORLD: the ranks this process started with (a spawned one: its spawn's); the
        # job's rank numbers may go further (``size``: those it may spawn too).
        eng.world = tuple(welcome.world) or tuple(range(eng.size))
        eng.universe = welcome.universe or eng.size
        eng.transport = transport
        # ULFM: in a job whose failure mode reports failures, revocations act at once.
        eng.eager = transport.on_failure != "transparent"
        eng.strict = transport.on_failure in ftmpi.FT_MODES
        eng.ckpt = checkpoint.start(eng, transport, secret)  # None unless the agent asked
        _processor = transport.processor or socket.gethostname()
        # A restarted rank reads its determinants here, before the program runs.
        eng.ft.attach(
            transport, transport.replay_dets, transport.replay_sent, logging=fault_tolerant()
        )
    else:
        eng = Engine(0, 0, 1)
        _processor = socket.gethostname()
    _engine = eng
    COMM_WORLD._h = _Core(eng, 0, eng.world, "MPI_COMM_WORLD")
    COMM_SELF._h = _Core(eng, 2, (eng.rank,), "MPI_COMM_SELF")
    if path and transport.welcome.parent:
        from vpool.mpi import spawn

        welcome = transport.welcome
        eng.parent = spawn.parent_core(eng, eng.world, welcome.parent, welcome.parent_ctx)
        eng.parent.errh = default_errhandler
    COMM_WORLD._h.errh = COMM_SELF._h.errh = default_errhandler
    if eng.parent is not None and ftmpi.mode(eng) == "rebuild":
        ftmpi.join(eng, transport.welcome.parent)  # a replacement takes the rebuilt world
    _state = _RUNNING
    atexit.register(_at_exit)


def finalize() -> None:
    global _state
    if _state != _RUNNING:
        raise errors.MPIException(errors.ERR_OTHER, "MPI is not running")
    eng = engine()
    transport = eng.transport
    if transport is not None:
        eng._flush_notices()
        transport.finalize()
        transport.sock.close()
        eng.transport = None
        if eng.ckpt is not None:
            eng.ckpt.close()
    _state = _FINALIZED


def is_initialized() -> bool:
    return _state != _NOT_STARTED


def is_finalized() -> bool:
    return _state == _FINALIZED


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _at_exit() -> None:
    _flush()
    if _state != _RUNNING:
        return
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return  # an uncaught exception: no clean end to announce
    finalize()


def abort(code: int = 0, message: str = "") -> None:
    """End the whole job with ``code``: tell the agent, then leave at once."""
    _flush()
    eng = _engine
    if eng is not None and eng.transport is not None:
        try:
            eng.transport.abort(code, message or f"MPI.Abort({code}) called by rank {eng.rank}")
        except Exception:
            pass
    status = code & 0xFF
    os._exit(status if status or not code else 1)


def wtime() -> float:
    # One place to read the clock: its values are determinants (logged, replayed).
    eng = _engine
    if eng is None or eng.transport is None:
        return time.perf_counter()
    value = eng.ft.decide(K_WTIME, time.perf_counter)
    if value is None:
        eng.ft.missing("Wtime")
    return float(value)


def wtick() -> float:
    return time.get_clock_info("perf_counter").resolution


def processor_name() -> str:
    name = _processor or socket.gethostname()
    eng = _engine
    if eng is None or eng.transport is None:
        return name
    value = eng.ft.decide(K_NAME, lambda: name)
    if value is None:
        eng.ft.missing("Get_processor_name")
    return str(value)


_provided = THREAD_SERIALIZED  # the thread level Init_thread granted
# The handler COMM_WORLD and COMM_SELF start with (None: ERRORS_RETURN, errors raised as
# exceptions); ``mpi4py.rc.errors`` sets it (``rcopts``).
default_errhandler: Any = None


def init_thread(required: int) -> int:
    """Threads may call MPI one at a time (``THREAD_SERIALIZED``); a lower level asked for is
    granted as asked, as MPI libraries do."""
    global _provided
    init()
    _provided = min(int(required), THREAD_SERIALIZED)
    return _provided


def query_thread() -> int:
    return _provided


def is_thread_main() -> bool:
    return threading.current_thread() is threading.main_thread()


_attached: Any = None


def attach_buffer(buf: Any) -> None:
    """The process-wide buffer for buffered sends; ``detach_buffer`` gives the same object back."""
    global _attached
    from vpool.mpi.buffers import BUFFER_AUTOMATIC, byte_view

    if _attached is not None:
        raise errors.MPIException(errors.ERR_BUFFER, "a buffer is already attached")
    if buf is not BUFFER_AUTOMATIC:
        byte_view(buf, writable=True)  # BufferError if read-only, as in mpi4py
    _attached = buf


def detach_buffer() -> Any:
    global _attached
    buf, _attached = _attached, None
    return buf


def flush_buffer() -> None:
    # Buffered sends leave at once (every send is eager): nothing is ever pending.
    pass


def iflush_buffer() -> Request:
    return Request._of(DoneOp())
